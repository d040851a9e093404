"""What an AVX2 host's many-row matmul of a 32-weight block type could run at, in vec_dot's
float order: a small C library (compiled here with the system's gcc, -O3 -mavx2 -mfma) of
the row dots `qwide.body` runs on a chunk of 16 decoded Q4_1 weight rows, for every row of x:
per block, group t of 4 weights of all 16 rows against x's 4 quants broadcast
(`vpmaddubsw`, `vpmaddwd`), converted and fused into lane accumulator t (`vcvtdq2ps`, FMA),
the 8 lanes added at the end as `hsum_float_8` adds them, plus the min sums. Two forms:

- 16 rows a pass (two 8-float vectors a lane: 16 accumulators, which AVX2's 16 registers
  cannot all hold, so some spill), as `qwide.body` does;
- two passes of 8 rows (8 accumulators, no spill; x's broadcasts twice).

The C library runs in this process (ctypes) on the chunk our kernel decodes from a random
interleaved Q4_1, its floats checked equal to ours bit for bit; ours is `qwide.matmul` at 2M
and M rows of x on one thread, the difference of their best times being M rows of row dots
(the chunks' decode cancels). The forms are timed in turn, --runs rounds, the best of each.
Prints ns per block of 16 rows and row of x, and G MAC/s; ours runs its AVX2 path whatever
the host has.

    python bench/avx2_many_rows.py [--cols 576] [--rows-of-x 16] [--runs 15]

Exits 1 where the CPU or the compiler lacks AVX2. What the numbers say is in
docs/BENCHMARKS.md ("The AVX2 host's kernels against their bounds").
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")      # before numba is imported

import numpy as np  # noqa: E402
from c_program import built  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
// codes: group t of row l of block b at word (8 b + t) 16 + l (4 codes, a byte each); dw, mw:
// the rows' d and m of block b at [16 b + l]; x: m rows of k = 32 nb int8, xd / xs per block
static inline __m256i lanes(const uint8_t *c, int32_t xw) {
  __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)c), _mm256_set1_epi32(xw));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
static inline __m256 hsum8(const __m256 *a) {
  return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[4], a[0]), _mm256_add_ps(a[6], a[2])),
                       _mm256_add_ps(_mm256_add_ps(a[5], a[1]), _mm256_add_ps(a[7], a[3])));
}
static void pass(const uint8_t *codes, const float *dw, const float *mw, const int8_t *x,
                 const float *xd, const float *xs, float *out, int nb, int h, int halves) {
  __m256 acc[2][8], summ[2];
  for (int g = 0; g < halves; g++) {
    summ[g] = _mm256_setzero_ps();
    for (int t = 0; t < 8; t++) acc[g][t] = _mm256_setzero_ps();
  }
  const int32_t *xw = (const int32_t *)x;
  for (int b = 0; b < nb; b++) {
    __m256 dx = _mm256_set1_ps(xd[b]), sx = _mm256_set1_ps(xs[b]);
    for (int g = 0; g < halves; g++) {
      int lane0 = 8 * (h + g);
      __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(dw + 16 * b + lane0), dx);
      for (int t = 0; t < 8; t++)
        acc[g][t] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(lanes(codes + 4 * ((8 * b + t) * 16 + lane0), xw[8 * b + t])),
            sc, acc[g][t]);
      summ[g] = _mm256_fmadd_ps(_mm256_loadu_ps(mw + 16 * b + lane0), sx, summ[g]);
    }
  }
  for (int g = 0; g < halves; g++)
    _mm256_storeu_ps(out + 8 * (h + g), _mm256_add_ps(hsum8(acc[g]), summ[g]));
}
void rows16(const uint8_t *codes, const float *dw, const float *mw, const int8_t *x,
            const float *xd, const float *xs, float *out, int m, int nb) {
  for (int r = 0; r < m; r++)
    pass(codes, dw, mw, x + 32 * nb * r, xd + nb * r, xs + nb * r, out + 16 * r, nb, 0, 2);
}
void rows8(const uint8_t *codes, const float *dw, const float *mw, const int8_t *x,
           const float *xd, const float *xs, float *out, int m, int nb) {
  for (int r = 0; r < m; r++)
    for (int h = 0; h < 2; h++)
      pass(codes, dw, mw, x + 32 * nb * r, xd + nb * r, xs + nb * r, out + 16 * r, nb, h, 1);
}
void repeat(int form, long times, const uint8_t *codes, const float *dw, const float *mw,
            const int8_t *x, const float *xd, const float *xs, float *out, int m, int nb) {
  for (long i = 0; i < times; i++)
    (form ? rows8 : rows16)(codes, dw, mw, x, xd, xs, out, m, nb);
}
"""


def first_chunk(w, planes):  # type: ignore[no-untyped-def]
    """Chunk 0 of an interleaved Q4_1 as `qwide.body` decodes it: codes [nb, 8, 16, 4]
    (group t < 4 the low nibbles of stored word t, t >= 4 the high ones of word t - 4), and
    the 16 rows' d and m as floats [nb, 16]."""
    from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT
    qs, _, d, mn = planes
    nb = w.cols // 32
    words = np.ascontiguousarray(qs[:16]).reshape(-1)[:nb * 4 * 64].reshape(nb, 4, 16, 4)
    codes = np.concatenate([words & 15, words >> 4], axis=1)
    return (np.ascontiguousarray(codes, np.uint8), HALF_LUT[d.reshape(-1)[:16 * nb]],
            HALF_LUT[mn.reshape(-1)[:16 * nb]])


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def measure(lib: ctypes.CDLL, cols: int, m: int, runs: int) -> dict[str, float]:
    """ns per (block of 16 rows, row of x) of ours and each C form, the best of `runs`."""
    from gguf import GGMLQuantizationType as T
    from quant_blocks import random_blocks

    from vllm_actors.kernels.cpu import activations, qmatmul, qwide
    from vllm_actors.kernels.cpu import qmatmul_int as qi
    rng = np.random.default_rng(0)
    n, nb = 3072, cols // 32
    w = qmatmul.interleave(qmatmul.pack(random_blocks(T.Q4_1, n, cols, rng), T.Q4_1, (n, cols)))
    planes = qi._plan(w)[1]
    xs = {r: activations.quantize_q8((rng.standard_normal((r, cols)) * 2).astype(np.float32))
          for r in (m, 2 * m)}
    ours = {r: (lambda r=r: qwide.matmul(w, planes, xs[r], 4, qwide.LANES_ORDER, "avx2"))
            for r in xs}
    codes, dw, mw = first_chunk(w, planes)
    x = xs[m]
    out = np.empty((m, 16), np.float32)
    lib.repeat.argtypes = [ctypes.c_int, ctypes.c_long] + [ctypes.c_void_p] * 7 + \
        [ctypes.c_int] * 2
    lib.repeat.restype = None
    args = [_ptr(a) for a in (codes, dw, mw, x.qs, x.d, x.s, out)] + [m, nb]
    reference = ours[m]()[:, :16]
    for form in (0, 1):
        lib.repeat(form, 1, *args)
        if not np.array_equal(out.view(np.uint32), reference.view(np.uint32)):
            raise SystemExit(f"the C form {form} parts from qwide's floats")
    chunks = n // 16
    forms = {"C, 16 rows a pass": 0, "C, two passes of 8 rows": 1}
    ours_s: dict[int, list[float]] = {r: [] for r in ours}
    c_s: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(runs):
        for r, call in ours.items():
            ours_s[r].append(_seconds(call))
        for name, form in forms.items():
            c_s[name].append(_seconds(lambda form=form: lib.repeat(form, chunks, *args)))
    best = {"ours, 16 rows a pass (qwide.body)": min(ours_s[2 * m]) - min(ours_s[m]),
            **{name: min(v) for name, v in c_s.items()}}
    return {name: t * 1e9 / (m * chunks * nb) for name, t in best.items()}


def _seconds(call) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cols", type=int, default=576)
    parser.add_argument("--rows-of-x", type=int, default=16)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    if args.cols % 32:
        parser.error("cols must be a multiple of 32")
    from vllm_actors.kernels.cpu import isa
    if "avx2" not in isa.host_features():
        print("this CPU has no AVX2", file=sys.stderr)
        return 1
    with built(SOURCE, ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"]) as library:
        if library is None:
            return 1
        found = measure(ctypes.CDLL(str(library)), args.cols, args.rows_of_x, args.runs)
    print(f"Q4_1 3072x{args.cols}, {args.rows_of_x} rows of x, one thread, in cache: row dots, "
          f"ns per (block of 16 rows, row of x), the best of {args.runs}")
    print("| form | ns | G MAC/s |\n|---|---|---|")
    for name, ns in found.items():
        print(f"| {name} | {ns:.2f} | {512 / ns:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
