"""The speculative-decoding part of the configuration: vLLM's `--speculative-config` JSON
(also `LLM(speculative_config={...})`), checked once into a frozen `SpeculativeConfig`.

Methods: "ngram" (prompt lookup over the request's own tokens), "suffix" (suffix decoding
over the request's tokens and recent outputs of other requests) and "draft_model" (a small
model with the target's tokenizer). Model-head methods (EAGLE, Medusa, MTP) are refused:
no such checkpoint is supported yet.

Like `config`, this module imports nothing else from the package but `errors`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from vllm_actors.errors import ValidationError

METHODS = ("ngram", "suffix", "draft_model")
HEAD_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp")
# vLLM fields we accept at their default only (anything else is refused, not ignored)
IGNORED_AT_DEFAULT = {"draft_tensor_parallel_size": (None, 1), "quantization": (None,),
                      "revision": (None,), "code_revision": (None,), "enforce_eager": (None,
                                                                                      True)}
MAX_SPECULATIVE_TOKENS = 64
# one more verified position on the compiled CPU backend, SmolLM2-135M (bench/spec_decode.py)
DEFAULT_DRAFT_COST = 0.3
# ours (vLLM: never; give null for that): batch 32 lost 8-32 % with drafts on this CPU
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: one of METHODS. num_speculative_tokens: most drafts per request per step.
    ngram: the longest n in [prompt_lookup_min, prompt_lookup_max] whose last n tokens occur
    earlier in the request proposes what followed that occurrence.
    suffix_decoding_*: vLLM's suffix-decoding knobs (tree depth, cached requests, draft
    length as a factor of the match length, least cumulative probability of a draft token);
    cached requests default to 1000, not vLLM's 10000: our trie keeps about 3 KB per cached
    output token (10000 requests of 300 unique tokens would take about 10 GB).
    model: the draft model (draft_model), a .gguf file or HF directory.
    disable_by_batch_size: no drafts in a step with more running requests than this (default
    8, ours; null: no limit, as vLLM's default).
    draft_cost: what verifying one more draft position costs, as a fraction of a decode
    step; a request verifies the drafts it expects to be accepted with a higher probability
    (`enginecore/spec_decode.py`); 0 verifies every draft (vLLM's behaviour)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    draft_cost: float = DEFAULT_DRAFT_COST
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"


def speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """Parse and check `--speculative-config` (JSON text or a dict). Raises ValidationError
    naming the bad field."""
    if value is None or value == {} or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _error(f"is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise _error(f"must be a JSON object, got {type(value).__name__}")
    fields = dict(value)
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    for name, allowed in IGNORED_AT_DEFAULT.items():
        if name in fields and fields.pop(name) not in allowed:
            raise _error(f"field {name!r} is not supported (only its default)")
    unknown = sorted(set(fields) - known)
    if unknown:
        raise _error(f"unknown field(s) {', '.join(map(repr, unknown))}; known: "
                     f"{', '.join(sorted(known))}")
    method = _method(fields)
    fields["method"] = method
    if method == "ngram":
        _ngram_defaults(fields)
    if method == "suffix":
        fields.setdefault("num_speculative_tokens",
                          fields.get("suffix_decoding_max_tree_depth", 24))
    if method == "draft_model" and not isinstance(fields.get("model"), str):
        raise _error('method "draft_model" needs "model": the draft model\'s .gguf file or '
                     "directory")
    if "num_speculative_tokens" not in fields:
        raise _error(f'method "{method}" needs "num_speculative_tokens"')
    _check_values(fields)
    return SpeculativeConfig(**fields)


def _method(fields: dict[str, Any]) -> str:
    method = fields.get("method")
    if method is None:
        if fields.get("model") in ("ngram", "[ngram]"):
            fields.pop("model")
            return "ngram"
        if fields.get("model") is not None:
            return "draft_model"
        raise _error('needs "method" (one of ' + ", ".join(METHODS) + ")")
    if method == "[ngram]":
        return "ngram"
    if method in HEAD_METHODS:
        raise _error(f'method "{method}" is not implemented: it needs a draft head '
                     f"checkpoint; available: {', '.join(METHODS)}")
    if method not in METHODS:
        raise _error(f"method {method!r} is not one of {', '.join(METHODS)}")
    return method


def _ngram_defaults(fields: dict[str, Any]) -> None:
    """vLLM's rule: both unset -> 5 and 5; one set -> the other equals it."""
    low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = 5
    fields["prompt_lookup_min"] = high if low is None else low
    fields["prompt_lookup_max"] = low if high is None else high


def _check_values(fields: dict[str, Any]) -> None:
    def integer(name: str, low: int, high: int | None = None) -> None:
        v = fields.get(name)
        if v is None:
            return
        if not isinstance(v, int) or isinstance(v, bool) or v < low or \
                (high is not None and v > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            raise _error(f"{name} must be an integer {bound}, got {v!r}")

    def fraction(name: str, low: float, high: float) -> None:
        v = fields.get(name)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                              or not low <= v <= high):
            raise _error(f"{name} must be a number in [{low}, {high}], got {v!r}")

    integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    integer("prompt_lookup_min", 1)
    integer("prompt_lookup_max", 1)
    integer("disable_by_batch_size", 1)
    integer("suffix_decoding_max_tree_depth", 1, 256)
    integer("suffix_decoding_max_cached_requests", 0)
    fraction("suffix_decoding_max_spec_factor", 0.0, 1e6)
    fraction("suffix_decoding_min_token_prob", 0.0, 1.0)
    fraction("draft_cost", 0.0, 1.0)
    if fields.get("prompt_lookup_min", 0) > fields.get("prompt_lookup_max", 1 << 30):
        raise _error("prompt_lookup_min must not exceed prompt_lookup_max")


def _error(message: str) -> ValidationError:
    return ValidationError(f"--speculative-config {message}", "speculative_config")
