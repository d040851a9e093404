"""POST /v1/completions: one or more prompts (text or token ids), JSON or SSE in OpenAI's
text_completion format; `echo` prepends the prompt (and its logprobs, see
completion_choices.py), `suffix` is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from vllm_actors.errors import ValidationError
from vllm_actors.frontend.completion_choices import ChoiceShaper
from vllm_actors.frontend.openai_schema import (APIError, CompletionRequest, completion_prompts,
                                                max_tokens_for,
                                                prompt_logprobs_json, refuse_unsupported,
                                                sampling_params, structured_outputs_of)
from vllm_actors.frontend.request_body import decode_request, read_body
from vllm_actors.frontend.serving import (EventStream, ServerState, SubRequest, generate_final,
                                          json_built_off_loop, new_request_id, now,
                                          open_stream, raise_if_failed, stream_error, usage)
from vllm_actors.outputs import RequestOutput

_json = msgspec.json.Encoder()


@dataclass
class PreparedCompletion:
    req: CompletionRequest
    request_id: str
    subs: list[SubRequest]
    texts: list[str]             # each prompt's text (for echo)
    constraint_param: str | None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.num_prompt_tokens for s in self.subs)


# completions one request may ask for, prompts x n (the embeddings endpoint's 2,048 inputs)
MAX_SEQUENCES = 2048


def prepare_completion(state: ServerState, req: CompletionRequest, request_id: str
                       ) -> PreparedCompletion:
    """Checks, tokenized prompts and validated SamplingParams (in the preparation pool)."""
    lora = state.check_model(req.model)
    refuse_unsupported(req)
    structured, constraint_field = structured_outputs_of(req)
    subs, texts = [], []
    tokenizer, max_len = state.engine.tokenizer, state.engine.ready.max_model_len
    add_special = req.add_special_tokens is not False
    prompts = completion_prompts(req.prompt)
    if len(prompts) * req.n > MAX_SEQUENCES:
        raise APIError(400, f"a request may ask for at most {MAX_SEQUENCES} completions "
                            f"(prompts x n), got {len(prompts)} x {req.n}", "prompt")
    for i, prompt in enumerate(prompts):
        try:
            text, ids = state.engine.input_processor.prompt_token_ids(
                prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt},
                add_special, req.truncate_prompt_tokens)
        except ValidationError as e:
            raise APIError(400, str(e), e.param if e.param == "truncate_prompt_tokens"
                           else "prompt") from None
        limit = max_tokens_for(req.max_tokens if req.max_tokens is not None else 16, len(ids),
                               max_len, "prompt")
        params = sampling_params(req, limit, state.engine.generation_defaults, req.stream,
                                 structured)
        whole = req.truncate_prompt_tokens is None and text is not None
        sub = SubRequest(f"{request_id}-{i}", {"prompt": text, "prompt_token_ids": ids,
                                               "cache_salt": req.cache_salt}, params,
                         req.priority, lora=lora)
        state.process(sub, "prompt", constraint_field)
        subs.append(sub)
        texts.append(text if whole else tokenizer.decode(ids))
    return PreparedCompletion(req, request_id, subs, texts, constraint_field)


def _decode_and_prepare(state: ServerState, body: bytes, raw: Request) -> PreparedCompletion:
    req = decode_request(body, CompletionRequest)
    return prepare_completion(state, req, new_request_id("cmpl", req.request_id, raw))


def _shaper(state: ServerState, prepared: PreparedCompletion) -> ChoiceShaper:
    tokenizer, req = state.engine.tokenizer, prepared.req
    return ChoiceShaper(prepared.texts, req.echo, req.echo and req.max_tokens == 0,
                        req.logprobs, lambda token_id: tokenizer.decode([token_id]),
                        req.return_tokens_as_token_ids)


async def create_completion(state: ServerState, raw: Request) -> Response:
    body = await read_body(raw, state.config.max_request_body_size)
    state.admit()
    prepared = await state.prepare(_decode_and_prepare, state, body, raw, body=body)
    req, subs = prepared.req, prepared.subs
    state.log_request("completion", prepared.request_id, prepared.num_prompt_tokens,
                      subs[0].params, len(subs))
    if req.stream:
        outputs = await open_stream(state, subs, prepared.constraint_param)
        return EventStream(_stream(state, prepared, outputs), outputs)
    results = await generate_final(state, raw, subs)
    if results is None:
        return Response(status_code=499)
    return await json_built_off_loop(state, _completion_body, state, prepared, results)


def _completion_body(state: ServerState, prepared: PreparedCompletion,
                     results: list[RequestOutput]) -> dict[str, Any]:
    """The text_completion body for finished sub-requests (in the preparation pool)."""
    req = prepared.req
    shaper = _shaper(state, prepared)
    choices, completion_tokens, cached = [], 0, 0
    for p, out in enumerate(results):
        raise_if_failed(out, prepared.constraint_param)
        cached += out.num_cached_tokens
        for c in out.outputs:
            piece = shaper.piece(p, p * req.n + c.index, out.prompt_token_ids,
                                 out.prompt_logprobs, c)
            completion_tokens += piece.num_generated
            choice = {"index": p * req.n + c.index, "text": piece.text,
                      "logprobs": piece.logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                      "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
            if req.return_token_ids:
                choice.update(prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
            choices.append(choice)
    return {"id": prepared.request_id, "object": "text_completion", "created": now(),
            "model": state.served_name(req.model), "choices": choices,
            "usage": usage(prepared.num_prompt_tokens, completion_tokens, cached)}


async def _stream(state: ServerState, prepared: PreparedCompletion,
                  outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    req, request_id, subs = prepared.req, prepared.request_id, prepared.subs
    num_prompt = prepared.num_prompt_tokens
    created, opts = now(), req.stream_options
    include_usage = state.config.enable_force_include_usage or bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    generated, cached = [0] * (len(subs) * req.n), [0] * len(subs)   # per choice, prompt
    shaper = _shaper(state, prepared)
    ids_sent: set[int] = set()

    def chunk(choice: dict[str, Any]) -> str:
        """A choice's chunk; continuous usage counts its prompt and its tokens, as vLLM's."""
        body: dict[str, Any] = {"id": request_id, "object": "text_completion",
                                "created": created, "model": state.served_name(req.model),
                                "choices": [choice]}
        if continuous:
            p = choice["index"] // req.n
            body["usage"] = usage(subs[p].num_prompt_tokens, generated[choice["index"]],
                                  cached[p])
        return _json.encode(body).decode()

    try:
        async for p, out in outputs:
            cached[p] = out.num_cached_tokens
            for c in out.outputs:
                index = p * req.n + c.index
                piece = shaper.piece(p, index, out.prompt_token_ids, out.prompt_logprobs, c)
                generated[index] += piece.num_generated
                if not piece.text and c.finish_reason is None and not (
                        (piece.logprobs or req.return_token_ids) and piece.has_tokens):
                    continue
                choice = {"index": index, "text": piece.text, "logprobs": piece.logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.return_token_ids:   # the prompt's ids in the choice's first chunk
                    choice["token_ids"] = c.token_ids
                    if index not in ids_sent:
                        ids_sent.add(index)
                        choice["prompt_token_ids"] = out.prompt_token_ids
                yield chunk(choice)
    except Exception as e:
        yield _json.encode(stream_error(e)).decode()
    if include_usage:
        yield _json.encode({"id": request_id, "object": "text_completion", "created": created,
                            "model": state.served_name(req.model), "choices": [],
                            "usage": usage(num_prompt, sum(generated), sum(cached))}).decode()
    yield "[DONE]"
