"""GEMV and row kernels for weights kept as floats: F32 (float32 `[N, K]`), F16 and BF16
(their uint16 bits `[N, K]`, converted in registers: F16C's `vcvtph2ps` where the CPU has it,
a shift for BF16). Same signatures as `qmatmul_legacy`; K may be any size here.

F16/BF16 use the lane scheme of the quantized kernels (8 partial sums per row on the stack,
a prefetch per 64 bytes of row). For F32 LLVM left that scheme scalar, so its dot products
are plain loops over K (vectorized as reductions), with the rows `dist` ahead prefetched whole
at the start of each pair.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_prims import (
    bf16_to_float,
    half_to_float,
    limit_threads,
    prefetch,
    restore_threads,
    stack_f32,
)


@kernel(parallel=True)
def gemv_f32(w, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
    prev = limit_threads(threads)
    n, k = w.shape
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * k
        p1 = min(r0 + dist + 1, n - 1) * k
        for c in range(0, k, 16):
            prefetch(w, p0 + c)
            prefetch(w, p1 + c)
        for m in range(x.shape[0]):
            a0 = np.float32(0)
            a1 = np.float32(0)
            for j in range(k):
                a0 += w[r0, j] * x[m, j]
                a1 += w[r1, j] * x[m, j]
            out[m, r0] = a0
            if r0 + 1 < n:
                out[m, r0 + 1] = a1
    restore_threads(prev)


@kernel(parallel=True)
def gemv_half(w, bf16, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
    """F16 (`bf16` False) or BF16 bits `w`."""
    prev = limit_threads(threads)
    n, k = w.shape
    body = k - k % 32
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * k
        p1 = min(r0 + dist + 1, n - 1) * k
        acc = stack_f32(16)
        for m in range(x.shape[0]):
            for i in range(16):
                acc[i] = 0
            for cc in range(body // 32):
                c = 32 * cc
                prefetch(w, p0 + c)
                prefetch(w, p1 + c)
                if bf16:
                    for i in range(8):
                        xa = x[m, c + i]
                        xb = x[m, c + 8 + i]
                        xc = x[m, c + 16 + i]
                        xd = x[m, c + 24 + i]
                        acc[i] += (bf16_to_float(w[r0, c + i]) * xa
                                   + bf16_to_float(w[r0, c + 8 + i]) * xb
                                   + bf16_to_float(w[r0, c + 16 + i]) * xc
                                   + bf16_to_float(w[r0, c + 24 + i]) * xd)
                        acc[8 + i] += (bf16_to_float(w[r1, c + i]) * xa
                                       + bf16_to_float(w[r1, c + 8 + i]) * xb
                                       + bf16_to_float(w[r1, c + 16 + i]) * xc
                                       + bf16_to_float(w[r1, c + 24 + i]) * xd)
                else:
                    for i in range(8):
                        xa = x[m, c + i]
                        xb = x[m, c + 8 + i]
                        xc = x[m, c + 16 + i]
                        xd = x[m, c + 24 + i]
                        acc[i] += (half_to_float(w[r0, c + i]) * xa
                                   + half_to_float(w[r0, c + 8 + i]) * xb
                                   + half_to_float(w[r0, c + 16 + i]) * xc
                                   + half_to_float(w[r0, c + 24 + i]) * xd)
                        acc[8 + i] += (half_to_float(w[r1, c + i]) * xa
                                       + half_to_float(w[r1, c + 8 + i]) * xb
                                       + half_to_float(w[r1, c + 16 + i]) * xc
                                       + half_to_float(w[r1, c + 24 + i]) * xd)
            t0 = acc[0:8].sum()
            t1 = acc[8:16].sum()
            for j in range(body, k):
                if bf16:
                    t0 += bf16_to_float(w[r0, j]) * x[m, j]
                    t1 += bf16_to_float(w[r1, j]) * x[m, j]
                else:
                    t0 += half_to_float(w[r0, j]) * x[m, j]
                    t1 += half_to_float(w[r1, j]) * x[m, j]
            out[m, r0] = t0
            if r0 + 1 < n:
                out[m, r0 + 1] = t1
    restore_threads(prev)


@kernel
def rows_f32(w, lut, ids, out, run):  # type: ignore[no-untyped-def]
    for t in range(ids.size):
        r = ids[t]
        for j in range(w.shape[1]):
            out[t, j] = w[r, j]


@kernel
def rows_half(w, bf16, lut, ids, out, run):  # type: ignore[no-untyped-def]
    k = w.shape[1]
    for t in range(ids.size):
        r = ids[t]
        if bf16:
            for j in range(k):
                out[t, j] = bf16_to_float(w[r, j])
        else:
            for j in range(k):
                out[t, j] = half_to_float(w[r, j])
