"""The tile steps of paged attention, on one thread: the query rows of one KV head against one
tile of keys, with an online softmax (running max `m` and sum `l` per row, in base 2: queries
come in pre-scaled by scale * log2(e)).

A head's rows are r0 + i * g + j (query token i, query head j of the KV head's group). Keys go
by in tiles of TK; a tile's key and value rows are read straight from the paged cache (offsets
`offs` into the flat cache, found through the block table; a float16 cache is first converted
into a small per-thread float32 tile), then:

- scores: four key rows at a time against two query rows at a time, eight dot products in one
  pass over the head dim (eight vector accumulators; each loaded vector feeds two or four
  FMAs), so every key row is read once per pass for all g heads of its group;
- soft-capping, only where asked: cap * tanh(s / cap) on the tile's scores;
- softmax step: per row, mask keys past the row's position or before its sliding window,
  tile max, rescale;
- P @ V: four value rows at a time into two accumulator rows, across the head dim.

Everything is indexed in place (no row slices: numba reference-counts each slice it makes,
an atomic in a function call, which in these loops cost more than the arithmetic), and row
offsets are unsigned (a signed index gets numba's negative-index wraparound, a select per
element that stops LLVM from vectorizing the loop).
The item loop around these (heads, tiles, output) is `attention_kernels.attend_item`.
"""

from __future__ import annotations

import numpy as np
from numba.core import types
from numba.extending import overload

from vllm_actors.kernels.cpu.attention_math import exp2, tanh
from vllm_actors.kernels.cpu.intrinsics import prefetch
from vllm_actors.kernels.cpu.jit import FASTMATH, kernel

TK = 32                      # keys per tile (a multiple of 8)
NEG_INF = np.float32(-np.inf)
ZERO = np.float32(0.0)


def prefetch_rows(cache, table, shift, hk, dh, kvh0, kvh1, t0, n):
    """Ask for the cache lines of rows t0..t0+n-1, heads kvh0..kvh1-1 (contiguous in a row of
    the flat cache), ahead of use (kernels only)."""
    raise NotImplementedError


@overload(prefetch_rows, jit_options={"fastmath": set(FASTMATH), "error_model": "numpy",
                                      "boundscheck": False})
def _prefetch_rows(cache, table, shift, hk, dh, kvh0, kvh1, t0, n):
    if isinstance(cache, types.BaseTuple):     # a quantized cache (attention_kv)
        from vllm_actors.kernels.cpu.attention_kv import prefetch_quantized
        return lambda cache, table, shift, hk, dh, kvh0, kvh1, t0, n: prefetch_quantized(
            cache, table, shift, hk, kvh0, kvh1, t0, n)
    return lambda cache, table, shift, hk, dh, kvh0, kvh1, t0, n: prefetch_plain(
        cache, table, shift, hk, dh, kvh0, kvh1, t0, n)


@kernel
def prefetch_plain(cache, table, shift, hk, dh, kvh0, kvh1, t0, n):
    """prefetch_rows of a float32 or float16 cache."""
    mask = (1 << shift) - 1
    step = max(1, 64 // cache.itemsize)
    span = (kvh1 - kvh0) * dh
    for t in range(t0, t0 + n):
        base = (((table[t >> shift] << shift) + (t & mask)) * hk + kvh0) * dh
        for e in range(0, span, step):
            prefetch(cache, base + e)


@kernel
def tile_scores(qt, r0, rows, src, offs, n, s):
    """s[r0 + r, i] = qt[r0 + r] . key i for r < rows, i < n rounded up to 4 (columns past n
    repeat key n - 1; the softmax masks them). Key i is src[offs[i]:offs[i] + dh]."""
    dh = qt.shape[1]
    last = n - 1
    pairs = r0 + rows - rows % 2
    for i in range(0, n, 4):
        o0 = offs[i]
        o1 = offs[min(i + 1, last)]
        o2 = offs[min(i + 2, last)]
        o3 = offs[min(i + 3, last)]
        for r in range(r0, pairs, 2):
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = ZERO
            for d in range(dh):
                x = qt[r, d]
                y = qt[r + 1, d]
                e = np.uint64(d)
                k0 = src[o0 + e]
                k1 = src[o1 + e]
                k2 = src[o2 + e]
                k3 = src[o3 + e]
                a0 += x * k0
                a1 += x * k1
                a2 += x * k2
                a3 += x * k3
                b0 += y * k0
                b1 += y * k1
                b2 += y * k2
                b3 += y * k3
            s[r, i] = a0
            s[r, i + 1] = a1
            s[r, i + 2] = a2
            s[r, i + 3] = a3
            s[r + 1, i] = b0
            s[r + 1, i + 1] = b1
            s[r + 1, i + 2] = b2
            s[r + 1, i + 3] = b3
        if rows % 2:
            r = r0 + rows - 1
            a0 = a1 = a2 = a3 = ZERO
            for d in range(dh):
                x = qt[r, d]
                e = np.uint64(d)
                a0 += x * src[o0 + e]
                a1 += x * src[o1 + e]
                a2 += x * src[o2 + e]
                a3 += x * src[o3 + e]
            s[r, i] = a0
            s[r, i + 1] = a1
            s[r, i + 2] = a2
            s[r, i + 3] = a3


@kernel
def softcap_rows(s, r0, rows, n, cap):
    """s[r0 + r, :n] = cap * tanh(s / cap) for r < rows (scores soft-capped)."""
    inv = np.float32(1.0) / cap
    for r in range(r0, r0 + rows):
        for t in range(n):
            s[r, t] = cap * tanh(s[r, t] * inv)


@kernel
def softmax_rows(s, r0, nq, g, pos0, t0, n, window, m, l, acc):
    """Online-softmax step over keys t0..t0+n-1 for rows r0 + i * g + j (query token i, at
    position p = pos0 + i, sees keys p - window < k <= p). Turns s[r] into probabilities (0
    where masked), updates m, l and rescales acc[r]."""
    dh = acc.shape[1]
    for i in range(nq):
        hi = min(n, pos0 + i + 1 - t0)                  # visible: lo <= t < hi
        lo = max(pos0 + i - window + 1 - t0, 0)
        for r in range(r0 + i * g, r0 + i * g + g):
            if hi <= lo:
                for t in range(TK):
                    s[r, t] = ZERO
                continue
            if hi < TK or lo > 0:
                for t in range(TK):
                    s[r, t] = s[r, t] if (t < hi) & (t >= lo) else NEG_INF
            m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = NEG_INF   # eight running maxima
            for t in range(0, TK, 8):
                m0 = max(m0, s[r, t])
                m1 = max(m1, s[r, t + 1])
                m2 = max(m2, s[r, t + 2])
                m3 = max(m3, s[r, t + 3])
                m4 = max(m4, s[r, t + 4])
                m5 = max(m5, s[r, t + 5])
                m6 = max(m6, s[r, t + 6])
                m7 = max(m7, s[r, t + 7])
            m_old = m[r]
            m_new = max(max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7))),
                        m_old)
            tot = ZERO
            for t in range(TK):
                p = exp2(s[r, t] - m_new)
                s[r, t] = p
                tot += p
            m[r] = m_new
            if m_new != m_old:
                alpha = exp2(m_old - m_new)
                l[r] = l[r] * alpha + tot
                for d in range(dh):
                    acc[r, d] *= alpha
            else:
                l[r] += tot


@kernel
def tile_pv(s, r0, rows, src, offs, n, acc):
    """acc[r0 + r] += sum_i s[r0 + r, i] * value i for r < rows, i < n (probabilities past n
    are 0, so the repeated last row adds nothing). Value i is src[offs[i]:offs[i] + dh]."""
    dh = acc.shape[1]
    last = n - 1
    pairs = r0 + rows - rows % 2
    for i in range(0, n, 4):
        o0 = offs[i]
        o1 = offs[min(i + 1, last)]
        o2 = offs[min(i + 2, last)]
        o3 = offs[min(i + 3, last)]
        for r in range(r0, pairs, 2):
            a0 = s[r, i]
            a1 = s[r, i + 1]
            a2 = s[r, i + 2]
            a3 = s[r, i + 3]
            b0 = s[r + 1, i]
            b1 = s[r + 1, i + 1]
            b2 = s[r + 1, i + 2]
            b3 = s[r + 1, i + 3]
            for d in range(dh):
                e = np.uint64(d)
                v0 = src[o0 + e]
                v1 = src[o1 + e]
                v2 = src[o2 + e]
                v3 = src[o3 + e]
                acc[r, d] += (a0 * v0 + a1 * v1) + (a2 * v2 + a3 * v3)
                acc[r + 1, d] += (b0 * v0 + b1 * v1) + (b2 * v2 + b3 * v3)
        if rows % 2:
            r = r0 + rows - 1
            a0 = s[r, i]
            a1 = s[r, i + 1]
            a2 = s[r, i + 2]
            a3 = s[r, i + 3]
            for d in range(dh):
                e = np.uint64(d)
                acc[r, d] += (a0 * src[o0 + e] + a1 * src[o1 + e]) + \
                    (a2 * src[o2 + e] + a3 * src[o3 + e])
