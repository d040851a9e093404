"""The pooling endpoints, in OpenAI's and vLLM's shapes:

- POST /v1/embeddings: `input` a string, a list of strings, token ids or lists of them;
  `encoding_format` float or base64 (little-endian float32, as OpenAI sends it);
  `dimensions` for Matryoshka models; `usage`.
- POST /pooling: the raw pooled output (vLLM's), per input.
- POST /classify: label probabilities per input.
- POST /score (and /v1/score): `text_1` against `text_2` (1:N or N:N; also named queries /
  documents or items, data_1 / data_2, as newer vLLM takes them).
- POST /rerank, /v1/rerank, /v2/rerank: `query` against `documents` (strings or
  {"text": ...}), sorted by relevance, `top_n`, as Jina's and Cohere's APIs answer.

Each request's inputs are submitted together and batch in the engine; a client that goes
away aborts them.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from vllm_actors.errors import EngineDeadError, ValidationError, VllmActorsError
from vllm_actors.frontend.openai_schema import APIError
from vllm_actors.frontend.pooling_tasks import encode_all, pair_up, score_pairs
from vllm_actors.frontend.request_body import decode_request, read_body
from vllm_actors.frontend.serving import (JSONBody, ServerState, new_request_id, now,
                                          wait_for_disconnect)
from vllm_actors.pooling_params import PoolingParams

Input = Any   # str | list[str] | list[int] | list[list[int]], checked by `_inputs`
MAX_INPUTS = 2048      # OpenAI's limit on inputs per embeddings request


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: Input
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    request_id: str | None = None
    priority: int = 0
    add_special_tokens: bool = True


class PoolingRequest(msgspec.Struct, kw_only=True):
    input: Input
    model: str | None = None
    encoding_format: str = "float"
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    request_id: str | None = None


class ClassifyRequest(msgspec.Struct, kw_only=True):
    input: Input
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None
    request_id: str | None = None


class ScoreRequest(msgspec.Struct, kw_only=True):
    """The two sides by any of vLLM's names: text_1 / text_2, queries / documents (or
    items), data_1 / data_2."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None

    def sides(self) -> tuple[str | list[str], str | list[str]]:
        """(first, second). Raises APIError 400 unless exactly one name gives each side."""
        firsts = [v for v in (self.text_1, self.queries, self.data_1) if v is not None]
        seconds = [v for v in (self.text_2, self.documents, self.items, self.data_2)
                   if v is not None]
        if len(firsts) != 1 or len(seconds) != 1:
            raise APIError(400, "give the two sides of a score once each: text_1 and text_2, "
                                "queries and documents (or items), or data_1 and data_2",
                           "text_1")
        return firsts[0], seconds[0]


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: list[str | dict[str, Any]]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value)


def _inputs(value: Input) -> list[str | dict[str, Any]]:
    """OpenAI's `input` forms as prompts. Raises APIError 400 for an empty input or one of
    another shape."""
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif _is_ids(value):
        prompts = [{"prompt_token_ids": list(value)}]
    elif isinstance(value, list) and (all(isinstance(x, str) for x in value)
                                      or all(_is_ids(x) for x in value)):
        prompts = [x if isinstance(x, str) else {"prompt_token_ids": x} for x in value]
    else:
        raise APIError(400, "input must be a string, a list of strings, a list of token ids "
                            "or a list of such lists", "input")
    if not prompts:
        raise APIError(400, "input must not be empty", "input")
    if len(prompts) > MAX_INPUTS:
        raise APIError(400, f"input may hold at most {MAX_INPUTS} items, got {len(prompts)}",
                       "input")
    return prompts


def _params(**fields: Any) -> PoolingParams:
    try:
        return PoolingParams(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise APIError(400, str(e), e.param) from None


def _check_format(encoding_format: str) -> None:
    if encoding_format not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be float or base64, got "
                            f"{encoding_format!r}", "encoding_format")


def _encoded(data: np.ndarray, encoding_format: str) -> Any:
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(data, "<f4").tobytes()).decode("ascii")
    return data.tolist()


async def _run(state: ServerState, raw: Request, work: Any) -> Any:
    """Await `work`; None when the client went away first (its requests are aborted)."""
    state.admit()
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
        try:
            return task.result()
        except ValidationError as e:
            raise APIError(400, str(e), e.param) from None
        except EngineDeadError:
            raise
        except VllmActorsError as e:   # the engine failed the request (not its fault)
            raise APIError(500, f"the engine failed this request: {e}", code="engine_error",
                           type_="server_error") from None
    finally:
        gone.cancel()
        task.cancel()


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


async def _body(state: ServerState, raw: Request, cls: type) -> Any:
    req = decode_request(await read_body(raw, state.config.max_request_body_size), cls)
    if state.check_model(req.model, "pooling") is not None:
        raise APIError(400, "LoRA adapters do not apply to pooling requests", "model")
    return req


async def create_embedding(state: ServerState, raw: Request) -> Response:
    req = await _body(state, raw, EmbeddingRequest)
    _check_format(req.encoding_format)
    params = _params(task="embed", dimensions=req.dimensions, normalize=req.normalize,
                     truncate_prompt_tokens=req.truncate_prompt_tokens)
    request_id = new_request_id("embd", req.request_id, raw)
    prompts = [p if isinstance(p, dict) or req.add_special_tokens else
               {"prompt": p, "add_special_tokens": False} for p in _inputs(req.input)]
    outs = await _run(state, raw, encode_all(state.engine, prompts, params, request_id,
                                             prepare=state.prepare))
    if outs is None:
        return Response(status_code=499)
    tokens = sum(o.num_prompt_tokens for o in outs)
    return JSONBody({"id": request_id, "object": "list", "created": now(),
                     "model": state.served_name(req.model),
                     "data": [{"index": i, "object": "embedding",
                               "embedding": _encoded(o.outputs.data, req.encoding_format)}
                              for i, o in enumerate(outs)],
                     "usage": _usage(tokens)})


async def create_pooling(state: ServerState, raw: Request) -> Response:
    req = await _body(state, raw, PoolingRequest)
    _check_format(req.encoding_format)
    params = _params(task=req.task or "encode",
                     truncate_prompt_tokens=req.truncate_prompt_tokens)
    request_id = new_request_id("pool", req.request_id, raw)
    outs = await _run(state, raw, encode_all(state.engine, _inputs(req.input), params,
                                             request_id, prepare=state.prepare))
    if outs is None:
        return Response(status_code=499)
    return JSONBody({"id": request_id, "object": "list", "created": now(),
                     "model": state.served_name(req.model),
                     "data": [{"index": i, "object": "pooling",
                               "data": _encoded(o.outputs.data, req.encoding_format)}
                              for i, o in enumerate(outs)],
                     "usage": _usage(sum(o.num_prompt_tokens for o in outs))})


async def create_classify(state: ServerState, raw: Request) -> Response:
    req = await _body(state, raw, ClassifyRequest)
    params = _params(task="classify", activation=req.activation,
                     truncate_prompt_tokens=req.truncate_prompt_tokens)
    request_id = new_request_id("classify", req.request_id, raw)
    outs = await _run(state, raw, encode_all(state.engine, _inputs(req.input), params,
                                             request_id, prepare=state.prepare))
    if outs is None:
        return Response(status_code=499)
    labels = state.engine.ready.labels
    data = []
    for i, o in enumerate(outs):
        probs = o.outputs.data.tolist()
        data.append({"index": i, "label": labels[int(np.argmax(o.outputs.data))],
                     "probs": probs, "num_classes": len(probs)})
    return JSONBody({"id": request_id, "object": "list", "created": now(),
                     "model": state.served_name(req.model), "data": data,
                     "usage": _usage(sum(o.num_prompt_tokens for o in outs))})


async def create_score(state: ServerState, raw: Request) -> Response:
    req = await _body(state, raw, ScoreRequest)
    params = _params(task="score", truncate_prompt_tokens=req.truncate_prompt_tokens)
    try:
        pairs = pair_up(*req.sides())
    except ValidationError as e:
        raise APIError(400, str(e), e.param) from None
    request_id = new_request_id("score", req.request_id, raw)
    found = await _run(state, raw, score_pairs(state.engine, pairs, params, request_id,
                                                    state.prepare))
    if found is None:
        return Response(status_code=499)
    scores, tokens = found
    return JSONBody({"id": request_id, "object": "list", "created": now(),
                     "model": state.served_name(req.model),
                     "data": [{"index": i, "object": "score", "score": s}
                              for i, s in enumerate(scores)],
                     "usage": _usage(tokens)})


def _document_text(doc: str | dict[str, Any]) -> str:
    text = doc if isinstance(doc, str) else doc.get("text")
    if not isinstance(text, str):
        raise APIError(400, "each document must be a string or {\"text\": string}",
                       "documents")
    return text


async def create_rerank(state: ServerState, raw: Request) -> Response:
    req = await _body(state, raw, RerankRequest)
    if not req.documents:
        raise APIError(400, "documents must not be empty", "documents")
    if req.top_n is not None and req.top_n < 0:
        raise APIError(400, f"top_n must not be negative, got {req.top_n}", "top_n")
    texts = [_document_text(d) for d in req.documents]
    params = _params(task="score", truncate_prompt_tokens=req.truncate_prompt_tokens)
    request_id = new_request_id("rerank", req.request_id, raw)
    found = await _run(state, raw, score_pairs(state.engine, [(req.query, t) for t in texts],
                                               params, request_id, state.prepare))
    if found is None:
        return Response(status_code=499)
    scores, tokens = found
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[:req.top_n]
    results = []
    for i in order:
        entry: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            entry["document"] = {"text": texts[i]}
        results.append(entry)
    return JSONBody({"id": request_id, "model": state.served_name(req.model),
                     "usage": {"total_tokens": tokens}, "results": results})
