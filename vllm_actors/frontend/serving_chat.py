"""POST /v1/chat/completions: JSON or SSE in OpenAI's chat.completion(.chunk) format."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from vllm_actors.errors import ValidationError
from vllm_actors.frontend.openai_schema import (APIError, ChatCompletionRequest, chat_logprobs,
                                                chat_messages, decode_request, max_tokens_for,
                                                prompt_logprobs_json, refuse_unsupported,
                                                sampling_params)
from vllm_actors.frontend.serving import (ServerState, SubRequest, generate_final, new_request_id,
                                          now, raise_if_failed, stream_error, stream_outputs,
                                          usage)

logger = logging.getLogger("vllm_actors.server")
_json = msgspec.json.Encoder()


def _prepare(state: ServerState, req: ChatCompletionRequest) -> tuple[SubRequest, int]:
    state.check_model(req.model)
    refuse_unsupported(req)
    messages = chat_messages(req)
    try:
        text = state.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tokenize=False,
            chat_template=req.chat_template, **(req.chat_template_kwargs or {}))
    except ValidationError as e:
        raise APIError(400, str(e), "messages") from None
    ids = state.engine.tokenizer.encode(str(text), add_special_tokens=False)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    limit = max_tokens_for(requested, len(ids), state.engine.ready.max_model_len)
    params = sampling_params(req, limit, state.engine.generation_defaults, req.stream)
    sub = SubRequest(new_request_id("chatcmpl"), {"prompt": text, "prompt_token_ids": ids},
                     params)
    state.validate(sub)
    return sub, len(ids)


async def create_chat_completion(state: ServerState, raw: Request) -> Response:
    req = decode_request(await raw.body(), ChatCompletionRequest)
    state.admit()
    sub, num_prompt = _prepare(state, req)
    if not state.config.disable_log_requests:
        logger.info("chat request %s: %d prompt tokens, %s", sub.request_id, num_prompt,
                    sub.params)
    if req.stream:
        return EventSourceResponse(_stream(state, req, sub, num_prompt), ping=15, sep="\n")
    outputs = await generate_final(state, raw, [sub])
    if outputs is None:
        return Response(status_code=499)
    out = outputs[0]
    raise_if_failed(out)
    k = req.top_logprobs or 0
    choices = [{"index": c.index,
                "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                "logprobs": chat_logprobs(c.logprobs, c.token_ids, k),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for c in out.outputs]
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    body = {"id": sub.request_id, "object": "chat.completion", "created": now(),
            "model": state.model_name, "choices": choices,
            "usage": usage(num_prompt, completion_tokens, out.num_cached_tokens)}
    if out.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    return JSONResponse(body)


async def _stream(state: ServerState, req: ChatCompletionRequest, sub: SubRequest,
                  num_prompt: int) -> AsyncIterator[str]:
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
    try:
        async for _, out in stream_outputs(state, [sub]):
            cached = out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                if not c.text and c.finish_reason is None and not (c.logprobs and c.token_ids):
                    continue
                choice: dict[str, Any] = {
                    "index": c.index, "delta": {"content": c.text} if c.text else {},
                    "logprobs": chat_logprobs(c.logprobs, c.token_ids, req.top_logprobs or 0),
                    "finish_reason": c.finish_reason}
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
