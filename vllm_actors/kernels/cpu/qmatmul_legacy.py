"""GEMV and row-dequantization kernels for the 32-weight block types Q4_0, Q4_1, Q5_0, Q5_1
and Q8_0, over their planar layouts (`qmatmul_layout`): `qs` the packed quants `[N, K * bits
/ 8]`, `qh` the fifth bits as uint32 `[N, K / 32]`, `d`/`m` float16 bits `[N, K / 32]`.

GEMV kernels: `(planes..., lut, x, out, dist, threads)`, x float32 `[M, K]`, out float32
`[M, N]`, lut `HALF_LUT`, `dist` how many rows ahead to prefetch, `threads` a cap on numba's
threads (0: none; see `limit_threads`). Each prange iteration takes two weight rows and, per
row of x, keeps 8 lane partial sums per weight row on the stack; a block adds
`scale * (8-lane partial dot)` to them, and the offsets (-8, -16) and mins cost one multiply
per block through x's runs of 16 summed once per call (`block_sums`).
Rows kernels: `(planes..., lut, ids, out, run)` write rows `ids` dequantized to out float32
`[len(ids), K]`; `run` = 32 at run time (see `qmatmul.ROW_RUN`).

Written out per type and per row, with no helper calls in the loops: numba does not inline
njit helpers into prange bodies (a helper per block measured 12x slower), and a loop over the
two rows keeps the partial sums in memory instead of registers (3.5x slower). Nibbles are
widened with `np.int32(...)` before the float conversion and variable shifts go through
`shr32`, so LLVM works on 32-bit lanes (numba types `uint8 >> 4` as int64: 1.6x slower).
"""

from __future__ import annotations

import numpy as np
from gguf import quants as gguf_quants
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_prims import (
    SUM_RUN,
    block_sums,
    limit_threads,
    prefetch,
    restore_threads,
    shr32,
    stack_f32,
)


@kernel(parallel=True)
def gemv_q8_0(qs, d, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
    prev = limit_threads(threads)
    n, k = qs.shape
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * k
        p1 = min(r0 + dist + 1, n - 1) * k
        acc = stack_f32(16)
        for m in range(x.shape[0]):
            for i in range(16):
                acc[i] = 0
            for b in range(k // 32):
                o = 32 * b
                prefetch(qs, p0 + o)
                prefetch(qs, p1 + o)
                d0 = lut[d[r0, b]]
                d1 = lut[d[r1, b]]
                for i in range(8):
                    xa = x[m, o + i]
                    xb = x[m, o + 8 + i]
                    xc = x[m, o + 16 + i]
                    xd = x[m, o + 24 + i]
                    acc[i] += d0 * (np.float32(qs[r0, o + i]) * xa
                                    + np.float32(qs[r0, o + 8 + i]) * xb
                                    + np.float32(qs[r0, o + 16 + i]) * xc
                                    + np.float32(qs[r0, o + 24 + i]) * xd)
                    acc[8 + i] += d1 * (np.float32(qs[r1, o + i]) * xa
                                        + np.float32(qs[r1, o + 8 + i]) * xb
                                        + np.float32(qs[r1, o + 16 + i]) * xc
                                        + np.float32(qs[r1, o + 24 + i]) * xd)
            out[m, r0] = acc[0:8].sum()
            if r0 + 1 < n:
                out[m, r0 + 1] = acc[8:16].sum()
    restore_threads(prev)


@kernel
def rows_q8_0(qs, d, lut, ids, out, run):  # type: ignore[no-untyped-def]
    for t in range(ids.size):
        r = ids[t]
        for b in range(qs.shape[1] // 32):
            dv = lut[d[r, b]]
            for j in range(run):
                out[t, 32 * b + j] = dv * np.float32(qs[r, 32 * b + j])


@kernel(parallel=True)
def gemv_q4(qs, d, mn, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
    """Q4_0 (`mn` empty: w = d * (q - 8)) and Q4_1 (w = d * q + m)."""
    prev = limit_threads(threads)
    n, rb = qs.shape
    xs = np.empty((x.shape[0], x.shape[1] // SUM_RUN), dtype=np.float32)
    block_sums(x, xs)
    has_min = mn.shape[0] > 0
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
            for b in range(rb // 16):
                o = 16 * b
                xo = 32 * b
                prefetch(qs, p0 + o)
                prefetch(qs, p1 + o)
                d0 = lut[d[r0, b]]
                d1 = lut[d[r1, b]]
                s = xs[m, 2 * b] + xs[m, 2 * b + 1]
                if has_min:
                    off0 += lut[mn[r0, b]] * s
                    off1 += lut[mn[r1, b]] * s
                else:
                    off0 -= np.float32(8) * d0 * s
                    off1 -= np.float32(8) * d1 * s
                for i in range(8):
                    xa = x[m, xo + i]
                    xb = x[m, xo + 8 + i]
                    xc = x[m, xo + 16 + i]
                    xd = x[m, xo + 24 + i]
                    q = qs[r0, o + i]
                    p = qs[r0, o + 8 + i]
                    acc[i] += d0 * (np.float32(np.int32(q & 15)) * xa
                                    + np.float32(np.int32(p & 15)) * xb
                                    + np.float32(np.int32(q >> 4)) * xc
                                    + np.float32(np.int32(p >> 4)) * xd)
                    q = qs[r1, o + i]
                    p = qs[r1, o + 8 + i]
                    acc[8 + i] += d1 * (np.float32(np.int32(q & 15)) * xa
                                        + np.float32(np.int32(p & 15)) * xb
                                        + np.float32(np.int32(q >> 4)) * xc
                                        + np.float32(np.int32(p >> 4)) * xd)
            out[m, r0] = acc[0:8].sum() + off0
            if r0 + 1 < n:
                out[m, r0 + 1] = acc[8:16].sum() + off1
    restore_threads(prev)


@kernel
def rows_q4(qs, d, mn, lut, ids, out, run):  # type: ignore[no-untyped-def]
    has_min = mn.shape[0] > 0
    half = run // 2
    for t in range(ids.size):
        r = ids[t]
        for b in range(qs.shape[1] // 16):
            dv = lut[d[r, b]]
            mv = lut[mn[r, b]] if has_min else np.float32(0)
            bias = 0 if has_min else 8
            for j in range(half):
                q = np.int32(qs[r, 16 * b + j])
                out[t, 32 * b + j] = dv * np.float32((q & 15) - bias) + mv
                out[t, 32 * b + 16 + j] = dv * np.float32((q >> 4) - bias) + mv


IQ4_NL_TABLE = np.array(gguf_quants.IQ4_NL.kvalues, np.float32)


@kernel
def rows_iq4_nl(qs, d, lut, ids, out, run):  # type: ignore[no-untyped-def]
    """IQ4_NL rows as float32 (embedding lookups): w = d * table[nibble], as ggml's
    `dequantize_row_iq4_nl`; the planes are Q4_0's."""
    half = run // 2
    for t in range(ids.size):
        r = ids[t]
        for b in range(qs.shape[1] // 16):
            dv = lut[d[r, b]]
            for j in range(half):
                q = qs[r, 16 * b + j]
                out[t, 32 * b + j] = dv * IQ4_NL_TABLE[q & 15]
                out[t, 32 * b + 16 + j] = dv * IQ4_NL_TABLE[q >> 4]


# FIFTH_BIT[byte, i] = 16 * bit i of byte: eight fifth bits spread to eight lanes by one
# 8-byte load (per-lane variable shifts cost five instructions per 8 weights).
FIFTH_BIT = ((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1).astype(np.uint8) << 4


@kernel(inline=True)
def _fifth_bytes(h):  # type: ignore[no-untyped-def]
    """The four bytes of a block's fifth-bit word: those of elements 0-7, 8-15, 16-23, 24-31."""
    return h & 255, shr32(h, 8) & 255, shr32(h, 16) & 255, shr32(h, 24)


@kernel(parallel=True)
def gemv_q5(qs, qh, d, mn, lut, x, out, dist, threads):  # type: ignore[no-untyped-def]
    """Q5_0 (`mn` empty: w = d * (q - 16)) and Q5_1 (w = d * q + m); q's fifth bit for
    element j of a block is bit j of the block's qh word."""
    prev = limit_threads(threads)
    n, rb = qs.shape
    xs = np.empty((x.shape[0], x.shape[1] // SUM_RUN), dtype=np.float32)
    block_sums(x, xs)
    has_min = mn.shape[0] > 0
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
            for b in range(rb // 16):
                o = 16 * b
                xo = 32 * b
                prefetch(qs, p0 + o)
                prefetch(qs, p1 + o)
                d0 = lut[d[r0, b]]
                d1 = lut[d[r1, b]]
                s = xs[m, 2 * b] + xs[m, 2 * b + 1]
                if has_min:
                    off0 += lut[mn[r0, b]] * s
                    off1 += lut[mn[r1, b]] * s
                else:
                    off0 -= np.float32(16) * d0 * s
                    off1 -= np.float32(16) * d1 * s
                a0, b0, c0, e0 = _fifth_bytes(qh[r0, b])
                a1, b1, c1, e1 = _fifth_bytes(qh[r1, b])
                for i in range(8):
                    xa = x[m, xo + i]
                    xb = x[m, xo + 8 + i]
                    xc = x[m, xo + 16 + i]
                    xd = x[m, xo + 24 + i]
                    q = qs[r0, o + i]
                    p = qs[r0, o + 8 + i]
                    acc[i] += d0 * (np.float32((q & 15) | FIFTH_BIT[a0, i]) * xa
                                    + np.float32((p & 15) | FIFTH_BIT[b0, i]) * xb
                                    + np.float32(shr32(q, 4) | FIFTH_BIT[c0, i]) * xc
                                    + np.float32(shr32(p, 4) | FIFTH_BIT[e0, i]) * xd)
                    q = qs[r1, o + i]
                    p = qs[r1, o + 8 + i]
                    acc[8 + i] += d1 * (np.float32((q & 15) | FIFTH_BIT[a1, i]) * xa
                                        + np.float32((p & 15) | FIFTH_BIT[b1, i]) * xb
                                        + np.float32(shr32(q, 4) | FIFTH_BIT[c1, i]) * xc
                                        + np.float32(shr32(p, 4) | FIFTH_BIT[e1, i]) * xd)
            out[m, r0] = acc[0:8].sum() + off0
            if r0 + 1 < n:
                out[m, r0 + 1] = acc[8:16].sum() + off1
    restore_threads(prev)


@kernel
def rows_q5(qs, qh, d, mn, lut, ids, out, run):  # type: ignore[no-untyped-def]
    has_min = mn.shape[0] > 0
    half = run // 2
    for t in range(ids.size):
        r = ids[t]
        for b in range(qs.shape[1] // 16):
            dv = lut[d[r, b]]
            h = np.uint32(qh[r, b])
            mv = lut[mn[r, b]] if has_min else np.float32(0)
            bias = 0 if has_min else 16
            for j in range(half):
                q = np.int32(qs[r, 16 * b + j])
                lo = (q & 15) | ((shr32(h, j) & 1) << 4)
                hi = (q >> 4) | ((shr32(h, 16 + j) & 1) << 4)
                out[t, 32 * b + j] = dv * np.float32(lo - bias) + mv
                out[t, 32 * b + 16 + j] = dv * np.float32(hi - bias) + mv
