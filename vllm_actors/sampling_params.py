"""SamplingParams: how to sample one request, validated on construction with messages a user
can act on. A msgspec Struct so it crosses process boundaries as is.

Defaults follow vLLM: temperature 1.0, max_tokens 16, every other control neutral. Fields
are only ever appended (msgspec decodes shorter arrays by filling defaults).
"""

from __future__ import annotations

import copy

import enum
import itertools
import math
from typing import Any

import msgspec

from vllm_actors.errors import ValidationError

_GREEDY_EPS = 1e-5
MAX_N = 128
# Stop strings are matched on the frontend's event loop at every step of every completion:
# bounded per request and across its n completions, so one request cannot stall the others.
MAX_STOP_STRINGS = 1024
MAX_STOP_CHARS = 32768
MAX_STOP_STRINGS_ALL_N = 4096      # n x len(stop)
MAX_STOP_CHARS_ALL_N = 131072      # n x the characters of all stop strings
# Token-id lists and bad words are indexed once per request (shared by its n completions);
# the input processor bounds token lists by the vocabulary, these bound them before it.
MAX_TOKEN_LIST = 2**20
MAX_BAD_WORDS = 10_000
MAX_BAD_WORDS_CHARS = 131072
SEED_MODULUS = 2**64          # seeds are taken modulo 2^64 (a negative int64 seed wraps)
MIN_SEED = -(2**63)


class RequestOutputKind(enum.IntEnum):
    """What each streamed RequestOutput holds (vLLM's values)."""

    CUMULATIVE = 0   # everything generated so far
    DELTA = 1        # only what is new since the previous output
    FINAL_ONLY = 2   # nothing until the request finishes


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Constrain the output to a language (vLLM's names); exactly one field is set.

    Attributes:
        json: a JSON schema (a dict, or its JSON text) the output must validate against.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, as GBNF (llama.cpp) or Lark.
        json_object: any JSON object.
        disable_additional_properties: for `json`: None or True (the default) generate only
            the keys a schema declares unless it says `additionalProperties`, as vLLM's
            default backend does; False compiles the schema as JSON Schema reads it
            (undeclared keys allowed).
        disable_any_whitespace: for `json` and `json_object`: None or True (the default)
            generate compact JSON; False allows whitespace between tokens.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_additional_properties: bool | None = None
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = msgspec.json.decode(self.json)
            except msgspec.DecodeError as e:
                raise ValidationError(f"the JSON schema is not valid JSON: {e}",
                                      "structured_outputs") from None
            except RecursionError:
                raise ValidationError("the JSON schema nests too deeply to be read",
                                      "structured_outputs") from None
            if not isinstance(self.json, dict):
                raise ValidationError("a JSON schema must be a JSON object",
                                      "structured_outputs")
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValidationError(
                "structured outputs need exactly one of json, regex, choice, grammar or "
                f"json_object; got {', '.join(kinds) if kinds else 'none'}",
                "structured_outputs")
        if self.choice is not None and not (self.choice and all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValidationError("choice must be a non-empty list of non-empty strings",
                                  "structured_outputs")

    def kinds(self) -> list[str]:
        """The names of the fields that are set."""
        return [name for name in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, name) not in (None, False)]


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Per-request sampling settings, applied in vLLM's order (see workers/sampler.py).

    Attributes:
        n: completions per prompt; each is its own engine request (seed + i when seeded).
        temperature: 0 means greedy; otherwise logits are divided by it before sampling.
        seed: per-request seed; the same seed and prompt give the same tokens, whatever
            else runs in the batch.
        max_tokens: most tokens to generate (None: up to the model's context length).
        min_tokens: tokens to generate before EOS / stop_token_ids may end the request (they
            are masked until then).
        stop_token_ids: extra token ids that end generation (the token is kept in the output).
        ignore_eos: keep generating through EOS.
        skip_special_tokens: leave special tokens out of the decoded text.
        stop: strings that end generation; the text is cut before the first match.
        include_stop_str_in_output: keep the matched stop string in the text.
        spaces_between_special_tokens: vLLM's flag; it changes nothing here, as with the
            fast tokenizers vLLM decodes GGUF and tokenizer.json models with (only slow
            tokenizers put spaces around added tokens).
        output_kind: cumulative, delta or final-only outputs while streaming.
        detokenize: False leaves the outputs' text empty (token ids only); stop strings
            then cannot be matched and are refused.
        extra_args: vLLM's free-form arguments for custom sampling code; kept, unread.
        top_k: keep the k most likely tokens (0 or -1: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p.
        min_p: drop tokens less likely than min_p times the most likely one.
        presence_penalty / frequency_penalty: OpenAI's penalties over the generated tokens.
        repetition_penalty: divide positive (multiply negative) logits of tokens seen in the
            prompt or output; 1 = off.
        logit_bias: token id -> value added to its logit (-100..100).
        allowed_token_ids: only these tokens may be sampled.
        bad_words: words that must not be generated (as token sequences, any position).
        best_of: candidates to pick n from; only best_of == n is supported.
        logprobs: also return the log-probability of each sampled token and of the top
            `logprobs` alternatives (raw model distribution, with ranks).
        prompt_logprobs: the same for every prompt token after the first.
        bad_words_token_ids: `bad_words` tokenized by the frontend (filled there).
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar
            (enforced by a token mask in the sampler, see enginecore/structured_output.py).
        truncate_prompt_tokens: keep only the prompt's last k tokens (vLLM's left
            truncation); -1 keeps the last max_model_len. Applied by the input processor.
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
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad_words_token_ids: list[list[int]] = []
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids", "bad_words"):   # None: vLLM's "none"
            if getattr(self, name) is None:
                setattr(self, name, [])
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.structured_outputs, dict):   # as the JSON body would give it
            try:
                self.structured_outputs = msgspec.convert(self.structured_outputs,
                                                          StructuredOutputsParams)
            except msgspec.ValidationError as e:
                raise ValidationError(f"structured_outputs: {e}", "structured_outputs") from None
        if self.logit_bias and isinstance(self.logit_bias, dict):
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValidationError("logit_bias must map token ids to numbers",
                                      "logit_bias") from None
        self.validate()
        if self.seed is not None:
            self.seed %= SEED_MODULUS

    def validate(self) -> None:
        """Raises ValidationError naming the bad parameter (a wrong type included)."""
        self._check_types()
        checks = [
            (self.seed is None or MIN_SEED <= self.seed < SEED_MODULUS, "seed",
             f"seed must be an integer in [-2^63, 2^64), got {self.seed}"),
            (1 <= self.n <= MAX_N, "n", f"n must be between 1 and {MAX_N}, got {self.n}"),
            (self.best_of in (None, self.n), "best_of",
             f"best_of={self.best_of} with n={self.n} is not supported; use n"),
            (all(isinstance(s, str) and s for s in self.stop), "stop",
             "stop must be a list of non-empty strings"),
            (self.detokenize or not self.stop, "detokenize",
             "stop strings need detokenize=True (the text they are matched in)"),
            (all(isinstance(s, str) and s for s in self.bad_words), "bad_words",
             "bad_words must be a list of non-empty strings"),
            (self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1 or
             self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
             f"truncate_prompt_tokens must be >= 1 or -1 (the model's context length), got "
             f"{self.truncate_prompt_tokens}"),
            (self.temperature >= 0 and math.isfinite(self.temperature), "temperature",
             f"temperature must be a finite number >= 0, got {self.temperature}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative token ids"),
            (self.top_k >= -1, "top_k", f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0 < self.repetition_penalty <= 2, "repetition_penalty",
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (all(-100 <= v <= 100 for v in (self.logit_bias or {}).values()), "logit_bias",
             "logit_bias values must be in [-100, 100]"),
            (all(t >= 0 for t in (self.logit_bias or {})), "logit_bias",
             "logit_bias keys must be non-negative token ids"),
            (self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and
                                                min(self.allowed_token_ids) >= 0),
             "allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs",
             f"logprobs must be >= 0, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise ValidationError(message, param)
        self._check_sizes()
        self._check_wire()

    def _check_sizes(self) -> None:
        """The bounds on stop strings (per request and across n), bad words and token-id
        lists (module constants): each costs work per step or per request."""
        num_stop, stop_chars = len(self.stop), sum(map(len, self.stop))
        if num_stop > MAX_STOP_STRINGS or stop_chars > MAX_STOP_CHARS:
            raise ValidationError(f"stop may hold at most {MAX_STOP_STRINGS} strings of "
                                  f"{MAX_STOP_CHARS} characters in all, got {num_stop} of "
                                  f"{stop_chars}", "stop")
        if self.n * num_stop > MAX_STOP_STRINGS_ALL_N or \
                self.n * stop_chars > MAX_STOP_CHARS_ALL_N:
            raise ValidationError(f"n x stop may hold at most {MAX_STOP_STRINGS_ALL_N} strings "
                                  f"of {MAX_STOP_CHARS_ALL_N} characters in all (every "
                                  f"completion matches them), got n={self.n} x {num_stop} of "
                                  f"{stop_chars}", "stop")
        num_bad, bad_chars = len(self.bad_words), sum(map(len, self.bad_words))
        if num_bad > MAX_BAD_WORDS or bad_chars > MAX_BAD_WORDS_CHARS:
            raise ValidationError(f"bad_words may hold at most {MAX_BAD_WORDS} words of "
                                  f"{MAX_BAD_WORDS_CHARS} characters in all, got {num_bad} "
                                  f"of {bad_chars}", "bad_words")
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            size = len(getattr(self, name) or ())
            if size > MAX_TOKEN_LIST:
                raise ValidationError(f"{name} may hold at most {MAX_TOKEN_LIST} token ids, "
                                      f"got {size}", name)

    def _check_types(self) -> None:
        """Every field of its declared type."""
        for info in _FIELDS:
            value = getattr(self, info.name)
            try:
                msgspec.convert(value, info.type)
            except msgspec.ValidationError as e:
                raise ValidationError(f"{info.name}: {e} (got {short_repr(value)})",
                                      info.name) from None

    def _check_wire(self) -> None:
        """Every integer within 64 bits: the wire (msgpack) carries [-2^63, 2^64)."""
        for info in _FIELDS:
            try:
                _ENCODER.encode(getattr(self, info.name))
            except OverflowError:
                raise ValidationError(f"{info.name} holds an integer beyond 64 bits",
                                      info.name) from None

    def child_seed(self, index: int) -> int | None:
        """The seed of completion `index` of n: seed + index (mod 2^64), None when unseeded.
        The n completions share these params otherwise (one copy, see EngineCoreRequest.n)."""
        return None if self.seed is None else (self.seed + index) % SEED_MODULUS

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's method), safe to change without touching this one."""
        return copy.deepcopy(self)

    def brief(self, limit: int = 400) -> str:
        """The fields set away from their defaults, for a log line of at most about `limit`
        characters: lists and dicts longer than a few items as their size."""
        parts = []
        for info in _FIELDS:
            value = getattr(self, info.name)
            if value == info.default or (info.default is msgspec.NODEFAULT and not value):
                continue
            if isinstance(value, (list, dict)) and len(value) > 8:
                parts.append(f"{info.name}=<{len(value)} items>")
            else:
                parts.append(f"{info.name}={short_repr(value, 80)}")
        text = ", ".join(parts)
        return text if len(text) <= limit else text[:limit] + "..."

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def short_repr(value: Any, limit: int = 200) -> str:
    """`repr(value)` cut to `limit` characters: error messages and logs never carry a
    request's whole lists."""
    head = value
    if isinstance(value, list):
        head = value[:limit]
    elif isinstance(value, dict):
        head = dict(itertools.islice(value.items(), limit))
    text = repr(head)
    if len(text) <= limit:
        return text
    more = f" ({len(value)} items)" if isinstance(value, (list, dict)) else ""
    return f"{text[:limit]}...{more}"


_FIELDS = msgspec.structs.fields(SamplingParams)
_ENCODER = msgspec.msgpack.Encoder()
