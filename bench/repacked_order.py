"""What llama.cpp's repacked float order costs our integer GEMV: Q4_0 and IQ4_NL weights of
random values timed in `qmatmul_int` with and without `ggml_repacked` (the order of
llama.cpp's 8-row interleaved kernels: a whole block's integer sum, then one fma per block
and output), for one row (a decode step, x quantized inside the call) and 16 rows. Run:

    python bench/repacked_order.py [--rounds 7]

Prints the median time of a call per case (each round 20 calls; caches warm).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1]
                                                               / "tests")]
from quant_blocks import quantize_iq4_nl  # noqa: E402

from vllm_actors.kernels.cpu import activations, qmatmul, qmatmul_int  # noqa: E402

SHAPES = ((1536, 576), (4096, 4096))


def weight(qtype: T, n: int, k: int, rng: np.random.Generator) -> qmatmul.QuantMatrix:
    w = rng.standard_normal((n, k)).astype(np.float32)
    if qtype == T.IQ4_NL:
        return qmatmul.pack_iq4_nl(quantize_iq4_nl(w), (n, k))
    return qmatmul.pack(gguf_quants.quantize(w, qtype), qtype, (n, k))


def per_call(call, rounds: int) -> float:
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(20):
            call()
        times.append((time.perf_counter() - start) / 20)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    rounds = parser.parse_args().rounds
    rng = np.random.default_rng(0)
    print("| type | shape | rows | vec_dot / tinyBLAS order (us) | repacked order (us) |")
    print("|---|---|---|---|---|")
    for qtype in (T.Q4_0, T.IQ4_NL):
        for n, k in SHAPES:
            base = weight(qtype, n, k, rng)
            for m in (1, 16):
                x = rng.standard_normal((m, k)).astype(np.float32)
                ones = np.ones(m, np.int64)
                cells = []
                for flag in (False, True):
                    w = replace(base, ggml_repacked=flag)
                    if m == 1:
                        cells.append(per_call(lambda: qmatmul_int.matmul_float(w, x, None, ones),
                                              rounds))
                    else:
                        cells.append(per_call(lambda: qmatmul_int.matmul(
                            w, activations.quantize_q8(x), None, ones), rounds))
                print(f"| {qtype.name} | {n}x{k} | {m} | {cells[0]:.0f} | {cells[1]:.0f} |")


if __name__ == "__main__":
    main()
