"""POST /v1/chat/completions: JSON or SSE in OpenAI's chat.completion(.chunk) format."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from vllm_actors.config import ServerConfig
from vllm_actors.errors import ValidationError
from vllm_actors.frontend.chat_tools import ChoiceParser, ToolPlan, choice_parser, plan_tools
from vllm_actors.frontend.openai_schema import (APIError, ChatCompletionRequest, chat_logprobs,
                                                chat_messages, max_tokens_for,
                                                prompt_logprobs_json, refuse_unsupported,
                                                sampling_params, structured_outputs_of)
from vllm_actors.frontend.reasoning import prompt_thinking
from vllm_actors.frontend.request_body import decode_request, read_body
from vllm_actors.frontend.serving import (EventStream, ServerState, SubRequest, generate_final,
                                          json_built_off_loop, new_request_id, now,
                                          open_stream, raise_if_failed, stream_error, usage)
from vllm_actors.outputs import RequestOutput

_json = msgspec.json.Encoder()


@dataclass
class PreparedChat:
    req: ChatCompletionRequest
    sub: SubRequest
    plan: ToolPlan
    constraint_param: str | None
    echo: str = ""   # the text `echo` puts before each choice's content
    thinking: bool | None = None   # what the prompt did to the reasoning (prompt_thinking)

    def parser(self, config: ServerConfig) -> ChoiceParser:
        """A parser for one choice's text."""
        return choice_parser(self.plan, config, self.sub.params.structured_outputs is not None,
                             self.thinking)

    def shown(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A message or delta as the request asked: without reasoning under
        `include_reasoning: false`, as vLLM's."""
        if not self.req.include_reasoning:
            fields.pop("reasoning", None)
            fields.pop("reasoning_content", None)
        return fields


def _echo_text(req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
    """vLLM's chat `echo`: the last message's content when it has the role of the reply
    (assistant, or the last message's role without a generation prompt)."""
    role = "assistant" if req.add_generation_prompt else messages[-1]["role"]
    last = messages[-1]
    return last.get("content") or "" if req.echo and last["role"] == role else ""


def prepare_chat(state: ServerState, req: ChatCompletionRequest, request_id: str
                 ) -> PreparedChat:
    """Everything a chat request needs before it runs (in the preparation pool): checks,
    tool plan, the rendered and tokenized conversation, validated SamplingParams."""
    lora = state.check_model(req.model)
    refuse_unsupported(req)
    state.check_chat_template(req.chat_template)
    messages = chat_messages(req)
    plan = plan_tools(req, state.config)
    structured, constraint_field = structured_outputs_of(req)
    if plan.structured is not None and structured is not None:
        raise APIError(400, f'tool_choice "{plan.choice}" already constrains the output; it '
                            "cannot be combined with response_format or structured_outputs",
                       "tool_choice")
    try:
        prompt = state.engine.input_processor.chat_prompt(
            messages, req.chat_template, req.add_generation_prompt, req.tools or None,
            req.chat_template_kwargs, req.add_special_tokens is True,
            req.truncate_prompt_tokens, req.continue_final_message, req.documents)
    except ValidationError as e:
        raise APIError(400, str(e), "messages" if e.param in (None, "prompt") else e.param) \
            from None
    prompt["cache_salt"] = req.cache_salt
    requested = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    limit = max_tokens_for(requested, len(prompt["prompt_token_ids"]),
                           state.engine.ready.max_model_len, "messages")
    with _top_logprobs_named():
        params = sampling_params(req, limit, state.engine.generation_defaults, req.stream,
                                 plan.structured or structured)
        if plan.parser is not None and plan.parser.special_markers:
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        sub = SubRequest(request_id, prompt, params, req.priority, lora=lora)
        constraint_param = "tools" if plan.structured else constraint_field
        state.process(sub, "messages", constraint_param)
    return PreparedChat(req, sub, plan, constraint_param, _echo_text(req, messages),
                        prompt_thinking(req.chat_template_kwargs, prompt["prompt"]))


@contextlib.contextmanager
def _top_logprobs_named() -> Iterator[None]:
    """A chat request asks for logprobs by `top_logprobs`: errors about them name it."""
    try:
        yield
    except APIError as e:
        if e.param != "logprobs" or not e.message.startswith("logprobs"):
            raise
        raise APIError(400, "top_" + e.message, "top_logprobs") from None


def _decode_and_prepare(state: ServerState, body: bytes, raw: Request) -> PreparedChat:
    req = decode_request(body, ChatCompletionRequest)
    return prepare_chat(state, req, new_request_id("chatcmpl", req.request_id, raw))


def _finish_reason(reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and reason == "stop" else reason


async def create_chat_completion(state: ServerState, raw: Request) -> Response:
    body = await read_body(raw, state.config.max_request_body_size)
    state.admit()
    prepared = await state.prepare(_decode_and_prepare, state, body, raw, body=body)
    req, sub = prepared.req, prepared.sub
    state.log_request("chat", sub.request_id, sub.num_prompt_tokens, sub.params)
    if req.stream:
        outputs = await open_stream(state, [sub], prepared.constraint_param)
        return EventStream(_stream(state, prepared, outputs), outputs)
    results = await generate_final(state, raw, [sub])
    if results is None:
        return Response(status_code=499)
    out = results[0]
    raise_if_failed(out, prepared.constraint_param)
    return await json_built_off_loop(state, chat_response, state, prepared, out)


def chat_response(state: ServerState, prepared: PreparedChat, out: RequestOutput
                  ) -> dict[str, Any]:
    """The chat.completion body for a finished request."""
    req, sub = prepared.req, prepared.sub
    k = req.top_logprobs or 0
    choices = []
    for c in out.outputs:
        message, called = prepared.parser(state.config).message(c.text)
        message = prepared.shown(message)
        if prepared.echo:
            message["content"] = prepared.echo + (message.get("content") or "")
        choice = {"index": c.index, "message": message,
                  "logprobs": chat_logprobs(c.logprobs, c.token_ids, k,
                                            req.return_tokens_as_token_ids),
                  "finish_reason": _finish_reason(c.finish_reason, called),
                  "stop_reason": c.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    body = {"id": sub.request_id, "object": "chat.completion", "created": now(),
            "model": state.served_name(req.model), "choices": choices,
            "usage": usage(sub.num_prompt_tokens, completion_tokens, out.num_cached_tokens)}
    if out.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    if req.return_token_ids:
        body["prompt_token_ids"] = out.prompt_token_ids
    return body


async def _stream(state: ServerState, prepared: PreparedChat,
                  outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    req, sub = prepared.req, prepared.sub
    created, opts, num_prompt = now(), req.stream_options, sub.num_prompt_tokens
    include_usage = state.config.enable_force_include_usage or bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    generated, cached = [0] * sub.params.n, 0     # tokens of each choice so far

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        """A chunk of one choice's; continuous usage counts that choice, as vLLM's."""
        body: dict[str, Any] = {"id": sub.request_id, "object": "chat.completion.chunk",
                                "created": created, "model": state.served_name(req.model),
                                "choices": choices, **extra}
        if continuous:
            body["usage"] = usage(num_prompt, generated[choices[0]["index"]], cached)
        return _json.encode(body).decode()

    first_ids = {"prompt_token_ids": sub.processed.request.prompt_token_ids} \
        if req.return_token_ids and sub.processed is not None else {}
    for index in range(sub.params.n):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}], **first_ids)
        if prepared.echo:
            yield chunk([{"index": index, "delta": {"content": prepared.echo},
                          "logprobs": None, "finish_reason": None}])
    parsers = [prepared.parser(state.config) for _ in range(sub.params.n)]
    try:
        async for _, out in outputs:
            cached = out.num_cached_tokens
            for c in out.outputs:
                generated[c.index] += len(c.token_ids)
                delta, called = parsers[c.index].update(c.text, c.finish_reason is not None)
                delta = prepared.shown(delta)
                if not delta and c.finish_reason is None and not (
                        (c.logprobs or req.return_token_ids) and c.token_ids):
                    continue     # (text held back: a character or stop string unfinished)
                choice: dict[str, Any] = {
                    "index": c.index, "delta": delta,
                    "logprobs": chat_logprobs(c.logprobs, c.token_ids, req.top_logprobs or 0,
                                              req.return_tokens_as_token_ids),
                    "finish_reason": _finish_reason(c.finish_reason, called)}
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice])
    except Exception as e:   # the engine died mid-stream: say so in the stream
        yield _json.encode(stream_error(e)).decode()
    if include_usage:
        yield _json.encode({"id": sub.request_id, "object": "chat.completion.chunk",
                            "created": created, "model": state.served_name(req.model), "choices": [],
                            "usage": usage(num_prompt, sum(generated), cached)}).decode()
    yield "[DONE]"
