"""What an AVX2 host's one-row GEMV of a 32-weight block type could run at: a small C program
(compiled here with the system's gcc, -mavx2 -mfma -mf16c) times three forms of a Q4_1 x Q8_1
GEMV of one row of x, all in `vec_dot_q4_1_q8_1`'s float order (8 float lanes, lane t the
exact sum of weights 4t..4t+3 of a block, hsum_float_8 at the end) and checked equal:

- per row, as ggml's AVX2 `vec_dot` loops (`maddubs` + `madd` on a row's 32 codes);
- 8 rows as the lanes of a 256-bit vector, their stored blocks transposed in registers (what
  `qwide.one_row` does with 16 rows on AVX-512);
- 8 rows as the lanes, interleaved once at load (each group of 4 codes of 8 rows one 32-byte
  load, their scales and mins side by side): no transposes, 8 accumulators in registers;

and beside them our `qmatmul_int.matmul_float` on the same shape (one numba thread), its rows
as stored and 16 rows interleaved as the engine keeps them (`qmatmul.interleave`), in ns per
block and row of the weight, in cache (one matrix, repeated).

    python bench/avx2_rows.py [--rows 1536] [--cols 576] [--runs 5]

Exits 1 where the CPU or the compiler lacks AVX2. What the numbers say is in
docs/BENCHMARKS.md ("The AVX2 host").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from c_program import built

os.environ.setdefault("NUMBA_NUM_THREADS", "1")      # before numba is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SOURCE = r"""
// argv: rows cols [copies of the weight, cycled to read it from memory]; prints ns per
// (block, row) of the three forms, or "differ" and exit 1 when their floats differ
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
typedef struct { uint16_t d, m; uint8_t qs[16]; } bq41;
typedef struct { float d, s; int8_t qs[32]; } bq81;
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline float hsum8(__m256 x) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r)); r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
// ggml's AVX2 vec_dot_q4_1_q8_1, a row at a time
static void gemv_a(const bq41 *w, const bq81 *x, float *out, int rows, int nb) {
  const __m256i ones = _mm256_set1_epi16(1), lo = _mm256_set1_epi8(15);
  for (int r = 0; r < rows; r++) {
    __m256 acc = _mm256_setzero_ps(); float summs = 0;
    const bq41 *wr = w + (size_t)r * nb;
    for (int b = 0; b < nb; b++) {
      summs += h2f(wr[b].m) * x[b].s;
      __m256 d = _mm256_set1_ps(h2f(wr[b].d) * x[b].d);
      __m128i t = _mm_loadu_si128((const __m128i *)wr[b].qs);
      __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), lo);
      __m256i y = _mm256_loadu_si256((const __m256i *)x[b].qs);
      __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), ones);
      acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc);
    }
    out[r] = hsum8(acc) + summs;
  }
}
// 8 rows' codes of groups j (low nibbles) and j + 4 (high) in one vector, a row in each
// 32-bit lane: lane t of each row's vec_dot, scaled into its accumulator
static inline void two_groups(__m256i v, const int32_t *xw, int j, __m256 sc, __m256 *acc) {
  const __m256i ones = _mm256_set1_epi16(1), lo = _mm256_set1_epi8(15);
  __m256i q0 = _mm256_and_si256(v, lo), q1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
  __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, _mm256_set1_epi32(xw[j])), ones);
  __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, _mm256_set1_epi32(xw[j + 4])), ones);
  acc[j] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(p0), acc[j]);
  acc[j + 4] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(p1), acc[j + 4]);
}
// hsum_float_8's order over the 8 lane accumulators, 8 rows at once
static inline __m256 hsum8_lanes(const __m256 *a) {
  return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[4], a[0]), _mm256_add_ps(a[6], a[2])),
                       _mm256_add_ps(_mm256_add_ps(a[5], a[1]), _mm256_add_ps(a[7], a[3])));
}
// 8 rows a pass: per block, 8 rows' 16 bytes transposed to 4 vectors (dword j of each row)
static void gemv_b(const bq41 *w, const bq81 *x, float *out, int rows, int nb) {
  for (int r0 = 0; r0 < rows; r0 += 8) {
    __m256 acc[8], summs = _mm256_setzero_ps();
    for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
      const bq41 *p[8];
      for (int l = 0; l < 8; l++) p[l] = w + (size_t)(r0 + l) * nb + b;
      __m256i v[4];
      for (int l = 0; l < 4; l++)
        v[l] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)p[l + 4]->qs),
                                _mm_loadu_si128((const __m128i *)p[l]->qs));
      __m256i a = _mm256_unpacklo_epi32(v[0], v[1]), bb = _mm256_unpackhi_epi32(v[0], v[1]);
      __m256i c = _mm256_unpacklo_epi32(v[2], v[3]), e = _mm256_unpackhi_epi32(v[2], v[3]);
      __m256i wd[4] = {_mm256_unpacklo_epi64(a, c), _mm256_unpackhi_epi64(a, c),
                       _mm256_unpacklo_epi64(bb, e), _mm256_unpackhi_epi64(bb, e)};
      // lanes are rows 0,1,2,3 | 4,5,6,7 in each: row order (l, l+4) handled at the end
      uint16_t dh[8], mh[8];
      for (int l = 0; l < 8; l++) { dh[l] = p[l]->d; mh[l] = p[l]->m; }
      __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
      __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh));
      __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(x[b].d));
      summs = _mm256_fmadd_ps(mw, _mm256_set1_ps(x[b].s), summs);
      const int32_t *xw = (const int32_t *)x[b].qs;
      for (int j = 0; j < 4; j++) two_groups(wd[j], xw, j, sc, acc);
    }
    _mm256_storeu_ps(out + r0, _mm256_add_ps(hsum8_lanes(acc), summs));
  }
}
// interleaved: per 8 rows, per block: 4 x 32 bytes (dword j of rows 0..7), d[8], m[8] halves
typedef struct { uint8_t q[4][32]; uint16_t d[8], m[8]; } b8;
static void gemv_c(const b8 *w, const bq81 *x, float *out, int rows, int nb) {
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const b8 *wc = w + (size_t)(r0 / 8) * nb;
    __m256 acc[8], summs = _mm256_setzero_ps();
    for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
      _mm_prefetch((const char *)(wc + b + 8), _MM_HINT_T0);
      __m256 sc = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wc[b].d)), _mm256_set1_ps(x[b].d));
      summs = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)wc[b].m)), _mm256_set1_ps(x[b].s), summs);
      const int32_t *xw = (const int32_t *)x[b].qs;
      for (int j = 0; j < 4; j++)
        two_groups(_mm256_loadu_si256((const __m256i *)wc[b].q[j]), xw, j, sc, acc);
    }
    _mm256_storeu_ps(out + r0, _mm256_add_ps(hsum8_lanes(acc), summs));
  }
}
int main(int argc, char **argv) {
  int rows = argc > 1 ? atoi(argv[1]) : 1536, cols = argc > 2 ? atoi(argv[2]) : 576, reps = 2000;
  int copies = argc > 3 ? atoi(argv[3]) : 1;
  int nb = cols / 32;
  bq41 *w = aligned_alloc(64, sizeof(bq41) * rows * nb * copies);
  b8 *wi = aligned_alloc(64, sizeof(b8) * rows / 8 * nb * copies);
  bq81 *x = aligned_alloc(64, sizeof(bq81) * nb);
  srand(1);
  for (size_t i = 0; i < (size_t)rows * nb * copies; i++) {
    w[i].d = 0x2000 + rand() % 256; w[i].m = 0xa000 + rand() % 256;
    for (int k = 0; k < 16; k++) w[i].qs[k] = rand();
  }
  for (int cp = 0; cp < copies; cp++)
    for (int r0 = 0; r0 < rows; r0 += 8) for (int b = 0; b < nb; b++) {
      b8 *o = wi + (size_t)cp * rows / 8 * nb + (size_t)(r0 / 8) * nb + b;
      for (int l = 0; l < 8; l++) {
        bq41 *s = w + (size_t)cp * rows * nb + (size_t)(r0 + l) * nb + b;
        o->d[l] = s->d; o->m[l] = s->m;
        for (int j = 0; j < 4; j++) memcpy(&o->q[j][4 * l], s->qs + 4 * j, 4);
      }
    }
  for (int b = 0; b < nb; b++) { x[b].d = 0.01f; x[b].s = 3; for (int k = 0; k < 32; k++) x[b].qs[k] = rand() % 256 - 128; }
  float *oa = malloc(4 * rows), *ob = malloc(4 * rows), *oc = malloc(4 * rows);
  gemv_a(w, x, oa, rows, nb); gemv_b(w, x, ob, rows, nb); gemv_c(wi, x, oc, rows, nb);
  for (int r = 0; r < rows; r++) if (oa[r] != ob[r] || oa[r] != oc[r]) { printf("differ at %d: %g %g %g\n", r, oa[r], ob[r], oc[r]); return 1; }
  for (int k = 0; k < 1; k++) {
    double best[3] = {1e30, 1e30, 1e30};
    for (int rep = 0; rep < 5; rep++) {
      double t0 = now();
      for (int i = 0; i < reps; i++) gemv_a(w + (size_t)(i % copies) * rows * nb, x, oa, rows, nb);
      double t1 = now();
      for (int i = 0; i < reps; i++) gemv_b(w + (size_t)(i % copies) * rows * nb, x, ob, rows, nb);
      double t2 = now();
      for (int i = 0; i < reps; i++) gemv_c(wi + (size_t)(i % copies) * rows / 8 * nb, x, oc, rows, nb);
      double t3 = now();
      double n = (double)reps * rows * nb / 1e9;
      if ((t1 - t0) / n < best[0]) best[0] = (t1 - t0) / n;
      if ((t2 - t1) / n < best[1]) best[1] = (t2 - t1) / n;
      if ((t3 - t2) / n < best[2]) best[2] = (t3 - t2) / n;
    }
    printf("%.3f %.3f %.3f\n", best[0], best[1], best[2]);
  }
  return 0;
}
"""


def ours(rows: int, cols: int, runs: int, interleaved: bool) -> float:
    """ns per (block, row) of our one-row Q4_1 linear on one thread (the median of `runs`),
    its rows as stored or `interleaved`."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from quant_blocks import random_blocks

    from vllm_actors.kernels.cpu import qmatmul, qmatmul_int
    rng = np.random.default_rng(0)
    w = qmatmul.pack(random_blocks(T.Q4_1, rows, cols, rng), T.Q4_1, (rows, cols))
    if interleaved:
        w = qmatmul.interleave(w)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    qmatmul_int.matmul_float(w, x)
    times = []
    for _ in range(runs):
        start, n = time.perf_counter(), 500
        for _ in range(n):
            qmatmul_int.matmul_float(w, x)
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times) * 1e9 / (rows * cols // 32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1536)
    parser.add_argument("--cols", type=int, default=576)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if args.rows % 16 or args.cols % 32:
        parser.error("rows must be a multiple of 16, cols of 32")
    with built(SOURCE, ["-O2", "-mavx2", "-mfma", "-mf16c"]) as binary:
        if binary is None:
            return 1
        runs = []
        for _ in range(args.runs):
            done = subprocess.run([str(binary), str(args.rows), str(args.cols)],
                                  capture_output=True, text=True)
            if done.returncode:
                print(done.stdout, done.stderr, file=sys.stderr)
                return 1
            runs.append([float(v) for v in done.stdout.split()])
    c = [statistics.median(r[i] for r in runs) for i in range(3)]
    print(f"Q4_1 {args.rows}x{args.cols}, one row of x, in cache, one thread: ns per (block, row), "
          f"median of {args.runs}")
    print("| form | ns |\n|---|---|")
    for name, v in zip(("ggml's vec_dot, row by row", "8 rows as lanes, transposed in registers",
                        "8 rows as lanes, interleaved at load"), c):
        print(f"| {name} | {v:.2f} |")
    for interleaved in (False, True):
        name = "16 rows interleaved" if interleaved else "rows as stored"
        print(f"| ours (qmatmul_int.matmul_float), {name} | "
              f"{ours(args.rows, args.cols, args.runs, interleaved):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
