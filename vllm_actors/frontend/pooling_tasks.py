"""Pooling requests in bulk, shared by `LLM` and the server: many inputs at once, and the
scores of text pairs.

A score is a cross-encoder's relevance of the pair (its classifier over both texts in one
input, the first label's probability) when the model has a classifier, else the cosine
similarity of the two texts' embeddings (a bi-encoder), as vLLM scores.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Awaitable, Callable, Sequence

import msgspec
import numpy as np

from vllm_actors.errors import ValidationError
from vllm_actors.outputs import PoolingRequestOutput
from vllm_actors.pooling_params import PoolingParams


def pair_up(first: Any, second: Any) -> list[tuple[Any, Any]]:
    """vLLM's pairing: one first text against every second one (1:N), or the two lists
    zipped (N:N). Raises ValidationError for empty inputs or lists of different lengths."""
    firsts = [first] if isinstance(first, (str, dict)) else list(first)
    seconds = [second] if isinstance(second, (str, dict)) else list(second)
    if not firsts or not seconds:
        raise ValidationError("both sides of a score need at least one text", "text_1")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValidationError(f"got {len(firsts)} first texts for {len(seconds)} second "
                              "texts: give one, or as many", "text_2")
    return list(zip(firsts, seconds))


def process_all(engine: Any, prompts: Sequence[Any], params: PoolingParams, base: str,
                pairs: Sequence[str | None] | None = None) -> list[Any]:
    """Every prompt validated and tokenized (ProcessedRequests). Raises ValidationError."""
    pairs = pairs or [None] * len(prompts)
    return [engine.input_processor.process_pooling(f"{base}-{i}", p, params, pair=pair)
            for i, (p, pair) in enumerate(zip(prompts, pairs))]


async def encode_all(engine: Any, prompts: Sequence[Any], params: PoolingParams,
                     request_id: str | None = None, pairs: Sequence[str | None] | None = None,
                     prepare: Callable[..., Awaitable[Any]] | None = None
                     ) -> list[PoolingRequestOutput]:
    """Every prompt's output, in order (submitted together, so they batch); `pairs`: a
    second text per prompt for a cross-encoder; `prepare`: runs the tokenization off the
    event loop (the server's lanes). A failure aborts the others."""
    base = request_id or uuid.uuid4().hex
    args = (engine, prompts, params, base, pairs)
    processed = await prepare(process_all, *args) if prepare else process_all(*args)

    async def one(i: int) -> PoolingRequestOutput:
        async for out in engine.encode(processed[i], request_id=f"{base}-{i}"):
            return out
        raise AssertionError("encode yields one output")

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(processed))]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def score_pairs(engine: Any, pairs: list[tuple[Any, Any]], params: PoolingParams,
                      request_id: str | None = None,
                      prepare: Callable[..., Awaitable[Any]] | None = None
                      ) -> tuple[list[float], int]:
    """(the score of each pair, prompt tokens used)."""
    if "score" in engine.ready.pooling_tasks:
        for a, b in pairs:
            if not isinstance(a, str) or not isinstance(b, str):
                raise ValidationError("a cross-encoder scores text pairs", "text_1")
        outs = await encode_all(engine, [a for a, _ in pairs],
                                msgspec.structs.replace(params, task="score"), request_id,
                                [b for _, b in pairs], prepare)
        return [float(o.outputs.data[0]) for o in outs], \
            sum(o.num_prompt_tokens for o in outs)
    embed = msgspec.structs.replace(params, task="embed", normalize=True)
    texts = [x for pair in pairs for x in pair]
    outs = await encode_all(engine, texts, embed, request_id, prepare=prepare)
    vectors = [o.outputs.data for o in outs]
    scores = [float(np.dot(vectors[2 * i], vectors[2 * i + 1])) for i in range(len(pairs))]
    return scores, sum(o.num_prompt_tokens for o in outs)
