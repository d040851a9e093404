"""SamplingParams: how to sample one request, validated on construction with messages a user
can act on. A msgspec Struct so it crosses process boundaries as is.

Defaults follow vLLM: temperature 1.0, max_tokens 16.
"""

from __future__ import annotations

import enum

import msgspec

from vllm_actors.errors import ValidationError

_GREEDY_EPS = 1e-5
MAX_N = 128


class RequestOutputKind(enum.IntEnum):
    """What each streamed RequestOutput holds (vLLM's values)."""

    CUMULATIVE = 0   # everything generated so far
    DELTA = 1        # only what is new since the previous output
    FINAL_ONLY = 2   # nothing until the request finishes


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Per-request sampling settings.

    Attributes:
        n: completions per prompt; each is its own engine request (seed + i when seeded).
        temperature: 0 means greedy; otherwise logits are divided by it before sampling.
        seed: per-request seed; the same seed and prompt give the same tokens.
        max_tokens: most tokens to generate (None: up to the model's context length).
        min_tokens: tokens to generate before EOS / stop_token_ids may end the request.
        stop_token_ids: extra token ids that end generation (the token is kept in the output).
        ignore_eos: keep generating through EOS.
        skip_special_tokens: leave special tokens out of the decoded text.
        stop: strings that end generation; the text is cut before the first match.
        include_stop_str_in_output: keep the matched stop string in the text.
        spaces_between_special_tokens: when special tokens are kept in the text, separate
            them from neighbouring text with spaces (as Hugging Face's slow tokenizers do).
        output_kind: cumulative, delta or final-only outputs while streaming.
    """

    n: int = 1
    temperature: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValidationError naming the bad parameter."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not 1 <= self.n <= MAX_N:
            raise ValidationError(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValidationError("stop must be a list of non-empty strings", "stop")
        if not self.temperature >= 0:
            raise ValidationError(f"temperature must be >= 0, got {self.temperature}",
                                  "temperature")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValidationError(f"max_tokens must be at least 1, got {self.max_tokens}",
                                  "max_tokens")
        if self.min_tokens < 0:
            raise ValidationError(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValidationError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                                  f"({self.max_tokens})", "min_tokens")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValidationError("stop_token_ids must be non-negative token ids",
                                  "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
