"""The llama.cpp-order attention (`kernels/ggml_attention.py`) on random float16 caches of a
model's shape: one prefill of --tokens query tokens, and one decode step over that context.

    python bench/ggml_attention.py [--tokens 512] [--heads 9] [--kv-heads 3] [--head-dim 64]
        [--runs 5] [--threads N]

Prints the median milliseconds of each (per layer: multiply by the model's layer count).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from vllm_actors.kernels import ggml_attention
from vllm_actors.kernels.cpu import threads


def _median_ms(fn, runs: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    print(f"threads {threads.configure(args.threads)}")
    rng = np.random.default_rng(0)
    n, bs = args.tokens, 16
    blocks = -(-n // bs) + 1
    shape = (blocks, bs, args.kv_heads, args.head_dim)
    kc, vc = (rng.standard_normal(shape).astype(np.float16).view(np.uint16) for _ in range(2))
    table = np.arange(1, blocks, dtype=np.int32)[None]
    q = rng.standard_normal((n, args.heads, args.head_dim)).astype(np.float32)
    scale = args.head_dim ** -0.5
    prefill = _median_ms(lambda: ggml_attention.attend(
        q, kc, vc, np.array([0, n]), np.array([n]), table, bs, scale), args.runs)
    decode = _median_ms(lambda: ggml_attention.attend(
        q[:1], kc, vc, np.array([0, 1]), np.array([n]), table, bs, scale), args.runs * 4)
    print(f"prefill of {n} tokens: {prefill:.2f} ms; one decode step over {n} keys: "
          f"{decode:.3f} ms")


if __name__ == "__main__":
    main()
