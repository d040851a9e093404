"""GEMV and row kernels for weights kept as floats: F32 (float32 `[N, K]`), F16 and BF16
(their uint16 bits `[N, K]`, converted in registers: F16C's `vcvtph2ps` where the CPU has it,
a shift for BF16). Same signatures as `qmatmul_legacy`; K may be any size here.

The dot products are plain loops over K, which LLVM vectorizes as reductions (the lane
scheme of the quantized kernels came out scalar here). The rows `dist` ahead are prefetched
whole at the start of each pair: float rows are long enough (>= 2 bytes per weight) for a
burst of prefetches per pair, and short-row matrices (K = 576) still need them.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_prims import (
    bf16_to_float, half_to_float, limit_threads, prefetch, restore_threads)


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
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * k
        p1 = min(r0 + dist + 1, n - 1) * k
        for c in range(0, k, 32):
            prefetch(w, p0 + c)
            prefetch(w, p1 + c)
        for m in range(x.shape[0]):
            a0 = np.float32(0)
            a1 = np.float32(0)
            if bf16:
                for j in range(k):
                    a0 += bf16_to_float(w[r0, j]) * x[m, j]
                    a1 += bf16_to_float(w[r1, j]) * x[m, j]
            else:
                for j in range(k):
                    a0 += half_to_float(w[r0, j]) * x[m, j]
                    a1 += half_to_float(w[r1, j]) * x[m, j]
            out[m, r0] = a0
            if r0 + 1 < n:
                out[m, r0 + 1] = a1
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
