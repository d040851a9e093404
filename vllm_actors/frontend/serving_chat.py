"""POST /v1/chat/completions: JSON or SSE in OpenAI's chat.completion(.chunk) format."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from vllm_actors.errors import ValidationError
from vllm_actors.frontend.chat_tools import ToolPlan, choice_parser, plan_tools
from vllm_actors.frontend.openai_schema import (APIError, ChatCompletionRequest, chat_logprobs,
                                                chat_messages, decode_request, max_tokens_for,
                                                prompt_logprobs_json, refuse_unsupported,
                                                sampling_params, structured_outputs_of)
from vllm_actors.frontend.serving import (ServerState, SubRequest, generate_final, new_request_id,
                                          now, raise_if_failed, stream_error, stream_outputs,
                                          usage)

logger = logging.getLogger("vllm_actors.server")
_json = msgspec.json.Encoder()


def _prepare(state: ServerState, req: ChatCompletionRequest
             ) -> tuple[SubRequest, int, ToolPlan]:
    state.check_model(req.model)
    refuse_unsupported(req)
    messages = chat_messages(req)
    plan = plan_tools(req, state.config)
    structured, constraint_field = structured_outputs_of(req)
    if plan.structured is not None and structured is not None:
        raise APIError(400, f'tool_choice "{plan.choice}" already constrains the output; it '
                            "cannot be combined with response_format or structured_outputs",
                       "tool_choice")
    try:
        text = state.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tokenize=False,
            chat_template=req.chat_template, tools=req.tools or None,
            **(req.chat_template_kwargs or {}))
    except ValidationError as e:
        raise APIError(400, str(e), "messages") from None
    ids = state.engine.tokenizer.encode(str(text), add_special_tokens=False)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    limit = max_tokens_for(requested, len(ids), state.engine.ready.max_model_len)
    params = sampling_params(req, limit, state.engine.generation_defaults, req.stream,
                             plan.structured or structured)
    if plan.parser is not None and plan.parser.special_markers:
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    sub = SubRequest(new_request_id("chatcmpl"), {"prompt": text, "prompt_token_ids": ids},
                     params)
    state.validate(sub, constraint_param="tools" if plan.structured else constraint_field)
    return sub, len(ids), plan


def _finish_reason(reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and reason == "stop" else reason


async def create_chat_completion(state: ServerState, raw: Request) -> Response:
    req = decode_request(await raw.body(), ChatCompletionRequest)
    state.admit()
    sub, num_prompt, plan = _prepare(state, req)
    if not state.config.disable_log_requests:
        logger.info("chat request %s: %d prompt tokens, %s", sub.request_id, num_prompt,
                    sub.params)
    if req.stream:
        return EventSourceResponse(_stream(state, req, sub, num_prompt, plan), ping=15,
                                   sep="\n")
    outputs = await generate_final(state, raw, [sub])
    if outputs is None:
        return Response(status_code=499)
    out = outputs[0]
    raise_if_failed(out)
    k = req.top_logprobs or 0
    constrained = sub.params.structured_outputs is not None
    choices = []
    for c in out.outputs:
        message, called = choice_parser(plan, state.config, constrained).message(c.text)
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(c.logprobs, c.token_ids, k),
                        "finish_reason": _finish_reason(c.finish_reason, called),
                        "stop_reason": c.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    body = {"id": sub.request_id, "object": "chat.completion", "created": now(),
            "model": state.model_name, "choices": choices,
            "usage": usage(num_prompt, completion_tokens, out.num_cached_tokens)}
    if out.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    return JSONResponse(body)


async def _stream(state: ServerState, req: ChatCompletionRequest, sub: SubRequest,
                  num_prompt: int, plan: ToolPlan) -> AsyncIterator[str]:
    created, opts = now(), req.stream_options
    include_usage = state.config.enable_force_include_usage or bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    completion_tokens = cached = 0

    def chunk(choices: list[dict[str, Any]]) -> str:
        body: dict[str, Any] = {"id": sub.request_id, "object": "chat.completion.chunk",
                                "created": created, "model": state.model_name,
                                "choices": choices}
        if continuous:
            body["usage"] = usage(num_prompt, completion_tokens, cached)
        return _json.encode(body).decode()

    for index in range(sub.params.n):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
    constrained = sub.params.structured_outputs is not None
    parsers = [choice_parser(plan, state.config, constrained) for _ in range(sub.params.n)]
    try:
        async for _, out in stream_outputs(state, [sub]):
            cached = out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                delta, called = parsers[c.index].update(c.text, c.finish_reason is not None)
                if not delta and c.finish_reason is None and not (c.logprobs and c.token_ids):
                    continue
                choice: dict[str, Any] = {
                    "index": c.index, "delta": delta,
                    "logprobs": chat_logprobs(c.logprobs, c.token_ids, req.top_logprobs or 0),
                    "finish_reason": _finish_reason(c.finish_reason, called)}
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice])
    except Exception as e:   # the engine died mid-stream: say so in the stream
        yield _json.encode(stream_error(e)).decode()
    if include_usage:
        yield _json.encode({"id": sub.request_id, "object": "chat.completion.chunk",
                            "created": created, "model": state.model_name, "choices": [],
                            "usage": usage(num_prompt, completion_tokens, cached)}).decode()
    yield "[DONE]"
