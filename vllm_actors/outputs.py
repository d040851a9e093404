"""Public result types, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class Logprob:
    """One token's log-probability under the raw model distribution, its 1-based rank, and
    its text (the token decoded on its own)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per position: token id -> Logprob (the position's token plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        finish_reason: "stop", "length", "abort" or "error"; None while running.
        stop_reason: the stop token id that ended it, if one did.
        logprobs: one dict per token id, when SamplingParams.logprobs is set.
        cumulative_logprob: sum of the sampled tokens' logprobs (with logprobs only).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions so far (cumulative, not deltas).

    Attributes:
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        error: why the engine failed this request (its finish_reason is then "error").
        error_param: the request field at fault when the request itself caused the failure
            (an invalid value, a grammar the engine cannot follow); None for engine faults.
        prompt_logprobs: None for the first prompt token, then one dict per prompt token,
            when SamplingParams.prompt_logprobs is set.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error_param: str | None = None
    pooled: Any = None    # a pooling request's `protocol.engine.PooledOutput`


# -- pooling (vLLM's `PoolingRequestOutput` and its task views) ----------------------------
@dataclass
class PoolingOutput:
    """A pooling request's raw output: float32 [D] (an embedding, label scores) or [n, D]
    (one vector per token)."""

    data: np.ndarray


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """One pooling request's result: `outputs` is a PoolingOutput (`encode`), an
    EmbeddingOutput (`embed`), a ClassificationOutput (`classify`) or a ScoringOutput
    (`score`)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


EmbeddingRequestOutput = ClassificationRequestOutput = ScoringRequestOutput = \
    PoolingRequestOutput
