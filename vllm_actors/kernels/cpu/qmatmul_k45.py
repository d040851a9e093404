"""GEMV and row kernels for Q4_K, Q5_K (rows: one kernel, Q4_K passing an empty `qh`) and Q6_K
over the planes of `qmatmul_layout`; superblocks of 256 weights (`quant.QK_K`). Signatures
and scheme as in `qmatmul_legacy` (two weight rows per prange iteration, 8 lane partial sums
per row on the stack). Per superblock the sub-block scales of both rows go into a stack table
first, in a loop whose trip count LLVM cannot see (so it is vectorized, not unrolled into
scalar code); mins and the -32 offset of Q6_K go through x's run sums. Each quant byte is read
once for all the weights it holds; the loop around the lane loop holds the prefetch (which
also keeps LLVM from vectorizing across that loop).

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
    SUM_RUN,
    block_sums,
    limit_threads,
    prefetch,
    restore_threads,
    shl32,
    shr32,
    stack_f32,
)


@kernel(parallel=True)
def gemv_q4_k(qs, sc, mn, d, dmin, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
    prev = limit_threads(threads)
    n, rb = qs.shape
    xs = np.empty((x.shape[0], x.shape[1] // SUM_RUN), dtype=np.float32)
    block_sums(x, xs)
    subs = sc.shape[1] // max(1, rb // 128)     # 8; opaque to LLVM (see gemv_q6_k)
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * rb
        p1 = min(r0 + dist + 1, n - 1) * rb
        acc = stack_f32(16)
        scl = stack_f32(16)         # d * sc of the superblock, both rows
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
                for s in range(subs):
                    j = 8 * sb + s
                    scl[s] = d0 * np.float32(sc[r0, j])
                    scl[8 + s] = d1 * np.float32(sc[r1, j])
                    xsum = xs[m, 2 * j] + xs[m, 2 * j + 1]
                    off0 += e0 * np.float32(mn[r0, j]) * xsum
                    off1 += e1 * np.float32(mn[r1, j]) * xsum
                for gg in range(4):      # 32 bytes: sub-blocks 2gg (low nibbles), 2gg + 1
                    o = 128 * sb + 32 * gg
                    prefetch(qs, p0 + o)
                    prefetch(qs, p1 + o)
                    a0 = scl[2 * gg]
                    b0 = scl[2 * gg + 1]
                    a1 = scl[8 + 2 * gg]
                    b1 = scl[9 + 2 * gg]
                    xo = 256 * sb + 64 * gg
                    for i in range(8):
                        q0 = np.int32(qs[r0, o + i])
                        q1 = np.int32(qs[r0, o + 8 + i])
                        q2 = np.int32(qs[r0, o + 16 + i])
                        q3 = np.int32(qs[r0, o + 24 + i])
                        u0 = np.int32(qs[r1, o + i])
                        u1 = np.int32(qs[r1, o + 8 + i])
                        u2 = np.int32(qs[r1, o + 16 + i])
                        u3 = np.int32(qs[r1, o + 24 + i])
                        x0 = x[m, xo + i]
                        x1 = x[m, xo + 8 + i]
                        x2 = x[m, xo + 16 + i]
                        x3 = x[m, xo + 24 + i]
                        acc[i] += a0 * (np.float32(q0 & 15) * x0
                                        + np.float32(q1 & 15) * x1
                                        + np.float32(q2 & 15) * x2
                                        + np.float32(q3 & 15) * x3)
                        acc[8 + i] += a1 * (np.float32(u0 & 15) * x0
                                            + np.float32(u1 & 15) * x1
                                            + np.float32(u2 & 15) * x2
                                            + np.float32(u3 & 15) * x3)
                        x0 = x[m, xo + 32 + i]
                        x1 = x[m, xo + 40 + i]
                        x2 = x[m, xo + 48 + i]
                        x3 = x[m, xo + 56 + i]
                        acc[i] += b0 * (np.float32(shr32(q0, 4)) * x0
                                        + np.float32(shr32(q1, 4)) * x1
                                        + np.float32(shr32(q2, 4)) * x2
                                        + np.float32(shr32(q3, 4)) * x3)
                        acc[8 + i] += b1 * (np.float32(shr32(u0, 4)) * x0
                                            + np.float32(shr32(u1, 4)) * x1
                                            + np.float32(shr32(u2, 4)) * x2
                                            + np.float32(shr32(u3, 4)) * x3)
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
    subs = sc.shape[1] // max(1, rb // 128)     # 8; opaque to LLVM (see gemv_q6_k)
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * rb
        p1 = min(r0 + dist + 1, n - 1) * rb
        acc = stack_f32(16)
        scl = stack_f32(16)         # d * sc of the superblock, both rows
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
                for s in range(subs):
                    j = 8 * sb + s
                    scl[s] = d0 * np.float32(sc[r0, j])
                    scl[8 + s] = d1 * np.float32(sc[r1, j])
                    xsum = xs[m, 2 * j] + xs[m, 2 * j + 1]
                    off0 += e0 * np.float32(mn[r0, j]) * xsum
                    off1 += e1 * np.float32(mn[r1, j]) * xsum
                for gg in range(4):      # 32 bytes: sub-blocks 2gg (low nibbles), 2gg + 1
                    o = 128 * sb + 32 * gg
                    prefetch(qs, p0 + o)
                    prefetch(qs, p1 + o)
                    a0 = scl[2 * gg]
                    b0 = scl[2 * gg + 1]
                    a1 = scl[8 + 2 * gg]
                    b1 = scl[9 + 2 * gg]
                    xo = 256 * sb + 64 * gg
                    hb = 32 * sb
                    for i in range(8):
                        q0 = np.int32(qs[r0, o + i])
                        q1 = np.int32(qs[r0, o + 8 + i])
                        q2 = np.int32(qs[r0, o + 16 + i])
                        q3 = np.int32(qs[r0, o + 24 + i])
                        u0 = np.int32(qs[r1, o + i])
                        u1 = np.int32(qs[r1, o + 8 + i])
                        u2 = np.int32(qs[r1, o + 16 + i])
                        u3 = np.int32(qs[r1, o + 24 + i])
                        h0 = shl32(shr32(qh[r0, hb + i], 2 * gg), 4)
                        h1 = shl32(shr32(qh[r0, hb + 8 + i], 2 * gg), 4)
                        h2 = shl32(shr32(qh[r0, hb + 16 + i], 2 * gg), 4)
                        h3 = shl32(shr32(qh[r0, hb + 24 + i], 2 * gg), 4)
                        v0 = shl32(shr32(qh[r1, hb + i], 2 * gg), 4)
                        v1 = shl32(shr32(qh[r1, hb + 8 + i], 2 * gg), 4)
                        v2 = shl32(shr32(qh[r1, hb + 16 + i], 2 * gg), 4)
                        v3 = shl32(shr32(qh[r1, hb + 24 + i], 2 * gg), 4)
                        x0 = x[m, xo + i]
                        x1 = x[m, xo + 8 + i]
                        x2 = x[m, xo + 16 + i]
                        x3 = x[m, xo + 24 + i]
                        acc[i] += a0 * (np.float32((q0 & 15) | (h0 & 16)) * x0
                                        + np.float32((q1 & 15) | (h1 & 16)) * x1
                                        + np.float32((q2 & 15) | (h2 & 16)) * x2
                                        + np.float32((q3 & 15) | (h3 & 16)) * x3)
                        acc[8 + i] += a1 * (np.float32((u0 & 15) | (v0 & 16)) * x0
                                            + np.float32((u1 & 15) | (v1 & 16)) * x1
                                            + np.float32((u2 & 15) | (v2 & 16)) * x2
                                            + np.float32((u3 & 15) | (v3 & 16)) * x3)
                        x0 = x[m, xo + 32 + i]
                        x1 = x[m, xo + 40 + i]
                        x2 = x[m, xo + 48 + i]
                        x3 = x[m, xo + 56 + i]
                        acc[i] += b0 * (np.float32(shr32(q0, 4) | shr32(h0 & 32, 1)) * x0
                                        + np.float32(shr32(q1, 4) | shr32(h1 & 32, 1)) * x1
                                        + np.float32(shr32(q2, 4) | shr32(h2 & 32, 1)) * x2
                                        + np.float32(shr32(q3, 4) | shr32(h3 & 32, 1)) * x3)
                        acc[8 + i] += b1 * (np.float32(shr32(u0, 4) | shr32(v0 & 32, 1)) * x0
                                            + np.float32(shr32(u1, 4) | shr32(v1 & 32, 1)) * x1
                                            + np.float32(shr32(u2, 4) | shr32(v2 & 32, 1)) * x2
                                            + np.float32(shr32(u3, 4) | shr32(v3 & 32, 1)) * x3)
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
    """Per pass, lane i of chunk c of half h reads ql[64h + 8c + i], ql[64h + 32 + 8c + i] and
    qh[32h + 8c + i] once and gets the weights of all four quarters from them."""
    prev = limit_threads(threads)
    n, rb = ql.shape
    xs = np.empty((x.shape[0], x.shape[1] // SUM_RUN), dtype=np.float32)
    block_sums(x, xs)
    # 16, but not a constant to LLVM: that loop then gets vectorized instead of unrolled
    # into scalar code
    subs = scales.shape[1] // max(1, rb // 128)
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * rb
        p1 = min(r0 + dist + 1, n - 1) * rb
        acc = stack_f32(16)
        sc = stack_f32(32)          # d * scales of the superblock, both rows
        for m in range(x.shape[0]):
            for i in range(16):
                acc[i] = 0
            off0 = np.float32(0)
            off1 = np.float32(0)
            for sb in range(rb // 128):
                d0 = lut[d[r0, sb]]
                d1 = lut[d[r1, sb]]
                for s in range(subs):
                    sc[s] = d0 * np.float32(scales[r0, 16 * sb + s])
                    sc[16 + s] = d1 * np.float32(scales[r1, 16 * sb + s])
                    off0 += sc[s] * xs[m, 16 * sb + s]
                    off1 += sc[16 + s] * xs[m, 16 * sb + s]
                for hc in range(8):
                    h = hc >> 2
                    c = hc & 3
                    prefetch(ql, p0 + 128 * sb + 16 * hc)
                    prefetch(ql, p1 + 128 * sb + 16 * hc)
                    lo = 128 * sb + 64 * h + 8 * c
                    hb = 64 * sb + 32 * h + 8 * c
                    xo = 256 * sb + 128 * h + 8 * c
                    t = 8 * h + (c >> 1)
                    for i in range(8):
                        x0 = x[m, xo + i]
                        x1 = x[m, xo + 32 + i]
                        x2 = x[m, xo + 64 + i]
                        x3 = x[m, xo + 96 + i]
                        qa = ql[r0, lo + i]
                        qb = ql[r0, lo + 32 + i]
                        qq = qh[r0, hb + i]
                        acc[i] += (sc[t] * np.float32((qa & 15) | shl32(qq & 3, 4)) * x0
                                   + sc[t + 2] * np.float32((qb & 15) | shl32(qq & 12, 2)) * x1
                                   + sc[t + 4] * np.float32(shr32(qa, 4) | (qq & 48)) * x2
                                   + sc[t + 6] * np.float32(shr32(qb, 4) | shr32(qq & 192, 2)) * x3)
                        qa = ql[r1, lo + i]
                        qb = ql[r1, lo + 32 + i]
                        qq = qh[r1, hb + i]
                        acc[8 + i] += (sc[16 + t] * np.float32((qa & 15) | shl32(qq & 3, 4)) * x0
                                       + sc[18 + t] * np.float32((qb & 15) | shl32(qq & 12, 2)) * x1
                                       + sc[20 + t] * np.float32(shr32(qa, 4) | (qq & 48)) * x2
                                       + sc[22 + t] * np.float32(shr32(qb, 4) | shr32(qq & 192, 2))
                                       * x3)
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
