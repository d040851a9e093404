"""POST /v1/completions: one or more prompts (text or token ids), JSON or SSE in OpenAI's
text_completion format; `echo` prepends the prompt (and its logprobs, see
completion_choices.py), `suffix` is refused."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from vllm_actors.errors import ValidationError
from vllm_actors.frontend.completion_choices import ChoiceShaper
from vllm_actors.frontend.openai_schema import (APIError, CompletionRequest, completion_prompts,
                                                decode_request, max_tokens_for,
                                                prompt_logprobs_json, refuse_unsupported,
                                                sampling_params, structured_outputs_of)
from vllm_actors.frontend.serving import (ServerState, SubRequest, generate_final, new_request_id,
                                          now, raise_if_failed, stream_error, stream_outputs,
                                          usage)

logger = logging.getLogger("vllm_actors.server")
_json = msgspec.json.Encoder()


def _prepare(state: ServerState, req: CompletionRequest, request_id: str
             ) -> tuple[list[SubRequest], list[int], list[str]]:
    """Sub-requests, their prompt lengths and their prompt texts (for echo)."""
    state.check_model(req.model)
    refuse_unsupported(req)
    structured, constraint_field = structured_outputs_of(req)
    subs, lengths, texts = [], [], []
    tokenizer, max_len = state.engine.tokenizer, state.engine.ready.max_model_len
    for i, prompt in enumerate(completion_prompts(req.prompt)):
        try:
            text, ids = state.engine.input_processor.prompt_token_ids(
                prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt})
        except ValidationError as e:
            raise APIError(400, str(e), "prompt") from None
        limit = max_tokens_for(req.max_tokens if req.max_tokens is not None else 16, len(ids),
                               max_len)
        params = sampling_params(req, limit, state.engine.generation_defaults, req.stream,
                                 structured)
        sub = SubRequest(f"{request_id}-{i}", {"prompt": text, "prompt_token_ids": ids}, params)
        state.validate(sub, prompt_param="prompt", constraint_param=constraint_field)
        subs.append(sub)
        lengths.append(len(ids))
        texts.append(text if text is not None else tokenizer.decode(ids))
    return subs, lengths, texts


def _shaper(state: ServerState, req: CompletionRequest, texts: list[str]) -> ChoiceShaper:
    tokenizer = state.engine.tokenizer
    return ChoiceShaper(texts, req.echo, req.echo and req.max_tokens == 0, req.logprobs,
                        lambda token_id: tokenizer.decode([token_id]))


async def create_completion(state: ServerState, raw: Request) -> Response:
    req = decode_request(await raw.body(), CompletionRequest)
    state.admit()
    request_id = new_request_id("cmpl")
    subs, lengths, texts = _prepare(state, req, request_id)
    if not state.config.disable_log_requests:
        logger.info("completion request %s: %d prompt(s), %d prompt tokens, %s", request_id,
                    len(subs), sum(lengths), subs[0].params)
    if req.stream:
        return EventSourceResponse(_stream(state, req, request_id, subs, lengths, texts),
                                   ping=15, sep="\n")
    outputs = await generate_final(state, raw, subs)
    if outputs is None:
        return Response(status_code=499)
    shaper = _shaper(state, req, texts)
    choices, completion_tokens, cached = [], 0, 0
    for p, out in enumerate(outputs):
        raise_if_failed(out)
        cached += out.num_cached_tokens
        for c in out.outputs:
            piece = shaper.piece(p, p * req.n + c.index, out.prompt_token_ids,
                                 out.prompt_logprobs, c)
            completion_tokens += piece.num_generated
            choices.append({"index": p * req.n + c.index, "text": piece.text,
                            "logprobs": piece.logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)})
    return JSONResponse({"id": request_id, "object": "text_completion", "created": now(),
                         "model": state.model_name, "choices": choices,
                         "usage": usage(sum(lengths), completion_tokens, cached)})


async def _stream(state: ServerState, req: CompletionRequest, request_id: str,
                  subs: list[SubRequest], lengths: list[int], texts: list[str]
                  ) -> AsyncIterator[str]:
    created, opts = now(), req.stream_options
    include_usage = state.config.enable_force_include_usage or bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    completion_tokens, cached = 0, [0] * len(subs)
    shaper = _shaper(state, req, texts)

    def chunk(choice: dict[str, Any]) -> str:
        body: dict[str, Any] = {"id": request_id, "object": "text_completion",
                                "created": created, "model": state.model_name,
                                "choices": [choice]}
        if continuous:
            body["usage"] = usage(sum(lengths), completion_tokens, sum(cached))
        return _json.encode(body).decode()

    try:
        async for p, out in stream_outputs(state, subs):
            cached[p] = out.num_cached_tokens
            for c in out.outputs:
                index = p * req.n + c.index
                piece = shaper.piece(p, index, out.prompt_token_ids, out.prompt_logprobs, c)
                completion_tokens += piece.num_generated
                if not piece.text and c.finish_reason is None and \
                        not (piece.logprobs and piece.has_tokens):
                    continue
                yield chunk({"index": index, "text": piece.text, "logprobs": piece.logprobs,
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    except Exception as e:
        yield _json.encode(stream_error(e)).decode()
    if include_usage:
        yield _json.encode({"id": request_id, "object": "text_completion", "created": created,
                            "model": state.model_name, "choices": [],
                            "usage": usage(sum(lengths), completion_tokens,
                                           sum(cached))}).decode()
    yield "[DONE]"
