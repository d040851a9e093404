"""The GEMM for small M (batched decode: up to `FUSED_MAX_M` rows of x), with the weights
decoded inside the loop: `out[M, N] = x[M, K] @ W.T`, x packed into panels as for
`qmatmul_gemm`.

Per task (a tile of weight rows, `prange`), per group of four weight rows, per 32-column block
of K: the four rows' 32 weights are decoded into a stack tile (`w`, 128 floats, in L1), then
`block_fma` multiplies them into every panel's 4x16 accumulators (held in registers across the
block's 32 columns, kept in `acc` between blocks). No float32 copy of W is written or read
back, which is what the dequantize-then-multiply GEMM pays: measured at M = 16 (2 threads,
Q4_1 3072x576) 0.69-0.76 ms against 1.05-1.08 ms; 576x1536 0.32-0.33 against 0.41-0.50.

Q4_x and Q8_0 decode in explicit 8-lane groups, four rows written out (LLVM's SLP vectorizer
turns each group into vector zero-extend, convert and multiply-add): 5-14 % faster than
run-time loops at M = 16 (A/B in one process, 1536x1536 and 3072x576). The other types keep
loops of `run` (32, passed at run time) weights: a constant-count loop over 16 or 32 elements
was unrolled into scalar code (2.9 ms instead of 0.7 at 3072x576 Q4_1); lane-group forms of
Q4_K/Q5_K (through an inlined per-row helper) measured up to 1.9x slower than their loops and
Q6_K's within noise, so they were not kept.
Types: Q4_0/Q4_1, Q5_0/Q5_1, Q8_0, Q4_K/Q5_K, Q6_K; the others (float types, Q2_K, Q3_K) use
`qmatmul_gemm` at every M.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_prims import shr32, stack_f32


@kernel(inline=True)
def block_fma(w, xp, acc, k0):  # type: ignore[no-untyped-def]
    """acc[t, 16 r + j] += sum_i w[32 r + i] * xp[t, k0 + i, j] (four decoded rows)."""
    reg = stack_f32(64)
    for t in range(xp.shape[0]):
        for j in range(64):
            reg[j] = acc[t, j]
        for i in range(32):
            kk = k0 + i
            w0 = w[i]
            w1 = w[32 + i]
            w2 = w[64 + i]
            w3 = w[96 + i]
            for j in range(16):
                xv = xp[t, kk, j]
                reg[j] += w0 * xv
                reg[16 + j] += w1 * xv
                reg[32 + j] += w2 * xv
                reg[48 + j] += w3 * xv
        for j in range(64):
            acc[t, j] = reg[j]


@kernel(inline=True)
def store_group(acc, out, a, n):  # type: ignore[no-untyped-def]
    """Rows a..a+3 (those < n) of the result out of acc, and acc zeroed for the next group."""
    m = out.shape[0]
    for t in range(acc.shape[0]):
        mc = min(16, m - 16 * t)
        for r in range(min(4, n - a)):
            for j in range(mc):
                out[16 * t + j, a + r] = acc[t, 16 * r + j]
        for j in range(64):
            acc[t, j] = 0


@kernel(parallel=True)
def fused_q4(qs, d, mn, lut, xp, out, tile, run):  # type: ignore[no-untyped-def]
    """Q4_0 (`mn` empty: w = d * (q - 8)) and Q4_1 (w = d * q + m). The decode is written out
    for the four rows in 8-lane groups (SLP-vectorized: `run` is unused here), 14 % faster
    than the run-time loop at M = 16."""
    n, rb = qs.shape
    has_min = mn.shape[0] > 0
    for t in prange((n + tile - 1) // tile):
        acc = np.zeros((xp.shape[0], 64), dtype=np.float32)
        w = stack_f32(128)
        for a in range(t * tile, min(n, t * tile + tile), 4):
            r1 = min(a + 1, n - 1)
            r2 = min(a + 2, n - 1)
            r3 = min(a + 3, n - 1)
            for c in range(rb // 16):
                o = 16 * c
                d0 = lut[d[a, c]]
                d1 = lut[d[r1, c]]
                d2 = lut[d[r2, c]]
                d3 = lut[d[r3, c]]
                if has_min:
                    m0 = lut[mn[a, c]]
                    m1 = lut[mn[r1, c]]
                    m2 = lut[mn[r2, c]]
                    m3 = lut[mn[r3, c]]
                else:
                    m0 = np.float32(-8) * d0
                    m1 = np.float32(-8) * d1
                    m2 = np.float32(-8) * d2
                    m3 = np.float32(-8) * d3
                for i in range(8):
                    q = qs[a, o + i]
                    p = qs[a, o + 8 + i]
                    w[i] = d0 * np.float32(np.int32(q & 15)) + m0
                    w[8 + i] = d0 * np.float32(np.int32(p & 15)) + m0
                    w[16 + i] = d0 * np.float32(np.int32(q >> 4)) + m0
                    w[24 + i] = d0 * np.float32(np.int32(p >> 4)) + m0
                    q = qs[r1, o + i]
                    p = qs[r1, o + 8 + i]
                    w[32 + i] = d1 * np.float32(np.int32(q & 15)) + m1
                    w[40 + i] = d1 * np.float32(np.int32(p & 15)) + m1
                    w[48 + i] = d1 * np.float32(np.int32(q >> 4)) + m1
                    w[56 + i] = d1 * np.float32(np.int32(p >> 4)) + m1
                    q = qs[r2, o + i]
                    p = qs[r2, o + 8 + i]
                    w[64 + i] = d2 * np.float32(np.int32(q & 15)) + m2
                    w[72 + i] = d2 * np.float32(np.int32(p & 15)) + m2
                    w[80 + i] = d2 * np.float32(np.int32(q >> 4)) + m2
                    w[88 + i] = d2 * np.float32(np.int32(p >> 4)) + m2
                    q = qs[r3, o + i]
                    p = qs[r3, o + 8 + i]
                    w[96 + i] = d3 * np.float32(np.int32(q & 15)) + m3
                    w[104 + i] = d3 * np.float32(np.int32(p & 15)) + m3
                    w[112 + i] = d3 * np.float32(np.int32(q >> 4)) + m3
                    w[120 + i] = d3 * np.float32(np.int32(p >> 4)) + m3
                block_fma(w, xp, acc, 32 * c)
            store_group(acc, out, a, n)


@kernel(parallel=True)
def fused_q5(qs, qh, d, mn, lut, xp, out, tile, run):  # type: ignore[no-untyped-def]
    """Q5_0 (`mn` empty: w = d * (q - 16)) and Q5_1 (w = d * q + m); bit j of qh is the fifth
    bit of element j."""
    n, rb = qs.shape
    half = run // 2
    has_min = mn.shape[0] > 0
    for t in prange((n + tile - 1) // tile):
        acc = np.zeros((xp.shape[0], 64), dtype=np.float32)
        w = stack_f32(128)
        for a in range(t * tile, min(n, t * tile + tile), 4):
            for c in range(rb // 16):
                for r in range(4):
                    row = min(a + r, n - 1)
                    dv = lut[d[row, c]]
                    mv = lut[mn[row, c]] if has_min else np.float32(-16) * dv
                    h = np.uint32(qh[row, c])
                    for i in range(half):
                        q = np.int32(qs[row, 16 * c + i])
                        lo = (q & 15) | ((shr32(h, i) & 1) << 4)
                        hi = (q >> 4) | ((shr32(h, 16 + i) & 1) << 4)
                        w[32 * r + i] = dv * np.float32(np.int32(lo)) + mv
                        w[32 * r + 16 + i] = dv * np.float32(np.int32(hi)) + mv
                block_fma(w, xp, acc, 32 * c)
            store_group(acc, out, a, n)


@kernel(parallel=True)
def fused_q8_0(qs, d, lut, xp, out, tile, run):  # type: ignore[no-untyped-def]
    """Decode written out in 8-lane groups as in `fused_q4` (`run` unused)."""
    n, k = qs.shape
    for t in prange((n + tile - 1) // tile):
        acc = np.zeros((xp.shape[0], 64), dtype=np.float32)
        w = stack_f32(128)
        for a in range(t * tile, min(n, t * tile + tile), 4):
            r1 = min(a + 1, n - 1)
            r2 = min(a + 2, n - 1)
            r3 = min(a + 3, n - 1)
            for c in range(k // 32):
                o = 32 * c
                d0 = lut[d[a, c]]
                d1 = lut[d[r1, c]]
                d2 = lut[d[r2, c]]
                d3 = lut[d[r3, c]]
                for i in range(8):
                    w[i] = d0 * np.float32(qs[a, o + i])
                    w[8 + i] = d0 * np.float32(qs[a, o + 8 + i])
                    w[16 + i] = d0 * np.float32(qs[a, o + 16 + i])
                    w[24 + i] = d0 * np.float32(qs[a, o + 24 + i])
                    w[32 + i] = d1 * np.float32(qs[r1, o + i])
                    w[40 + i] = d1 * np.float32(qs[r1, o + 8 + i])
                    w[48 + i] = d1 * np.float32(qs[r1, o + 16 + i])
                    w[56 + i] = d1 * np.float32(qs[r1, o + 24 + i])
                    w[64 + i] = d2 * np.float32(qs[r2, o + i])
                    w[72 + i] = d2 * np.float32(qs[r2, o + 8 + i])
                    w[80 + i] = d2 * np.float32(qs[r2, o + 16 + i])
                    w[88 + i] = d2 * np.float32(qs[r2, o + 24 + i])
                    w[96 + i] = d3 * np.float32(qs[r3, o + i])
                    w[104 + i] = d3 * np.float32(qs[r3, o + 8 + i])
                    w[112 + i] = d3 * np.float32(qs[r3, o + 16 + i])
                    w[120 + i] = d3 * np.float32(qs[r3, o + 24 + i])
                block_fma(w, xp, acc, 32 * c)
            store_group(acc, out, a, n)


@kernel(parallel=True)
def fused_q45_k(qh, qs, sc, mn, d, dmin, lut, xp, out, tile, run):  # type: ignore[no-untyped-def]
    """Q4_K, or Q5_K when `qh` is not empty (layout as in `qmatmul_k45`)."""
    n = qs.shape[0]
    five = qh.shape[0] > 0
    for t in prange((n + tile - 1) // tile):
        acc = np.zeros((xp.shape[0], 64), dtype=np.float32)
        w = stack_f32(128)
        for a in range(t * tile, min(n, t * tile + tile), 4):
            for c in range(qs.shape[1] // 16):
                sb = c >> 3
                s = c & 7
                sh = 4 * (s & 1)
                o = 128 * sb + 32 * (s >> 1)
                for r in range(4):
                    row = min(a + r, n - 1)
                    scale = lut[d[row, sb]] * np.float32(sc[row, c])
                    low = lut[dmin[row, sb]] * np.float32(mn[row, c])
                    if five:
                        for i in range(run):
                            q = (shr32(qs[row, o + i], sh) & 15) | (
                                (shr32(qh[row, 32 * sb + i], s) & 1) << 4)
                            w[32 * r + i] = scale * np.float32(np.int32(q)) - low
                    else:
                        for i in range(run):
                            q = shr32(qs[row, o + i], sh) & 15
                            w[32 * r + i] = scale * np.float32(np.int32(q)) - low
                block_fma(w, xp, acc, 32 * c)
            store_group(acc, out, a, n)


@kernel(parallel=True)
def fused_q6_k(ql, qh, scales, d, lut, xp, out, tile, run):  # type: ignore[no-untyped-def]
    """Q6_K (layout as in `qmatmul_k45`): 32-column block c is quarter k of half h of
    superblock sb, two 16-weight halves with their own scales."""
    n = ql.shape[0]
    half = run // 2
    for t in prange((n + tile - 1) // tile):
        acc = np.zeros((xp.shape[0], 64), dtype=np.float32)
        w = stack_f32(128)
        for a in range(t * tile, min(n, t * tile + tile), 4):
            for c in range(ql.shape[1] // 16):
                sb = c >> 3
                h = (c >> 2) & 1
                k = c & 3
                o = 128 * sb + 64 * h + 32 * (k & 1)
                hb = 64 * sb + 32 * h
                ls = 4 * (k >> 1)
                s = 16 * sb + 8 * h + 2 * k
                for r in range(4):
                    row = min(a + r, n - 1)
                    dv = lut[d[row, sb]]
                    sa = dv * np.float32(scales[row, s])
                    sb2 = dv * np.float32(scales[row, s + 1])
                    for i in range(half):
                        q = (shr32(ql[row, o + i], ls) & 15) | (
                            (shr32(qh[row, hb + i], 2 * k) & 3) << 4)
                        p = (shr32(ql[row, o + 16 + i], ls) & 15) | (
                            (shr32(qh[row, hb + 16 + i], 2 * k) & 3) << 4)
                        w[32 * r + i] = sa * (np.float32(np.int32(q)) - np.float32(32))
                        w[32 * r + 16 + i] = sb2 * (np.float32(np.int32(p)) - np.float32(32))
                block_fma(w, xp, acc, 32 * c)
            store_group(acc, out, a, n)
