"""The integer GEMVs of `--gguf-activations quantized` (`kernels/cpu/qmatmul_int.py`, the
K-quants' `qmatmul_int_k.py`) against
the float kernels at one row of x (or `--rows 1,2,4,8`), on every SIMD path this CPU can run.

Rows: the float32 semantics' GEMV, the quantized semantics through x~ and the float kernels
(`activations.simulate`, the path before the integer kernel), the Q8 quantizer alone, and the
integer GEMV forced onto each path (`portable`, `avx2`, `avx512`). Medians of `--runs` timings
of `--reps` calls each, in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from vllm_actors.kernels import activation_quant
from vllm_actors.kernels.cpu import activations, isa, qmatmul, qmatmul_int, qmatmul_int_k, threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_matmul import random_weights  # noqa: E402

SHAPES = [(T.Q4_1, 3072, 576), (T.Q4_1, 576, 1536), (T.Q5_0, 4096, 4096),
          (T.Q4_0, 4096, 4096), (T.Q8_0, 49152, 576), (T.Q4_K, 4096, 4096),
          (T.Q5_K, 4096, 4096), (T.Q6_K, 4096, 4096), (T.Q4_K, 640, 2048),
          (T.Q6_K, 640, 2048)]


def _time(fn: Callable[[], object], runs: int, reps: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def _simulated(w: qmatmul.QuantMatrix, x: np.ndarray, fmt: str) -> None:
    xs, delta = activations.simulate(x, fmt)
    y = qmatmul.matmul(w, xs)
    if delta is not None:
        activations.add_mins(qmatmul.min_plane(w), delta, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", type=lambda t: [int(v) for v in t.split(",")], default=[1],
                        help="rows of x, comma-separated (default 1)")
    args = parser.parse_args()
    print(f"threads {threads.configure(args.threads)}, paths {', '.join(isa.available())}")
    rng = np.random.default_rng(0)
    for qtype, n, k in SHAPES:
        blocks = (random_weights(qtype, n, k, rng) if qtype in qmatmul_int_k.KINDS  # no K-quant
                  else quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype))
        w = qmatmul.pack(blocks, qtype, (n, k))
        for m in args.rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            cells = _cells(w, x, args.runs, max(3, int(2e8 / (n * k * m))))
            print(f"{qtype.name} {n}x{k} M={m}: "
                  + ", ".join(f"{k_} {v:.0f}" for k_, v in cells.items()), flush=True)


def _cells(w: qmatmul.QuantMatrix, x: np.ndarray, runs: int, reps: int) -> dict[str, float]:
    """Microseconds per call of each way to compute x @ W.T."""
    fmt = activation_quant.activation_format(w.qtype)
    quantize = activations.quantize_q8_k if fmt == "q8_k" else activations.quantize_q8
    integer = qmatmul_int_k.matmul if fmt == "q8_k" else qmatmul_int.matmul
    rows = quantize(x)
    cells = {"float32": _time(lambda: qmatmul.matmul(w, x), runs, reps),
             "x~ + float": _time(lambda: _simulated(w, x, fmt), runs, reps),
             "quantize": _time(lambda: quantize(x), runs, reps)}
    for path in isa.available():
        cells[f"int {path}"] = _time(lambda p=path: integer(w, rows, path=p),  # type: ignore[operator]
                                     runs, reps)
    return cells

if __name__ == "__main__":
    main()
