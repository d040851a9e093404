"""N-gram drafts (vLLM's "ngram", prompt lookup): the longest n in [n_min, n_max] whose last
n tokens occur earlier in the request proposes the tokens that followed that occurrence."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Args:
        num_speculative_tokens: most drafts per call.
        n_min / n_max: shortest / longest n-gram matched (prompt_lookup_min / _max).
    """

    def __init__(self, num_speculative_tokens: int, n_min: int, n_max: int) -> None:
        self.k = num_speculative_tokens
        self.n_min, self.n_max = n_min, n_max

    def propose(self, req_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> list[int]:
        """Drafts after `token_ids` (the request's known tokens). Among the earlier
        occurrences of the longest matching suffix, the latest one with k tokens after it
        wins (else the one with the most after it, the earliest)."""
        num = len(token_ids)
        if num <= self.n_min:
            return []
        # candidate ends: earlier positions holding the last token, with a token after them
        ends = np.flatnonzero(token_ids[:num - 1] == token_ids[num - 1])
        length = 1
        while len(ends) and length < self.n_max:
            back = ends - length
            ok = back >= 0
            ok[ok] = token_ids[back[ok]] == token_ids[num - 1 - length]
            if not ok.any():
                break
            ends = ends[ok]
            length += 1
        if not len(ends) or length < self.n_min:
            return []
        full = ends[ends + self.k < num]
        end = int(full[-1]) if len(full) else int(ends[0])
        return token_ids[end + 1:end + 1 + self.k].tolist()

    def finish(self, req_id: str) -> None:
        """No per-request state."""
