"""Blocked GEMM for the steps with more rows of x than the GEMV kernels take (batched decode,
prefill): `out[M, N] = x[M, K] @ W.T`, each weight decoded once per call.

- `pack_panels`: x is copied into panels of `PANEL` (16) rows, transposed: `xp[t, k, j] =
  x[16 t + j, k]`, zero beyond M. One k of a panel is two AVX2 vectors.
- `outer`: the micro-kernel, over a float32 tile of W `[R, K]`: four weight rows at a time,
  for each k four broadcast weights times the panel's two vectors, 64 accumulators (eight
  vectors) kept in registers through the whole K loop. Measured on one core of this 2-vCPU
  EPYC (2.45 GHz, AVX2): 31-35 GMAC/s at K = 576, 80-90 % of the FMA peak (two 8-lane FMAs per
  cycle); numpy's float32 BLAS reached 20 GMAC/s per thread at M = 16 on the same shapes.
  Panels are visited in chunks that fit in L2 (`chunk` panels) for every 4-row group, so at
  large M the weight rows stay in L1 and x in L2.
- `gemm`: one parallel driver for every type, its rows kernel chosen when it compiles (a
  `qmatmul_codec.Codec`). `prange` over tiles of `tile` weight rows: the type's rows kernel
  dequantizes the tile to float32 (a scratch of `tile * K` floats, sized by the caller to
  stay in L2; `run` is the rows kernels' run-time trip count, `qmatmul.ROW_RUN`), then
  `outer` multiplies it. F32 needs no decode and runs `outer` on its rows directly.

One threading runtime (numba's) runs every kernel of a step: the earlier tile pool of Python
threads calling single-threaded BLAS left numba's OpenMP workers spinning beside it.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_codec import weight_tile
from vllm_actors.kernels.cpu.qmatmul_prims import stack_f32

PANEL = 16


@kernel
def pack_panels(x, xp):  # type: ignore[no-untyped-def]
    """x float32 [M, K] -> xp [ceil(M / 16), K, 16], rows past M zero."""
    m, k = x.shape
    for t in range(xp.shape[0]):
        for kk in range(k):
            for j in range(16):
                r = 16 * t + j
                xp[t, kk, j] = x[r, kk] if r < m else np.float32(0)


@kernel
def outer(wt, xp, out, r0, chunk):  # type: ignore[no-untyped-def]
    """out[:, r0:r0 + R] = x @ wt.T for a float32 tile wt [R, K]; x as panels xp."""
    rows, k = wt.shape
    m = out.shape[0]
    panels = xp.shape[0]
    for p0 in range(0, panels, chunk):
        p1 = min(panels, p0 + chunk)
        for g in range((rows + 3) // 4):
            a = 4 * g
            i1 = min(a + 1, rows - 1)     # a short last group repeats its last row
            i2 = min(a + 2, rows - 1)
            i3 = min(a + 3, rows - 1)
            for t in range(p0, p1):
                acc = stack_f32(64)
                for i in range(64):
                    acc[i] = 0
                for kk in range(k):
                    w0 = wt[a, kk]
                    w1 = wt[i1, kk]
                    w2 = wt[i2, kk]
                    w3 = wt[i3, kk]
                    for j in range(16):
                        xv = xp[t, kk, j]
                        acc[j] += w0 * xv
                        acc[16 + j] += w1 * xv
                        acc[32 + j] += w2 * xv
                        acc[48 + j] += w3 * xv
                mc = min(16, m - 16 * t)
                for r in range(min(4, rows - a)):
                    for j in range(mc):
                        out[16 * t + j, r0 + a + r] = acc[16 * r + j]


@kernel(parallel=True)
def gemm(codec, planes, lut, xp, out, tile, chunk, run):  # type: ignore[no-untyped-def]
    """out = x @ W.T (x as panels xp), W's planes as the codec's rows kernel takes them:
    `prange` over tiles of `tile` weight rows, each decoded to float32
    (`qmatmul_codec.weight_tile`) and multiplied by `outer`."""
    n = out.shape[1]
    for t in prange((n + tile - 1) // tile):
        a = t * tile
        outer(weight_tile(codec, planes, lut, a, min(n, a + tile), xp.shape[1], run), xp, out,
              a, chunk)
