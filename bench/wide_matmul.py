"""The quantized semantics' matmuls of many rows: `qwide` (32-weight block types) and `ktiled`
(K-quants), 16 decoded weight rows as the lanes of one vector, against the pair kernels of
`qmatmul_int` / `qmatmul_int_k` in the same float order (bit for bit the same outputs,
checked here too). Random blocks; prints a Markdown table of medians, ms per call (G MAC/s).

    python bench/wide_matmul.py [--rows 2,4,8,16,64,512] [--runs 7] [--shapes small,8b]

One row (`--rows 1`): `qwide.one_row` (the 32-weight types) and `krow` (the repacked Q4_K
GEMV order), each block of 16 weight rows decoded in registers, against the pair GEMV's
one-row body, x quantized inside both calls.

small: SmolLM2's gate_up (Q4_1 3072x576), Gemma 3 270M's gate_up (Q5_0 4096x640), v (Q8_0
1536x640), down (Q6_K 640x2048), o (Q4_K repacked 640x1024, the GEMV's order of one-row
requests); 8b: Llama-3-8B's shapes (Q4_0, Q8_0, the repacked Q4_K GEMV order, Q6_K tiled).
The repacked Q4_K GEMM (kind 84) and the tiled order on Q4_K/Q5_K have no pair kernel left.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quant_blocks import random_blocks  # noqa: E402

from vllm_actors.kernels.cpu import activations, krow, ktiled, qmatmul  # noqa: E402
from vllm_actors.kernels.cpu import qmatmul_int as qi  # noqa: E402
from vllm_actors.kernels.cpu import qmatmul_int_k as qk  # noqa: E402
from vllm_actors.kernels.cpu import qwide  # noqa: E402

# (type, kind of the pair kernels, ktiled's order or None, rows, cols, repacked)
SHAPES = {
    "small": [(T.Q4_1, 4, None, 3072, 576, False), (T.Q5_0, 50, None, 4096, 640, False),
              (T.Q8_0, 8, None, 1536, 640, False), (T.Q6_K, 96, ktiled.TILED, 640, 2048, False),
              (T.Q4_K, 44, ktiled.GEMV, 640, 1024, True)],
    "8b": [(T.Q4_0, 40, None, 4096, 4096, False), (T.Q8_0, 8, None, 4096, 4096, False),
           (T.Q4_K, 44, ktiled.GEMV, 14336, 4096, True),
           (T.Q6_K, 96, ktiled.TILED, 4096, 14336, False)],
}


def median_ms(fn: Callable[[], np.ndarray], runs: int) -> tuple[float, np.ndarray]:
    out = fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, out


def pair_and_wide(qtype: T, kind: int, order: int | None, w: qmatmul.QuantMatrix, m: int,
                  rng: np.random.Generator) -> tuple[Callable, Callable]:
    """(the pair kernel's call, the wide kernel's call) on m random rows of x."""
    x = (rng.standard_normal((m, w.cols)) * 2).astype(np.float32)
    if order is None:
        rows = activations.quantize_q8(x)
        planes = qi._plan(w)[1]
        if m == 1:        # a decode step's linear: x quantized inside either call
            return (lambda: qi.gemv_float(w, x),
                    lambda: qwide.one_row(w, planes, x, kind, qwide.LANES_ORDER))
        return (lambda: qi._run(w, qi.pad_rows(rows, qi.GROUP), m, kind, None),
                lambda: qwide.matmul(w, planes, rows, kind, qwide.LANES_ORDER))
    rows = activations.quantize_q8_k(x)
    if m == 1:            # the repacked Q4_K GEMV order (`qmatmul_int_k._in_registers`)
        return (lambda: qk._run(w, qk._scratch(1, w.cols), 1, kind, None, x),
                lambda: krow.matmul(w, floats=x))
    return (lambda: qk._run(w, qk.pad_rows(rows, qk.GROUP), m, kind, None),
            lambda: ktiled.matmul(w, rows, order))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2,4,8,16,64,512")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--shapes", default="small,8b")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| type (kind) | shape | rows | pair kernels | wide kernel | speed-up |")
    print("|---|---|---|---|---|---|")
    for group in args.shapes.split(","):
        for qtype, kind, order, n, k, repacked in SHAPES[group]:
            w = replace(qmatmul.pack(random_blocks(qtype, n, k, rng), qtype, (n, k)),
                        ggml_repacked=repacked)
            for m in (int(r) for r in args.rows.split(",")):
                if (kind == 96 and m < 8) or (m == 1 and order is not None and kind != 44):
                    continue    # the tiled order starts at 8 rows; one row: `krow`'s order only
                pair, wide = pair_and_wide(qtype, kind, order, w, m, rng)
                t_pair, a = median_ms(pair, args.runs)
                t_wide, b = median_ms(wide, args.runs)
                assert np.array_equal(a[:m].view(np.uint32), b.view(np.uint32)), (qtype, m)
                gmac = n * k * m / 1e6
                print(f"| {qtype.name} ({kind}) | {n}x{k} | {m} | {t_pair:.3f} "
                      f"({gmac / t_pair:.0f}) | {t_wide:.3f} ({gmac / t_wide:.0f}) | "
                      f"{t_pair / t_wide:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
