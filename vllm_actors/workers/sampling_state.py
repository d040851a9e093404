"""Per-row sampling parameters of the persistent batch, as arrays the sampler indexes.

Common controls are dense arrays (one value per row); rare ones (logit bias, allowed ids,
bad words, min_tokens stop ids) live in small dicts keyed by row, so a step only touches
the rows that use them.
"""

from __future__ import annotations

import numpy as np

from vllm_actors.sampling_params import SamplingParams

MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = float(np.finfo(np.float32).max)
MAX_TOP_K = 2**31
MIN_REPETITION_PENALTY = float(np.finfo(np.float32).tiny)


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
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.allowed: dict[int, np.ndarray] = {}
        self.bad_words: dict[int, list[list[int]]] = {}
        self.min_tokens_stop_ids: dict[int, np.ndarray] = {}

    def set_row(self, row: int, p: SamplingParams, eos_token_ids: list[int]) -> None:
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
        self.seeded[row] = p.seed is not None
        self.seed[row] = 0 if p.seed is None else p.seed
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.min_tokens[row] = p.min_tokens
        self.clear_row(row)
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), np.int64)
            self.logit_bias[row] = (ids, np.fromiter(p.logit_bias.values(), np.float32))
        if p.allowed_token_ids is not None:
            self.allowed[row] = np.asarray(p.allowed_token_ids, np.int64)
        if p.bad_words_token_ids:
            self.bad_words[row] = [list(w) for w in p.bad_words_token_ids]
        if p.min_tokens > 0:
            stop = [*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)]
            if stop:
                self.min_tokens_stop_ids[row] = np.asarray(stop, np.int64)

    def clear_row(self, row: int) -> None:
        for extra in (self.logit_bias, self.allowed, self.bad_words, self.min_tokens_stop_ids):
            extra.pop(row, None)

    @property
    def _extras(self) -> tuple[dict, ...]:
        return (self.logit_bias, self.allowed, self.bad_words, self.min_tokens_stop_ids)

    def rows_with_extras(self, rows: np.ndarray) -> list[tuple[int, int]]:
        """(index in rows, row) of the rows with a logit bias, allowed ids, bad words or
        min_tokens stop ids; no per-row work when no request in the batch uses them."""
        if not any(self._extras):
            return []
        return [(i, row) for i, row in enumerate(rows.tolist())
                if any(row in extra for extra in self._extras)]

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
