"""Verifying drafts in one target step.

A request with k drafts scheduled samples at k + 1 positions (its last known token, then each
draft): "entries". Every entry is sampled exactly as a step without speculation would sample
at that position, with the drafts before it counted as outputs (penalties, min_tokens, bad
words, a seeded request's output index). The drafts are then accepted while each equals the
token sampled before it; the output is the accepted drafts and the token sampled after them.

For drafts that are point masses (n-gram, suffix, and a draft model drafting its argmax, as
vLLM's proposers do) this is exactly vLLM's rejection sampler: the draft d at a position is
kept with probability p(d) = min(1, p(d) / q(d)) with q(d) = 1, and on rejection the token
comes from p without d, renormalized, which is the normalized residual max(p - q, 0). It is
also the same coupling for every request: a greedy request produces the same tokens as
without speculation, and a seeded one too (its noise is keyed by output index, not step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SampleLayout:
    """Entries of the requests that sample this step (`done`: indices into the step's
    requests).

    Attributes:
        owner: [E] index into done of each entry.
        offset: [E] drafts before the entry (0 .. k).
        index: [E] the entry's token in the step's flat layout (its logits row).
        starts: [len(done) + 1] each request's range of entries.
    """

    owner: np.ndarray
    offset: np.ndarray
    index: np.ndarray
    starts: np.ndarray

    @property
    def num_entries(self) -> int:
        return len(self.owner)

    @property
    def has_drafts(self) -> bool:
        return self.num_entries > len(self.starts) - 1


def sample_layout(ends: np.ndarray, num_drafts: np.ndarray) -> SampleLayout:
    """ends [n]: one past each sampling request's last scheduled token in the flat layout;
    num_drafts [n]: its drafts (the last num_drafts + 1 tokens are sampled at)."""
    sizes = num_drafts.astype(np.int64) + 1
    starts = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=starts[1:])
    owner = np.repeat(np.arange(len(sizes)), sizes)
    offset = np.arange(starts[-1]) - np.repeat(starts[:-1], sizes)
    index = np.repeat(ends - sizes, sizes) + offset
    return SampleLayout(owner, offset, index, starts)


def accepted_tokens(tokens: np.ndarray, layout: SampleLayout,
                    drafts: list[list[int]]) -> list[list[int]]:
    """Per request: its accepted drafts and the token sampled after them, cut before the
    first entry that could not be sampled (token -1); [] when its first entry failed.

    tokens [E]: the token sampled at each entry; drafts: each request's drafts."""
    out = []
    starts = layout.starts.tolist()
    for i, draft in enumerate(drafts):
        sampled = tokens[starts[i]:starts[i + 1]].tolist()
        num = 0
        while num < len(draft) and sampled[num] == draft[num]:
            num += 1
        kept = sampled[:num + 1]
        if -1 in kept:
            kept = kept[:kept.index(-1)]
        out.append(kept)
    return out
