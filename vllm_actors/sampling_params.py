"""SamplingParams: how to sample one request, validated on construction with messages a user
can act on. A msgspec Struct so it crosses process boundaries as is.

Defaults follow vLLM: temperature 1.0, max_tokens 16.
"""

from __future__ import annotations

import msgspec

from vllm_actors.errors import ValidationError

_GREEDY_EPS = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Per-request sampling settings.

    Attributes:
        n: completions per prompt (only 1 for now).
        temperature: 0 means greedy; otherwise logits are divided by it before sampling.
        seed: per-request seed; the same seed and prompt give the same tokens.
        max_tokens: most tokens to generate (None: up to the model's context length).
        min_tokens: tokens to generate before EOS / stop_token_ids may end the request.
        stop_token_ids: extra token ids that end generation (the token is kept in the output).
        ignore_eos: keep generating through EOS.
        skip_special_tokens: leave special tokens out of the decoded text.
    """

    n: int = 1
    temperature: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValidationError naming the bad parameter."""
        if self.n != 1:
            raise ValidationError(f"n must be 1 (got {self.n}); several completions per prompt "
                                  "are not supported yet", "n")
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
