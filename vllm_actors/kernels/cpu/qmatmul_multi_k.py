"""Multi-row GEMV (`qmatmul_multi`: scheme, signatures) for Q4_K and Q6_K, over the planes of
`qmatmul_layout`. A 32-column block b of a row is one sub-block of superblock b // 8:

Q4_K: w = d * sc[b] * q - dmin * mn[b], q the low (b even) or high (b odd) nibbles of bytes
128 (b // 8) + 32 ((b % 8) // 2) .. +32 of qs.
Q6_K: with h = (b // 4) % 2 and k = b % 4, weight i of the block is
d * scales[16 (b // 8) + 8 h + 2 k + i // 16] * (q - 32), q = nibble k // 2 of
ql[128 (b // 8) + 64 h + 32 (k % 2) + i] | ((qh[64 (b // 8) + 32 h + i] >> 2k) & 3) << 4.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_multi import (
    aligned,
    finish,
    group_rows,
    slice_blocks,
    start,
)
from vllm_actors.kernels.cpu.qmatmul_prims import (
    limit_threads,
    prefetch,
    restore_threads,
    stack_f32,
)
from vllm_actors.kernels.cpu.qmatmul_simd import vnib, vq6, vrows

# -- Q4_K -----------------------------------------------------------------------------------


@kernel(inline=True)
def _pass_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, b0, b1, g, r):  # type: ignore[no-untyped-def]
    n, rb = qs.shape
    acc = stack_f32(80)
    w = stack_f32(64)
    for r0 in range(lo, hi, r):
        start(acc, g, r)
        for b in range(b0, b1):
            sb = b >> 3
            sh = 4 * (b & 1)
            o = 128 * sb + 32 * ((b & 7) >> 1)
            for k in range(r):
                row = min(r0 + k, n - 1)
                q = row * rb + o
                prefetch(qs, min(row + dist, n - 1) * rb + o)
                scale = lut[d[row, sb]] * np.float32(sc[row, b])
                low = -(lut[dmin[row, sb]] * np.float32(mn[row, b]))
                vnib(w, 32 * k, qs, q, sh, scale, low)
                vnib(w, 32 * k + 8, qs, q + 8, sh, scale, low)
                vnib(w, 32 * k + 16, qs, q + 16, sh, scale, low)
                vnib(w, 32 * k + 24, qs, q + 24, sh, scale, low)
            vrows(acc, w, x, m0 * x.shape[1] + 32 * b, g, r)
        finish(acc, out, r0, m0, b0 == 0, g, r)


@kernel
def _span_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, mt, b0, b1):  # type: ignore[no-untyped-def]
    if mt == 1:
        _pass_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, b0, b1, 1, 2)
    elif mt == 2:
        _pass_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, b0, b1, 2, 2)
    elif mt == 3:
        _pass_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, b0, b1, 3, 2)
    elif mt == 4:
        _pass_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, b0, b1, 4, 2)
    elif mt == 5:
        _pass_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, b0, b1, 5, 2)
    elif mt == 6:
        _pass_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, b0, b1, 6, 1)
    elif mt == 7:
        _pass_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, b0, b1, 7, 1)
    elif mt == 8:
        _pass_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, b0, b1, 8, 1)
    else:
        _pass_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, b0, b1, 9, 1)


@kernel(parallel=True)
def mgemv_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, chunk, threads):  # type: ignore[no-untyped-def]
    prev = limit_threads(threads)
    x = aligned(x)
    n = qs.shape[0]
    nm = x.shape[0]
    blocks = x.shape[1] // 32
    per = group_rows(nm)
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(n, lo + chunk)
        for m0 in range(0, nm, per):
            mt = min(per, nm - m0)
            kb = slice_blocks(blocks, mt)
            for b0 in range(0, blocks, kb):
                _span_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, lo, hi, m0, mt, b0,
                           min(blocks, b0 + kb))
    restore_threads(prev)


# -- Q6_K -----------------------------------------------------------------------------------

@kernel(inline=True)
def _pass_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, b0, b1, g, r):  # type: ignore[no-untyped-def]
    n, rl = ql.shape
    rh = qh.shape[1]
    acc = stack_f32(80)
    w = stack_f32(64)
    for r0 in range(lo, hi, r):
        start(acc, g, r)
        for b in range(b0, b1):
            sb = b >> 3
            h = (b >> 2) & 1
            kq = b & 3
            o = 128 * sb + 64 * h + 32 * (kq & 1)
            hb = 64 * sb + 32 * h
            ls = 4 * (kq >> 1)
            s = 16 * sb + 8 * h + 2 * kq
            for k in range(r):
                row = min(r0 + k, n - 1)
                lq = row * rl + o
                hq = row * rh + hb
                prefetch(ql, min(row + dist, n - 1) * rl + o)
                dv = lut[d[row, sb]]
                sa = dv * np.float32(scales[row, s])
                sz = dv * np.float32(scales[row, s + 1])
                vq6(w, 32 * k, ql, lq, ls, qh, hq, 2 * kq, sa)
                vq6(w, 32 * k + 8, ql, lq + 8, ls, qh, hq + 8, 2 * kq, sa)
                vq6(w, 32 * k + 16, ql, lq + 16, ls, qh, hq + 16, 2 * kq, sz)
                vq6(w, 32 * k + 24, ql, lq + 24, ls, qh, hq + 24, 2 * kq, sz)
            vrows(acc, w, x, m0 * x.shape[1] + 32 * b, g, r)
        finish(acc, out, r0, m0, b0 == 0, g, r)


@kernel
def _span_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, mt, b0, b1):  # type: ignore[no-untyped-def]
    if mt == 1:
        _pass_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, b0, b1, 1, 2)
    elif mt == 2:
        _pass_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, b0, b1, 2, 2)
    elif mt == 3:
        _pass_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, b0, b1, 3, 2)
    elif mt == 4:
        _pass_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, b0, b1, 4, 2)
    elif mt == 5:
        _pass_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, b0, b1, 5, 2)
    elif mt == 6:
        _pass_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, b0, b1, 6, 1)
    elif mt == 7:
        _pass_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, b0, b1, 7, 1)
    elif mt == 8:
        _pass_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, b0, b1, 8, 1)
    else:
        _pass_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, b0, b1, 9, 1)


@kernel(parallel=True)
def mgemv_q6_k(ql, qh, scales, d, lut, x, out, dist, chunk, threads):  # type: ignore[no-untyped-def]
    prev = limit_threads(threads)
    x = aligned(x)
    n = ql.shape[0]
    nm = x.shape[0]
    blocks = x.shape[1] // 32
    per = group_rows(nm)
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(n, lo + chunk)
        for m0 in range(0, nm, per):
            mt = min(per, nm - m0)
            kb = slice_blocks(blocks, mt)
            for b0 in range(0, blocks, kb):
                _span_q6_k(ql, qh, scales, d, lut, x, out, dist, lo, hi, m0, mt, b0,
                           min(blocks, b0 + kb))
    restore_threads(prev)
