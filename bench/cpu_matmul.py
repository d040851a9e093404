"""Quantized matmul of the CPU backend (`kernels/cpu/qmatmul`) against numpy float32 matmul
over the same weight pre-dequantized; prints a Markdown table of medians.

    python bench/cpu_matmul.py [--types Q8_0,Q4_K] [--shapes smol,8b] [--m 1,16,32,512]
                               [--runs 15] [--threads N]

Shapes: SmolLM2-135M's linears (fused QKV 960x576, gate_up 3072x576, down 576x1536, LM head
49152x576) at every --m, an 8B's (4096x4096, 28672x4096, 4096x14336) at M=1, and `square`
(2048x2048, every --m: the K-quants' many-row kernels, which need K % 256 == 0 and so skip
the K=576 shapes). Weights are random blocks (sane float16 scales);
speed does not depend on the values. Ours runs under `threads.configure()` (numba threads over
the usable CPUs, BLAS single-threaded); numpy's BLAS gets the same CPUs.
numpy is timed as `x @ W.T` on W [N, K] and as `x @ Wt` on a [K, N] copy (the numpy backend's
layout), and the faster of the two medians is the baseline. "speedup" = numpy / ours.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from threadpoolctl import threadpool_limits

from vllm_actors.kernels import quant
from vllm_actors.kernels.cpu import qmatmul as qm
from vllm_actors.kernels.cpu import threads

SHAPES = {
    "smol": [(960, 576), (3072, 576), (576, 1536), (49152, 576)],
    "8b": [(4096, 4096), (28672, 4096), (4096, 14336)],
    "square": [(2048, 2048)],
}
ALL_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def median_ms(fn: Callable[[], object], runs: int, min_seconds: float = 0.2) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < runs or (time.perf_counter() - start < min_seconds and len(times) < 500):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def random_weights(qt: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if qt == T.F32:
        return rng.standard_normal((n, k), dtype=np.float32)
    if qt in (T.F16, T.BF16):
        bits = rng.standard_normal((n, k), dtype=np.float32)
        return (bits.astype(np.float16).view(np.uint16) if qt == T.F16
                else (bits.view(np.uint32) >> 16).astype(np.uint16))
    block_size, type_size = quant.block_layout(qt)
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for name, offset in quant.BLOCK_OFFSETS[qt].items():
        if name in ("d", "dmin", "m"):
            scale = rng.uniform(1e-3, 1e-1, (len(blocks), 1)).astype(np.float16)
            blocks[:, offset:offset + 2] = scale.view(np.uint8)
    return blocks


def numpy_baseline(dense: np.ndarray, xs: dict[int, np.ndarray], runs: int
                   ) -> dict[int, float]:
    """The faster median of `x @ W.T` and `x @ Wt` (Wt a [K, N] copy) per batch size."""
    dense_t = np.ascontiguousarray(dense.T)
    return {m: min(median_ms(functools.partial(np.matmul, x, dense.T), runs),
                   median_ms(functools.partial(np.matmul, x, dense_t), runs))
            for m, x in xs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(ALL_TYPES))
    parser.add_argument("--shapes", default="smol,8b")
    parser.add_argument("--m", default="1,16,32,512",
                        help="batch rows for the smol and square shapes")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    cpus = threads.configure(args.threads)
    rng = np.random.default_rng(0)
    types = [T[name] for name in args.types.split(",")]
    ms = [int(v) for v in args.m.split(",")]
    print(f"threads: {cpus}; medians of >= {args.runs} runs\n")
    print("| type | shape (N x K) | M | ours ms | numpy f32 ms | speedup |")
    print("|---|---|---:|---:|---:|---:|")
    for group in args.shapes.split(","):
        for n, k in SHAPES[group]:
            batch = [1] if group == "8b" else ms
            xs = {m: rng.standard_normal((m, k), dtype=np.float32) for m in batch}
            with threadpool_limits(limits=cpus, user_api="blas"):
                base = numpy_baseline(rng.standard_normal((n, k), dtype=np.float32), xs,
                                      args.runs)
            for qt in types:
                if k % quant.block_layout(qt)[0] == 0:
                    w = qm.pack(random_weights(qt, n, k, rng), qt, (n, k))
                    for m in batch:
                        ours = median_ms(functools.partial(qm.matmul, w, xs[m]),
                                         args.runs)
                        print(f"| {T(qt).name} | {n}x{k} | {m} | {ours:.3f} | {base[m]:.3f} | "
                              f"{base[m] / ours:.2f}x |", flush=True)

if __name__ == "__main__":
    main()
