"""Public result types, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        finish_reason: "stop", "length", "abort" or "error"; None while running.
        stop_reason: the stop token id that ended it, if one did.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions so far (cumulative, not deltas).

    Attributes:
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        error: why the engine failed this request (its finish_reason is then "error").
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
