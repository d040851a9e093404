"""GEMV and row kernels for Q2_K and Q3_K over the planes of `qmatmul_layout`; signatures and
scheme as in `qmatmul_k45`.

Both split a 256-weight superblock into 8 runs of 32 (n = run // 4, j = run % 4) and 16
sub-blocks of 16: weight 128n + 32j + l has the 2-bit q = (qs[32n + l] >> 2j) & 3 and
sub-block s = 8n + 2j + l // 16. Q2_K: `d * (scales[s] & 15) * q - dmin * (scales[s] >> 4)`.
Q3_K: `d * scales[s] * ((q | hbit << 2) - 4)`, hbit = (hmask[l] >> (4n + j)) & 1, its scales
unpacked to int8 at load time. The GEMV kernels take each qs (and hmask) byte once and get
its four weights (shifts 0, 2, 4, 6) from it.
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
def gemv_q2_k(qs, scales, d, dmin, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
    prev = limit_threads(threads)
    n, rb = qs.shape
    xs = np.empty((x.shape[0], x.shape[1] // SUM_RUN), dtype=np.float32)
    block_sums(x, xs)
    subs = scales.shape[1] // max(1, rb // 64)     # 16; opaque to LLVM (see gemv_q6_k)
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * rb
        p1 = min(r0 + dist + 1, n - 1) * rb
        acc = stack_f32(16)
        scl = stack_f32(32)         # the superblock's sub-block scales, both rows
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
                for s in range(subs):
                    v0 = np.int32(scales[r0, 16 * sb + s])
                    v1 = np.int32(scales[r1, 16 * sb + s])
                    scl[s] = d0 * np.float32(v0 & 15)
                    scl[16 + s] = d1 * np.float32(v1 & 15)
                    off0 += e0 * np.float32(shr32(v0, 4)) * xs[m, 16 * sb + s]
                    off1 += e1 * np.float32(shr32(v1, 4)) * xs[m, 16 * sb + s]
                for nc in range(8):      # half nc // 4 of the superblock, bytes 8 * (nc % 4)..
                    prefetch(qs, p0 + 64 * sb + 8 * nc)
                    prefetch(qs, p1 + 64 * sb + 8 * nc)
                    half = nc >> 2
                    c = nc & 3
                    o = 64 * sb + 32 * half + 8 * c
                    t = 8 * half + (c >> 1)         # sub-block of shift 0; shift 2j adds 2j
                    xo = 256 * sb + 128 * half + 8 * c
                    for i in range(8):
                        x0 = x[m, xo + i]
                        x1 = x[m, xo + 32 + i]
                        x2 = x[m, xo + 64 + i]
                        x3 = x[m, xo + 96 + i]
                        q = np.int32(qs[r0, o + i])
                        acc[i] += (scl[t] * np.float32(q & 3) * x0
                                   + scl[t + 2] * np.float32(shr32(q, 2) & 3) * x1
                                   + scl[t + 4] * np.float32(shr32(q, 4) & 3) * x2
                                   + scl[t + 6] * np.float32(shr32(q, 6)) * x3)
                        q = np.int32(qs[r1, o + i])
                        acc[8 + i] += (scl[t + 16] * np.float32(q & 3) * x0
                                       + scl[t + 18] * np.float32(shr32(q, 2) & 3) * x1
                                       + scl[t + 20] * np.float32(shr32(q, 4) & 3) * x2
                                       + scl[t + 22] * np.float32(shr32(q, 6)) * x3)
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
    subs = scales.shape[1] // max(1, rb // 64)     # 16; opaque to LLVM (see gemv_q6_k)
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * rb
        p1 = min(r0 + dist + 1, n - 1) * rb
        acc = stack_f32(16)
        scl = stack_f32(32)         # the superblock's sub-block scales, both rows
        for m in range(x.shape[0]):
            for i in range(16):
                acc[i] = 0
            off0 = np.float32(0)
            off1 = np.float32(0)
            for sb in range(rb // 64):
                d0 = lut[d[r0, sb]]
                d1 = lut[d[r1, sb]]
                for s in range(subs):
                    scl[s] = d0 * np.float32(scales[r0, 16 * sb + s])
                    scl[16 + s] = d1 * np.float32(scales[r1, 16 * sb + s])
                    off0 += scl[s] * xs[m, 16 * sb + s]
                    off1 += scl[16 + s] * xs[m, 16 * sb + s]
                for nc in range(8):      # half nc // 4 of the superblock, bytes 8 * (nc % 4)..
                    prefetch(qs, p0 + 64 * sb + 8 * nc)
                    prefetch(qs, p1 + 64 * sb + 8 * nc)
                    half = nc >> 2
                    c = nc & 3
                    o = 64 * sb + 32 * half + 8 * c
                    t = 8 * half + (c >> 1)         # sub-block of shift 0; shift 2j adds 2j
                    xo = 256 * sb + 128 * half + 8 * c
                    hb = 32 * sb + 8 * c
                    hs = 4 * half
                    for i in range(8):
                        x0 = x[m, xo + i]
                        x1 = x[m, xo + 32 + i]
                        x2 = x[m, xo + 64 + i]
                        x3 = x[m, xo + 96 + i]
                        q = np.int32(qs[r0, o + i])
                        h = shr32(hmask[r0, hb + i], hs)
                        w0 = (q & 3) | shl32(h & 1, 2)
                        w1 = (shr32(q, 2) & 3) | shl32(h & 2, 1)
                        w2 = (shr32(q, 4) & 3) | (h & 4)
                        w3 = shr32(q, 6) | shr32(h & 8, 1)
                        acc[i] += (scl[t] * np.float32(w0) * x0
                                   + scl[t + 2] * np.float32(w1) * x1
                                   + scl[t + 4] * np.float32(w2) * x2
                                   + scl[t + 6] * np.float32(w3) * x3)
                        q = np.int32(qs[r1, o + i])
                        h = shr32(hmask[r1, hb + i], hs)
                        w0 = (q & 3) | shl32(h & 1, 2)
                        w1 = (shr32(q, 2) & 3) | shl32(h & 2, 1)
                        w2 = (shr32(q, 4) & 3) | (h & 4)
                        w3 = shr32(q, 6) | shr32(h & 8, 1)
                        acc[8 + i] += (scl[t + 16] * np.float32(w0) * x0
                                       + scl[t + 18] * np.float32(w1) * x1
                                       + scl[t + 20] * np.float32(w2) * x2
                                       + scl[t + 22] * np.float32(w3) * x3)
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
