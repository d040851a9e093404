"""Token sampling from logits: greedy rows by one vectorized argmax, the rest by temperature.

Categorical sampling uses the exponential race: argmax(p / q), q ~ Exp(1). A seeded request
draws q from a generator keyed by (seed, output index), so its tokens do not depend on
batching, chunking or preemption; unseeded requests share one generator seeded by --seed.
"""

from __future__ import annotations

import numpy as np

from vllm_actors.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int) -> None:
        self.shared_generator = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray, params: list[SamplingParams],
               output_index: np.ndarray) -> np.ndarray:
        """logits [N, V] float32; output_index [N]: how many tokens each request has already
        generated. Returns [N] token ids."""
        token_ids = np.argmax(logits, axis=-1)
        for row, p in enumerate(params):
            if p.greedy:
                continue
            scaled = logits[row] / np.float32(p.temperature)
            probs = np.exp(scaled - scaled.max())
            probs /= probs.sum()
            gen = (self.shared_generator if p.seed is None
                   else np.random.default_rng((p.seed, int(output_index[row]))))
            q = gen.exponential(size=probs.shape).astype(np.float32)
            token_ids[row] = int(np.argmax(probs / q))
        return token_ids
