"""GEMV and row kernels for Q2_K and Q3_K, over the planes of `qmatmul_layout`; structure and
signatures as in `qmatmul_k45`.

Both split a 256-weight superblock into 8 runs of 32 (n = run // 4, j = run % 4) and 16
sub-blocks of 16: weight 128n + 32j + l has the 2-bit q = (qs[32n + l] >> 2j) & 3 and
sub-block s = 8n + 2j + l // 16. Q2_K: `d * (scales[s] & 15) * q - dmin * (scales[s] >> 4)`.
Q3_K: `d * scales[s] * (q | hbit << 2) - 4)`, hbit = (hmask[l] >> (4n + j)) & 1, its scales
unpacked to int8 at load time.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_prims import (
    SUM_RUN, block_sums, limit_threads, prefetch, restore_threads, shr32, stack_f32)


@kernel(parallel=True)
def gemv_q2_k(qs, scales, d, dmin, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
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
            for sb in range(rb // 64):
                d0 = lut[d[r0, sb]]
                d1 = lut[d[r1, sb]]
                e0 = lut[dmin[r0, sb]]
                e1 = lut[dmin[r1, sb]]
                for nj in range(8):
                    prefetch(qs, p0 + 64 * sb + 8 * nj)
                    prefetch(qs, p1 + 64 * sb + 8 * nj)
                    s = 16 * sb + 2 * nj
                    v0 = np.int32(scales[r0, s])
                    w0 = np.int32(scales[r0, s + 1])
                    v1 = np.int32(scales[r1, s])
                    w1 = np.int32(scales[r1, s + 1])
                    off0 += e0 * (np.float32(v0 >> 4) * xs[m, s] + np.float32(w0 >> 4) * xs[m, s + 1])
                    off1 += e1 * (np.float32(v1 >> 4) * xs[m, s] + np.float32(w1 >> 4) * xs[m, s + 1])
                    a0 = d0 * np.float32(v0 & 15)
                    b0 = d0 * np.float32(w0 & 15)
                    a1 = d1 * np.float32(v1 & 15)
                    b1 = d1 * np.float32(w1 & 15)
                    o = 64 * sb + 32 * (nj >> 2)
                    sh = 2 * (nj & 3)
                    xo = 16 * s
                    for i in range(8):
                        x0 = x[m, xo + i]
                        x1 = x[m, xo + 8 + i]
                        x2 = x[m, xo + 16 + i]
                        x3 = x[m, xo + 24 + i]
                        acc[i] += (a0 * (np.float32((shr32(qs[r0, o + i], sh)) & 3) * x0
                                         + np.float32((shr32(qs[r0, o + 8 + i], sh)) & 3) * x1)
                                   + b0 * (np.float32((shr32(qs[r0, o + 16 + i], sh)) & 3) * x2
                                           + np.float32((shr32(qs[r0, o + 24 + i], sh)) & 3) * x3))
                        acc[8 + i] += (a1 * (np.float32((shr32(qs[r1, o + i], sh)) & 3) * x0
                                             + np.float32((shr32(qs[r1, o + 8 + i], sh)) & 3) * x1)
                                       + b1 * (np.float32((shr32(qs[r1, o + 16 + i], sh)) & 3) * x2
                                               + np.float32((shr32(qs[r1, o + 24 + i], sh)) & 3) * x3))
            out[m, r0] = acc[0:8].sum() - off0
            if r0 + 1 < n:
                out[m, r0 + 1] = acc[8:16].sum() - off1
    restore_threads(prev)


@kernel
def rows_q2_k(qs, scales, d, dmin, lut, ids, out, run):  # type: ignore[no-untyped-def]
    half = run // 2
    for t in range(ids.size):
        r = ids[t]
        for sb in range(qs.shape[1] // 64):
            dv = lut[d[r, sb]]
            ev = lut[dmin[r, sb]]
            for nj in range(8):
                o = 64 * sb + 32 * (nj >> 2)
                sh = 2 * (nj & 3)
                w = 256 * sb + 32 * nj
                v = np.int32(scales[r, 16 * sb + 2 * nj])
                u = np.int32(scales[r, 16 * sb + 2 * nj + 1])
                a = dv * np.float32(v & 15)
                b = dv * np.float32(u & 15)
                la = ev * np.float32(v >> 4)
                lb = ev * np.float32(u >> 4)
                for j in range(half):
                    q = (shr32(qs[r, o + j], sh)) & 3
                    p = (shr32(qs[r, o + 16 + j], sh)) & 3
                    out[t, w + j] = a * np.float32(q) - la
                    out[t, w + 16 + j] = b * np.float32(p) - lb


@kernel(parallel=True)
def gemv_q3_k(hmask, qs, scales, d, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
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
            for sb in range(rb // 64):
                d0 = lut[d[r0, sb]]
                d1 = lut[d[r1, sb]]
                for nj in range(8):
                    prefetch(qs, p0 + 64 * sb + 8 * nj)
                    prefetch(qs, p1 + 64 * sb + 8 * nj)
                    s = 16 * sb + 2 * nj
                    a0 = d0 * np.float32(scales[r0, s])
                    b0 = d0 * np.float32(scales[r0, s + 1])
                    a1 = d1 * np.float32(scales[r1, s])
                    b1 = d1 * np.float32(scales[r1, s + 1])
                    off0 += a0 * xs[m, s] + b0 * xs[m, s + 1]
                    off1 += a1 * xs[m, s] + b1 * xs[m, s + 1]
                    o = 64 * sb + 32 * (nj >> 2)
                    sh = 2 * (nj & 3)
                    hs = nj    # hmask bit 4n + j
                    hb = 32 * sb
                    xo = 16 * s
                    for i in range(8):
                        x0 = x[m, xo + i]
                        x1 = x[m, xo + 8 + i]
                        x2 = x[m, xo + 16 + i]
                        x3 = x[m, xo + 24 + i]
                        q0 = ((shr32(qs[r0, o + i], sh)) & 3) | (((shr32(hmask[r0, hb + i], hs)) & 1) << 2)
                        q1 = ((shr32(qs[r0, o + 8 + i], sh)) & 3) | (((shr32(hmask[r0, hb + 8 + i], hs)) & 1) << 2)
                        q2 = ((shr32(qs[r0, o + 16 + i], sh)) & 3) | (((shr32(hmask[r0, hb + 16 + i], hs)) & 1) << 2)
                        q3 = ((shr32(qs[r0, o + 24 + i], sh)) & 3) | (((shr32(hmask[r0, hb + 24 + i], hs)) & 1) << 2)
                        acc[i] += (a0 * (np.float32(q0) * x0 + np.float32(q1) * x1)
                                   + b0 * (np.float32(q2) * x2 + np.float32(q3) * x3))
                        q0 = ((shr32(qs[r1, o + i], sh)) & 3) | (((shr32(hmask[r1, hb + i], hs)) & 1) << 2)
                        q1 = ((shr32(qs[r1, o + 8 + i], sh)) & 3) | (((shr32(hmask[r1, hb + 8 + i], hs)) & 1) << 2)
                        q2 = ((shr32(qs[r1, o + 16 + i], sh)) & 3) | (((shr32(hmask[r1, hb + 16 + i], hs)) & 1) << 2)
                        q3 = ((shr32(qs[r1, o + 24 + i], sh)) & 3) | (((shr32(hmask[r1, hb + 24 + i], hs)) & 1) << 2)
                        acc[8 + i] += (a1 * (np.float32(q0) * x0 + np.float32(q1) * x1)
                                       + b1 * (np.float32(q2) * x2 + np.float32(q3) * x3))
            out[m, r0] = acc[0:8].sum() - np.float32(4) * off0
            if r0 + 1 < n:
                out[m, r0 + 1] = acc[8:16].sum() - np.float32(4) * off1
    restore_threads(prev)


@kernel
def rows_q3_k(hmask, qs, scales, d, lut, ids, out, run):  # type: ignore[no-untyped-def]
    half = run // 2
    for t in range(ids.size):
        r = ids[t]
        for sb in range(qs.shape[1] // 64):
            dv = lut[d[r, sb]]
            for nj in range(8):
                o = 64 * sb + 32 * (nj >> 2)
                sh = 2 * (nj & 3)
                hb = 32 * sb
                w = 256 * sb + 32 * nj
                a = dv * np.float32(scales[r, 16 * sb + 2 * nj])
                b = dv * np.float32(scales[r, 16 * sb + 2 * nj + 1])
                for j in range(half):
                    q = (((shr32(qs[r, o + j], sh)) & 3)
                         | (((shr32(hmask[r, hb + j], nj)) & 1) << 2))
                    p = (((shr32(qs[r, o + 16 + j], sh)) & 3)
                         | (((shr32(hmask[r, hb + 16 + j], nj)) & 1) << 2))
                    out[t, w + j] = a * np.float32(q - 4)
                    out[t, w + 16 + j] = b * np.float32(p - 4)
