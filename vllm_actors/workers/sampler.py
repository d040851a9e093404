"""Token sampling from logits: greedy rows by argmax, the rest by temperature with per-request
seeded generators (the exponential-race form of categorical sampling: argmax(p / q), q ~ Exp(1))."""

from __future__ import annotations

import numpy as np

from vllm_actors.sampling_params import SamplingParams


class Sampler:
    """Args:
        seed: seeds the generator shared by requests that give no seed of their own.
    """

    def __init__(self, seed: int) -> None:
        self.shared_generator = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray, params: list[SamplingParams],
               generators: list[np.random.Generator | None]) -> list[int]:
        """logits [N, V] float32 -> one token id per row."""
        token_ids = np.argmax(logits, axis=-1)
        for row, (p, gen) in enumerate(zip(params, generators)):
            if p.greedy:
                continue
            scaled = logits[row] / np.float32(p.temperature)
            probs = np.exp(scaled - scaled.max())
            probs /= probs.sum()
            q = (gen or self.shared_generator).exponential(size=probs.shape).astype(np.float32)
            token_ids[row] = int(np.argmax(probs / q))
        return token_ids.tolist()
