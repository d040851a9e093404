"""The quantized semantics' integer kernels at the row counts the engine gives them, in one
process on one thread (in cache, the best of --runs repeats): `krow` (a repacked Q4_K stored
16 rows interleaved, 1, 2 and 4 rows of x), `ktiled` (16 rows of x: Q4_K/Q5_K/Q6_K in ggml's
tiled order, Q4_K in the repacked GEMV's) and `qwide` on a repacked Q4_0 (1 and 16 rows, its
one chain a block) and on Q8_0 (16 rows: a 32768-row slice of a tied table as stored, and an
interleaved linear). Random blocks; prints G MAC/s.

    python bench/row_kernels.py [--runs 15]

To compare two trees, run it on each in turn, several times (`PYTHONPATH=<tree>`, a
NUMBA_CACHE_DIR of its own each): these hosts are noisy, read the best of each tree.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numba
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quant_blocks import random_blocks  # noqa: E402

from vllm_actors.kernels.cpu import activations, krow, ktiled, qmatmul  # noqa: E402
from vllm_actors.kernels.cpu import qmatmul_int as qi  # noqa: E402


def best_s(fn: Callable[[], object], runs: int, calls: int) -> float:
    """The fastest of `runs` repeats of `calls` calls, seconds a call."""
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def weight(qtype: T, n: int, k: int, rng: np.random.Generator, repacked: bool = False,
           interleaved: bool = True) -> qmatmul.QuantMatrix:
    w = replace(qmatmul.pack(random_blocks(qtype, n, k, rng), qtype, (n, k)),
                ggml_repacked=repacked)
    return qmatmul.interleave(w) if interleaved else w


def cases(rng: np.random.Generator) -> list[tuple[str, int, Callable[[], object]]]:
    """(label, multiply-adds a call, the call)."""
    out = []
    w = weight(T.Q4_K, 2048, 4096, rng, repacked=True)
    for m in (1, 2, 4):
        x = activations.quantize_q8_k(rng.standard_normal((m, 4096)).astype(np.float32))
        out.append((f"krow Q4_K 2048x4096, {m} rows", 2048 * 4096 * m,
                    lambda w=w, x=x: krow.matmul(w, x)))
    x16 = activations.quantize_q8_k(rng.standard_normal((16, 2048)).astype(np.float32))
    for qtype, order, name in ((T.Q4_K, ktiled.TILED, "tiled"), (T.Q4_K, ktiled.GEMV, "GEMV"),
                               (T.Q5_K, ktiled.TILED, "tiled"), (T.Q6_K, ktiled.TILED, "tiled")):
        w = weight(qtype, 1024, 2048, rng, interleaved=False)
        out.append((f"ktiled {qtype.name} 1024x2048 {name}, 16 rows", 1024 * 2048 * 16,
                    lambda w=w, order=order: ktiled.matmul(w, x16, order)))
    w = weight(T.Q4_0, 2048, 4096, rng, repacked=True)      # llama.cpp's repacked order
    x1 = rng.standard_normal((1, 4096)).astype(np.float32)
    out.append(("qwide Q4_0 repacked 2048x4096 interleaved, 1 row", 2048 * 4096,
                lambda w=w: qi.matmul_float(w, x1)))
    xq = activations.quantize_q8(rng.standard_normal((16, 4096)).astype(np.float32))
    out.append(("qwide Q4_0 repacked, 16 rows", 2048 * 4096 * 16,
                lambda w=w: qi.matmul(w, xq, requests=np.array([16]))))
    x8 = activations.quantize_q8(rng.standard_normal((16, 640)).astype(np.float32))
    requests = np.ones(16, np.int64)
    for n, interleaved in ((32768, False), (2048, True)):
        w = weight(T.Q8_0, n, 640, rng, interleaved=interleaved)
        form = "interleaved" if interleaved else "as stored"
        out.append((f"qwide Q8_0 {n}x640 {form}, 16 rows", n * 640 * 16,
                    lambda w=w: qi.matmul(w, x8, requests=requests)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    numba.set_num_threads(1)
    print("| kernel | G MAC/s |")
    print("|---|---|")
    for label, macs, fn in cases(np.random.default_rng(0)):
        calls = max(1, int(2e8 // macs))
        print(f"| {label} | {macs / best_s(fn, args.runs, calls) / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
