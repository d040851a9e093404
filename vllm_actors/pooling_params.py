"""PoolingParams: what a pooling request (an embedding, a classification, a score) asks of
its pooled output, with vLLM's names. A msgspec Struct, so it travels inside requests as is.

This module imports nothing else from the package but `errors`.
"""

from __future__ import annotations

import msgspec

from vllm_actors.errors import ValidationError

# what a pooling request asks for: one vector (embed), class probabilities (classify), a
# cross-encoder's relevance of a text pair (score), or one vector per token (encode)
POOLING_TASKS = ("embed", "classify", "score", "encode")
TASK_ALIASES = {"token_embed": "encode"}     # vLLM 0.11's name for one vector per token


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Attributes:
        task: one of POOLING_TASKS (default: embed; "token_embed" is "encode").
        normalize: embed/encode: L2-normalize each vector (None: the model's pooler
            default, which is True for embedding models).
        dimensions: embed: keep the first `dimensions` values (Matryoshka models only),
            normalized after the cut.
        activation: classify/score: softmax over the labels (sigmoid for one label); None:
            the model's default (on).
        truncate_prompt_tokens: keep this many prompt tokens, cut on the right with the
            special tokens kept (-1: the model's length); None: refuse a longer prompt.
        token_type_start: a text pair for a cross-encoder: the first token of the second
            text, whose tokens get token type 1 (None: all type 0).

    Raises ValidationError for an unknown task or a non-positive dimension count."""

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        self.task = TASK_ALIASES.get(self.task, self.task)
        if self.task not in POOLING_TASKS:
            raise ValidationError(f"pooling task {self.task!r} is not one of "
                                  f"{', '.join(POOLING_TASKS)}", "task")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or
                                            not isinstance(self.dimensions, int) or
                                            self.dimensions < 1):
            raise ValidationError(f"dimensions must be a positive integer, got "
                                  f"{self.dimensions!r}", "dimensions")
        keep = self.truncate_prompt_tokens
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or
                                 (keep < 1 and keep != -1)):
            raise ValidationError(f"truncate_prompt_tokens must be a positive integer or -1, "
                                  f"got {keep!r}", "truncate_prompt_tokens")
