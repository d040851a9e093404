"""GEMV and row kernels for Q4_K/Q5_K (one kernel; Q4_K passes an empty `qh`) and Q6_K, over
the planes of `qmatmul_layout`. Superblocks of 256 weights (`quant.QK_K`), signatures and
structure as in `qmatmul_legacy`: two weight rows per prange iteration, 8 lane partial sums per
row on the stack, the loop around the lane loop holds the prefetch (which also keeps LLVM from
vectorizing across that loop), and mins / the -32 offset go through the run sums xs.

Q4_K/Q5_K: sub-block s (32 weights) of a superblock is `d * sc[s] * q - dmin * mn[s]`, q the
low (s even) or high (s odd) nibbles of bytes 32*(s//2)..+32, plus bit s of qh[l] for Q5_K.
Q6_K: weight 128h + 32k + l is `d * scales[8h + 2k + l//16] * (q - 32)`, q = nibble k//2 of
ql[64h + 32(k%2) + l] | ((qh[32h + l] >> 2k) & 3) << 4.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_prims import (
    SUM_RUN, block_sums, limit_threads, prefetch, restore_threads, shr32, stack_f32)


@kernel(parallel=True)
def gemv_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
    prev = limit_threads(threads)
    n, rb = qs.shape
    xs = np.empty((x.shape[0], x.shape[1] // SUM_RUN), dtype=np.float32)
    block_sums(x, xs)
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * rb
        p1 = min(r0 + dist + 1, n - 1) * rb
        acc = stack_f32(16)
        for m in range(x.shape[0]):
            for i in range(16):
                acc[i] = 0
            off0 = np.float32(0)
            off1 = np.float32(0)
            for sb in range(rb // 128):
                d0 = lut[d[r0, sb]]
                d1 = lut[d[r1, sb]]
                e0 = lut[dmin[r0, sb]]
                e1 = lut[dmin[r1, sb]]
                for s in range(8):
                    prefetch(qs, p0 + 128 * sb + 16 * s)
                    prefetch(qs, p1 + 128 * sb + 16 * s)
                    j = 8 * sb + s
                    xsum = xs[m, 2 * j] + xs[m, 2 * j + 1]
                    off0 += e0 * np.float32(mn[r0, j]) * xsum
                    off1 += e1 * np.float32(mn[r1, j]) * xsum
                    a0 = d0 * np.float32(sc[r0, j])
                    a1 = d1 * np.float32(sc[r1, j])
                    o = 128 * sb + 32 * (s >> 1)
                    sh = 4 * (s & 1)
                    xo = 32 * j
                    for i in range(8):
                        x0 = x[m, xo + i]
                        x1 = x[m, xo + 8 + i]
                        x2 = x[m, xo + 16 + i]
                        x3 = x[m, xo + 24 + i]
                        q0 = (shr32(qs[r0, o + i], sh)) & 15
                        q1 = (shr32(qs[r0, o + 8 + i], sh)) & 15
                        q2 = (shr32(qs[r0, o + 16 + i], sh)) & 15
                        q3 = (shr32(qs[r0, o + 24 + i], sh)) & 15
                        u0 = (shr32(qs[r1, o + i], sh)) & 15
                        u1 = (shr32(qs[r1, o + 8 + i], sh)) & 15
                        u2 = (shr32(qs[r1, o + 16 + i], sh)) & 15
                        u3 = (shr32(qs[r1, o + 24 + i], sh)) & 15
                        acc[i] += a0 * (np.float32(q0) * x0 + np.float32(q1) * x1
                                        + np.float32(q2) * x2 + np.float32(q3) * x3)
                        acc[8 + i] += a1 * (np.float32(u0) * x0 + np.float32(u1) * x1
                                            + np.float32(u2) * x2 + np.float32(u3) * x3)
            out[m, r0] = acc[0:8].sum() - off0
            if r0 + 1 < n:
                out[m, r0 + 1] = acc[8:16].sum() - off1
    restore_threads(prev)


@kernel(parallel=True)
def gemv_q5_k(qh, qs, sc, mn, d, dmin, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
    prev = limit_threads(threads)
    n, rb = qs.shape
    xs = np.empty((x.shape[0], x.shape[1] // SUM_RUN), dtype=np.float32)
    block_sums(x, xs)
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * rb
        p1 = min(r0 + dist + 1, n - 1) * rb
        acc = stack_f32(16)
        for m in range(x.shape[0]):
            for i in range(16):
                acc[i] = 0
            off0 = np.float32(0)
            off1 = np.float32(0)
            for sb in range(rb // 128):
                d0 = lut[d[r0, sb]]
                d1 = lut[d[r1, sb]]
                e0 = lut[dmin[r0, sb]]
                e1 = lut[dmin[r1, sb]]
                for s in range(8):
                    prefetch(qs, p0 + 128 * sb + 16 * s)
                    prefetch(qs, p1 + 128 * sb + 16 * s)
                    j = 8 * sb + s
                    xsum = xs[m, 2 * j] + xs[m, 2 * j + 1]
                    off0 += e0 * np.float32(mn[r0, j]) * xsum
                    off1 += e1 * np.float32(mn[r1, j]) * xsum
                    a0 = d0 * np.float32(sc[r0, j])
                    a1 = d1 * np.float32(sc[r1, j])
                    o = 128 * sb + 32 * (s >> 1)
                    sh = 4 * (s & 1)
                    xo = 32 * j
                    hb = 32 * sb
                    for i in range(8):
                        x0 = x[m, xo + i]
                        x1 = x[m, xo + 8 + i]
                        x2 = x[m, xo + 16 + i]
                        x3 = x[m, xo + 24 + i]
                        q0 = (shr32(qs[r0, o + i], sh)) & 15
                        q1 = (shr32(qs[r0, o + 8 + i], sh)) & 15
                        q2 = (shr32(qs[r0, o + 16 + i], sh)) & 15
                        q3 = (shr32(qs[r0, o + 24 + i], sh)) & 15
                        u0 = (shr32(qs[r1, o + i], sh)) & 15
                        u1 = (shr32(qs[r1, o + 8 + i], sh)) & 15
                        u2 = (shr32(qs[r1, o + 16 + i], sh)) & 15
                        u3 = (shr32(qs[r1, o + 24 + i], sh)) & 15
                        q0 |= ((shr32(qh[r0, hb + i], s)) & 1) << 4
                        q1 |= ((shr32(qh[r0, hb + 8 + i], s)) & 1) << 4
                        q2 |= ((shr32(qh[r0, hb + 16 + i], s)) & 1) << 4
                        q3 |= ((shr32(qh[r0, hb + 24 + i], s)) & 1) << 4
                        u0 |= ((shr32(qh[r1, hb + i], s)) & 1) << 4
                        u1 |= ((shr32(qh[r1, hb + 8 + i], s)) & 1) << 4
                        u2 |= ((shr32(qh[r1, hb + 16 + i], s)) & 1) << 4
                        u3 |= ((shr32(qh[r1, hb + 24 + i], s)) & 1) << 4
                        acc[i] += a0 * (np.float32(q0) * x0 + np.float32(q1) * x1
                                        + np.float32(q2) * x2 + np.float32(q3) * x3)
                        acc[8 + i] += a1 * (np.float32(u0) * x0 + np.float32(u1) * x1
                                            + np.float32(u2) * x2 + np.float32(u3) * x3)
            out[m, r0] = acc[0:8].sum() - off0
            if r0 + 1 < n:
                out[m, r0 + 1] = acc[8:16].sum() - off1
    restore_threads(prev)


@kernel
def rows_q45_k(qh, qs, sc, mn, d, dmin, lut, ids, out, run):  # type: ignore[no-untyped-def]
    """Q4_K, or Q5_K when `qh` is not empty."""
    five = qh.shape[0] > 0
    for t in range(ids.size):
        r = ids[t]
        for sb in range(qs.shape[1] // 128):
            dv = lut[d[r, sb]]
            ev = lut[dmin[r, sb]]
            for s in range(8):
                scale = dv * np.float32(sc[r, 8 * sb + s])
                low = ev * np.float32(mn[r, 8 * sb + s])
                sh = 4 * (s & 1)
                o = 128 * sb + 32 * (s >> 1)
                w = 256 * sb + 32 * s
                if five:
                    for j in range(run):
                        q = ((shr32(qs[r, o + j], sh)) & 15) | (
                            ((shr32(qh[r, 32 * sb + j], s)) & 1) << 4)
                        out[t, w + j] = scale * np.float32(q) - low
                else:
                    for j in range(run):
                        q = (shr32(qs[r, o + j], sh)) & 15
                        out[t, w + j] = scale * np.float32(q) - low


@kernel(parallel=True)
def gemv_q6_k(ql, qh, scales, d, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
    prev = limit_threads(threads)
    n, rb = ql.shape
    xs = np.empty((x.shape[0], x.shape[1] // SUM_RUN), dtype=np.float32)
    block_sums(x, xs)
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * rb
        p1 = min(r0 + dist + 1, n - 1) * rb
        acc = stack_f32(16)
        for m in range(x.shape[0]):
            for i in range(16):
                acc[i] = 0
            off0 = np.float32(0)
            off1 = np.float32(0)
            for sb in range(rb // 128):
                d0 = lut[d[r0, sb]]
                d1 = lut[d[r1, sb]]
                for hk in range(8):
                    h = hk >> 2
                    k = hk & 3
                    o = 128 * sb + 64 * h + 32 * (k & 1)
                    prefetch(ql, p0 + 128 * sb + 16 * hk)
                    prefetch(ql, p1 + 128 * sb + 16 * hk)
                    s = 16 * sb + 8 * h + 2 * k
                    xo = 256 * sb + 128 * h + 32 * k
                    a0 = d0 * np.float32(scales[r0, s])
                    b0 = d0 * np.float32(scales[r0, s + 1])
                    a1 = d1 * np.float32(scales[r1, s])
                    b1 = d1 * np.float32(scales[r1, s + 1])
                    off0 += a0 * xs[m, s] + b0 * xs[m, s + 1]
                    off1 += a1 * xs[m, s] + b1 * xs[m, s + 1]
                    ls = 4 * (k >> 1)
                    hs = 2 * k
                    hb = 64 * sb + 32 * h
                    for i in range(8):
                        x0 = x[m, xo + i]
                        x1 = x[m, xo + 8 + i]
                        x2 = x[m, xo + 16 + i]
                        x3 = x[m, xo + 24 + i]
                        q0 = ((shr32(ql[r0, o + i], ls)) & 15) | (((shr32(qh[r0, hb + i], hs)) & 3) << 4)
                        q1 = ((shr32(ql[r0, o + 8 + i], ls)) & 15) | (((shr32(qh[r0, hb + 8 + i], hs)) & 3) << 4)
                        q2 = ((shr32(ql[r0, o + 16 + i], ls)) & 15) | (((shr32(qh[r0, hb + 16 + i], hs)) & 3) << 4)
                        q3 = ((shr32(ql[r0, o + 24 + i], ls)) & 15) | (((shr32(qh[r0, hb + 24 + i], hs)) & 3) << 4)
                        acc[i] += (a0 * (np.float32(q0) * x0 + np.float32(q1) * x1)
                                   + b0 * (np.float32(q2) * x2 + np.float32(q3) * x3))
                        q0 = ((shr32(ql[r1, o + i], ls)) & 15) | (((shr32(qh[r1, hb + i], hs)) & 3) << 4)
                        q1 = ((shr32(ql[r1, o + 8 + i], ls)) & 15) | (((shr32(qh[r1, hb + 8 + i], hs)) & 3) << 4)
                        q2 = ((shr32(ql[r1, o + 16 + i], ls)) & 15) | (((shr32(qh[r1, hb + 16 + i], hs)) & 3) << 4)
                        q3 = ((shr32(ql[r1, o + 24 + i], ls)) & 15) | (((shr32(qh[r1, hb + 24 + i], hs)) & 3) << 4)
                        acc[8 + i] += (a1 * (np.float32(q0) * x0 + np.float32(q1) * x1)
                                       + b1 * (np.float32(q2) * x2 + np.float32(q3) * x3))
            out[m, r0] = acc[0:8].sum() - np.float32(32) * off0
            if r0 + 1 < n:
                out[m, r0 + 1] = acc[8:16].sum() - np.float32(32) * off1
    restore_threads(prev)


@kernel
def rows_q6_k(ql, qh, scales, d, lut, ids, out, run):  # type: ignore[no-untyped-def]
    half = run // 2
    for t in range(ids.size):
        r = ids[t]
        for sb in range(ql.shape[1] // 128):
            dv = lut[d[r, sb]]
            for hk in range(8):
                h = hk >> 2
                k = hk & 3
                o = 128 * sb + 64 * h + 32 * (k & 1)
                hb = 64 * sb + 32 * h
                w = 256 * sb + 128 * h + 32 * k
                ls = 4 * (k >> 1)
                s = 16 * sb + 8 * h + 2 * k
                a = dv * np.float32(scales[r, s])
                b = dv * np.float32(scales[r, s + 1])
                for j in range(half):
                    q = (((shr32(ql[r, o + j], ls)) & 15)
                         | (((shr32(qh[r, hb + j], 2 * k)) & 3) << 4))
                    p = (((shr32(ql[r, o + 16 + j], ls)) & 15)
                         | (((shr32(qh[r, hb + 16 + j], 2 * k)) & 3) << 4))
                    out[t, w + j] = a * np.float32(q - 32)
                    out[t, w + 16 + j] = b * np.float32(p - 32)
