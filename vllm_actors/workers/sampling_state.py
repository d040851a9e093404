"""Per-row sampling parameters of the persistent batch, as arrays the sampler indexes.

Common controls are dense arrays (one value per row). The list-valued ones (logit bias,
allowed ids, bad words, min_tokens stop ids) are indexed once per request into a
`RequestMasks`, shared by every row whose params are the same object (the n completions of a
request), and kept by row in a small dict, so a step only touches the rows that use them and
costs them no more than a lookup per distinct bad-word length, whatever the lists' sizes.
"""

from __future__ import annotations

import numpy as np

from vllm_actors.sampling_params import SamplingParams

MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = float(np.finfo(np.float32).max)
MAX_TOP_K = 2**31
MIN_REPETITION_PENALTY = float(np.finfo(np.float32).tiny)


class RequestMasks:
    """A request's list-valued controls, precomputed for the sampler's per-step masks.

    Attributes:
        params: the SamplingParams they were built from (rows share them by identity).
        allowed: unique allowed ids, or None (every token allowed).
        single_banned: unique one-token bad words, banned at every step.
        bad_prefixes: the longer bad words as (k, {the k tokens before: banned last ids}),
            one entry per distinct prefix length k, k ascending. A word of L tokens bans its
            last token when the last L - 1 output tokens equal its prefix (vLLM's rule).
        max_prefix: the largest k (0: none).
        min_tokens_stop_ids: unique stop ids (stop_token_ids and EOS unless ignored) masked
            until min_tokens, or None.
        bias_ids / bias_values: logit_bias as arrays (ids unique), or None.
    """

    def __init__(self, p: SamplingParams, eos_token_ids: list[int]) -> None:
        self.params = p
        self.allowed = None if p.allowed_token_ids is None else \
            np.unique(np.asarray(p.allowed_token_ids, np.int64))
        single: list[int] = []
        tables: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for word in p.bad_words_token_ids:
            if len(word) == 1:
                single.append(word[0])
            elif word:
                tables.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), []).append(
                    word[-1])
        self.single_banned = np.unique(np.asarray(single, np.int64))
        self.bad_prefixes = sorted(tables.items())
        self.max_prefix = self.bad_prefixes[-1][0] if self.bad_prefixes else 0
        stop = [*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)] \
            if p.min_tokens > 0 else []
        self.min_tokens_stop_ids = np.unique(np.asarray(stop, np.int64)) if stop else None
        self.bias_ids = self.bias_values = None
        if p.logit_bias:
            self.bias_ids = np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias))
            self.bias_values = np.fromiter(p.logit_bias.values(), np.float32,
                                           len(p.logit_bias))
        self._always: tuple[int, np.ndarray] | None = None
        self.key = (id(p), tuple(eos_token_ids))   # how SamplingState finds them again
        self.num_rows = 0

    @staticmethod
    def needed(p: SamplingParams, eos_token_ids: list[int]) -> bool:
        """Whether `p` has any list-valued control to apply."""
        return bool(p.logit_bias or p.allowed_token_ids is not None or p.bad_words_token_ids
                    or (p.min_tokens > 0 and (p.stop_token_ids or
                                              (eos_token_ids and not p.ignore_eos))))

    def always_banned(self, vocab: int) -> np.ndarray:
        """Ids masked at every step over a vocabulary of `vocab`: those outside
        allowed_token_ids and the one-token bad words (built on first use, then kept)."""
        if self._always is None or self._always[0] != vocab:
            banned = self.single_banned
            if self.allowed is not None:
                banned = np.union1d(np.setdiff1d(np.arange(vocab), self.allowed), banned)
            self._always = (vocab, banned)
        return self._always[1]

    def banned_after(self, tail: list[int]) -> list[int]:
        """The multi-token bad words' last tokens banned after output ending in `tail` (at
        least the last `max_prefix` output tokens, fewer if the output is shorter): one
        lookup per distinct prefix length."""
        banned: list[int] = []
        for k, table in self.bad_prefixes:
            if k > len(tail):
                break
            hit = table.get(tuple(tail[len(tail) - k:]))
            if hit is not None:
                banned.extend(hit)
        return banned


class SamplingState:
    def __init__(self, max_num_reqs: int) -> None:
        n = max_num_reqs
        self.temperature = np.ones(n, np.float32)
        self.top_k = np.zeros(n, np.int64)          # 0 = off
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.presence = np.zeros(n, np.float32)
        self.frequency = np.zeros(n, np.float32)
        self.repetition = np.ones(n, np.float32)
        self.seed = np.zeros(n, np.uint64)
        self.seeded = np.zeros(n, bool)               # False = the shared generator
        self.num_logprobs = np.full(n, -1, np.int64)  # -1 = none
        self.num_prompt_logprobs = np.full(n, -1, np.int64)
        self.min_tokens = np.zeros(n, np.int64)
        self.masks: dict[int, RequestMasks] = {}   # rows with list-valued controls
        self._shared: dict[tuple[int, tuple[int, ...]], RequestMasks] = {}   # by .key

    def set_row(self, row: int, p: SamplingParams, eos_token_ids: list[int],
                child_index: int = 0) -> None:
        """Row `row` now holds completion `child_index` of a request with params `p` (rows
        given the same `p` object share its precomputed masks)."""
        greedy = p.greedy
        # as vLLM, a tiny temperature is raised to MIN_TEMPERATURE (logits / t must stay
        # finite); a huge one is capped where float32 still holds it
        self.temperature[row] = 0.0 if greedy else min(max(p.temperature, MIN_TEMPERATURE),
                                                       MAX_TEMPERATURE)
        # vLLM: greedy requests drop the truncation controls (they cannot change argmax);
        # a top_k beyond any vocabulary is the same as none
        self.top_k[row] = 0 if greedy or p.top_k <= 0 or p.top_k >= MAX_TOP_K else p.top_k
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        # a penalty below float32's smallest normal would divide logits by zero
        self.repetition[row] = max(p.repetition_penalty, MIN_REPETITION_PENALTY)
        seed = p.child_seed(child_index)
        self.seeded[row] = seed is not None
        self.seed[row] = 0 if seed is None else seed
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.min_tokens[row] = p.min_tokens
        self.clear_row(row)
        if RequestMasks.needed(p, eos_token_ids):
            masks = self._shared.get((id(p), tuple(eos_token_ids)))
            if masks is None or masks.params is not p:
                masks = RequestMasks(p, eos_token_ids)
                self._shared[masks.key] = masks
            masks.num_rows += 1
            self.masks[row] = masks

    def clear_row(self, row: int) -> None:
        masks = self.masks.pop(row, None)
        if masks is not None:
            masks.num_rows -= 1
            if not masks.num_rows and self._shared.get(masks.key) is masks:
                del self._shared[masks.key]

    def rows_with_extras(self, rows: np.ndarray) -> list[tuple[int, int]]:
        """(index in rows, row) of the rows with a logit bias, allowed ids, bad words or
        min_tokens stop ids; no per-row work when no request in the batch uses them."""
        if not self.masks:
            return []
        return [(i, row) for i, row in enumerate(rows.tolist()) if row in self.masks]

    def needs_processing(self, rows: np.ndarray) -> bool:
        """Any of rows has a mask, bias or penalty to apply before temperature."""
        return bool(self.rows_with_extras(rows)) or bool(self.needs_penalties(rows).any())

    def plain_greedy(self, rows: np.ndarray) -> bool:
        """Every row is greedy with nothing to apply first (no penalties, masks, bias or
        logprobs): the argmax of the raw logits is the whole of sampling."""
        return bool((self.temperature[rows] == 0).all() and (self.num_logprobs[rows] < 0).all()
                    and not self.needs_processing(rows))

    def needs_penalties(self, rows: np.ndarray) -> np.ndarray:
        """Boolean [len(rows)]: rows with any non-neutral penalty."""
        return ((self.presence[rows] != 0) | (self.frequency[rows] != 0)
                | (self.repetition[rows] != 1))
