"""Sampler time per step over a 49152-token vocabulary (SmolLM2's), by batch size and by
which controls are on. Medians over --runs x --steps steps; prints a Markdown table.

    python bench/sampler.py [--runs 5] [--steps 20]

Logits are SmolLM2's own: the rows of a 160-token prefill of an essay (real next-token
distributions); `--flat` uses Gaussian logits instead, the worst case for top-p (thousands
of tokens needed to reach the mass).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from vllm_actors.sampling_params import SamplingParams
from vllm_actors.workers.sampler import Sampler
from vllm_actors.workers.sampling_state import SamplingState

VOCAB = 49152
PROMPT, OUTPUT = 200, 100

SETS = {
    "greedy": dict(temperature=0.0),
    "common: temperature 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "every control": dict(temperature=0.8, top_p=0.95, top_k=50, min_p=0.02,
                          presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1,
                          logit_bias={5: 1.0, 9: -2.0}, bad_words_token_ids=[[7, 8], [11]],
                          min_tokens=150, max_tokens=500, seed=3, logprobs=5),
}


_MODEL_LOGITS: list[np.ndarray] = []


def model_logits() -> np.ndarray:
    """[160, V] logits of SmolLM2 over an essay (computed once)."""
    if not _MODEL_LOGITS:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from model_driver import prompt_logits
        from oracle.prompts import LONG_ESSAY

        from vllm_actors.kernels.numpy_backend import NumpyBackend
        from vllm_actors.loaders.model_files import resolve_model
        from vllm_actors.loaders.tokenizer import load_tokenizer
        from vllm_actors.models.registry import load_model
        source, backend = resolve_model(None), NumpyBackend()
        ids = load_tokenizer(source).encode(LONG_ESSAY)[:160]
        _MODEL_LOGITS.append(prompt_logits(load_model(source, backend), backend, ids))
    return _MODEL_LOGITS[0]


def make_logits(rng: np.random.Generator, batch: int, flat: bool) -> np.ndarray:
    if flat:
        return (rng.standard_normal((batch, VOCAB)) * 3).astype(np.float32)
    pool = model_logits()
    return pool[rng.choice(len(pool), batch, replace=batch > len(pool))]


def per_step_ms(batch: int, params: SamplingParams, steps: int, flat: bool = False) -> float:
    rng = np.random.default_rng(0)
    state = SamplingState(batch)
    for row in range(batch):
        state.set_row(row, params, [2])
    token_ids = rng.integers(0, VOCAB, (batch, PROMPT + OUTPUT + 1)).astype(np.int32)
    num_prompt = np.full(batch, PROMPT)
    num_tokens = np.full(batch, PROMPT + OUTPUT)
    logits = make_logits(rng, batch, flat)
    sampler, rows = Sampler(0), np.arange(batch)
    start = time.perf_counter()
    for _ in range(steps):
        sampler.sample(logits, rows, state, token_ids, num_prompt, num_tokens)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--flat", action="store_true", help="flat Gaussian logits")
    args = parser.parse_args()
    batches = (1, 32, 128)
    print("| controls | " + " | ".join(f"batch {b} ms/step" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name, kwargs in SETS.items():
        params = SamplingParams(**kwargs)
        cells = []
        for b in batches:
            runs = [per_step_ms(b, params, args.steps, args.flat) for _ in range(args.runs)]
            cells.append(f"{statistics.median(runs):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
