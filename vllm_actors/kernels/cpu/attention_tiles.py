"""The tile steps of paged attention, on one thread: the query rows of one KV head against one
tile of keys, with an online softmax (running max `m` and sum `l` per row, in base 2: queries
come in pre-scaled by scale * log2(e)).

Rows are (query token, query head of the KV head's group): row r = i * g + j. Keys go by in
tiles of TK; a tile's key and value rows are read straight from the paged cache through the
block table (a float16 cache is first converted into a small per-thread float32 tile), then:

- scores: four key rows at a time against two query rows at a time, eight dot products in one
  pass over the head dim (eight vector accumulators; each loaded vector feeds two or four
  FMAs), so every key row is read once per pass for all g heads of its group;
- softmax step: per row, mask keys past the row's position, tile max, rescale;
- P @ V: four value rows at a time into two accumulator rows, across the head dim.

The item loop around these (heads, tiles, output) is `attention_kernels.attend_item`.
"""

from __future__ import annotations

import numpy as np

from vllm_actors.kernels.cpu.attention_intrinsics import prefetch
from vllm_actors.kernels.cpu.attention_math import cache_row, exp2, stage_rows
from vllm_actors.kernels.cpu.jit import kernel

TK = 32                      # keys per tile (a multiple of 8)
NEG_INF = np.float32(-np.inf)
ZERO = np.float32(0.0)


@kernel
def prefetch_rows(cache, table, shift, kvh0, kvh1, t0, n):
    """Ask for the cache lines of rows t0..t0+n-1, heads kvh0..kvh1-1, ahead of use."""
    mask = (1 << shift) - 1
    step = max(1, 64 // cache.itemsize)
    for t in range(t0, t0 + n):
        blk = table[t >> shift]
        for h in range(kvh0, kvh1):
            for d in range(0, cache.shape[3], step):
                prefetch(cache, blk, t & mask, h, d)


@kernel
def tile_scores(qt, rows, kc, kbuf, table, shift, kvh, t0, n, s):
    """s[r, i] = qt[r] . key(t0 + i) for r < rows, i < n rounded up to 4 (columns past n
    repeat key n - 1; the softmax masks them)."""
    dh = qt.shape[1]
    last = n - 1
    pairs = rows - rows % 2
    for i in range(0, n, 4):
        i1 = min(i + 1, last)
        i2 = min(i + 2, last)
        i3 = min(i + 3, last)
        k0 = cache_row(kc, kbuf, table, shift, kvh, t0 + i, i)
        k1 = cache_row(kc, kbuf, table, shift, kvh, t0 + i1, i1)
        k2 = cache_row(kc, kbuf, table, shift, kvh, t0 + i2, i2)
        k3 = cache_row(kc, kbuf, table, shift, kvh, t0 + i3, i3)
        for r in range(0, pairs, 2):
            qa = qt[r]
            qb = qt[r + 1]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = ZERO
            for d in range(dh):
                x = qa[d]
                y = qb[d]
                a0 += x * k0[d]
                a1 += x * k1[d]
                a2 += x * k2[d]
                a3 += x * k3[d]
                b0 += y * k0[d]
                b1 += y * k1[d]
                b2 += y * k2[d]
                b3 += y * k3[d]
            s[r, i] = a0
            s[r, i + 1] = a1
            s[r, i + 2] = a2
            s[r, i + 3] = a3
            s[r + 1, i] = b0
            s[r + 1, i + 1] = b1
            s[r + 1, i + 2] = b2
            s[r + 1, i + 3] = b3
        if pairs < rows:
            qa = qt[pairs]
            a0 = a1 = a2 = a3 = ZERO
            for d in range(dh):
                x = qa[d]
                a0 += x * k0[d]
                a1 += x * k1[d]
                a2 += x * k2[d]
                a3 += x * k3[d]
            s[pairs, i] = a0
            s[pairs, i + 1] = a1
            s[pairs, i + 2] = a2
            s[pairs, i + 3] = a3


@kernel
def row_max(row):
    """max of row[:TK] with eight independent running maxima (so it vectorizes)."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = NEG_INF
    for t in range(0, TK, 8):
        m0 = max(m0, row[t])
        m1 = max(m1, row[t + 1])
        m2 = max(m2, row[t + 2])
        m3 = max(m3, row[t + 3])
        m4 = max(m4, row[t + 4])
        m5 = max(m5, row[t + 5])
        m6 = max(m6, row[t + 6])
        m7 = max(m7, row[t + 7])
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@kernel
def softmax_rows(s, rows, g, pos0, t0, n, m, l, acc):
    """Online-softmax step over keys t0..t0+n-1: row r (query position pos0 + r // g) sees
    keys <= its position. Turns s[r] into probabilities (0 where masked), updates m, l and
    rescales acc[r]."""
    dh = acc.shape[1]
    for r in range(rows):
        sr = s[r]
        nvis = min(n, pos0 + r // g + 1 - t0)
        if nvis <= 0:
            for t in range(TK):
                sr[t] = ZERO
            continue
        for t in range(TK):
            sr[t] = sr[t] if t < nvis else NEG_INF
        m_new = max(m[r], row_max(sr))
        alpha = exp2(m[r] - m_new)
        tot = ZERO
        for t in range(TK):
            p = exp2(sr[t] - m_new)
            sr[t] = p
            tot += p
        m[r] = m_new
        l[r] = l[r] * alpha + tot
        if alpha != 1.0:
            ar = acc[r]
            for d in range(dh):
                ar[d] *= alpha


@kernel
def tile_pv(s, rows, vc, vbuf, table, shift, kvh, t0, n, acc):
    """acc[r] += sum_i s[r, i] * value(t0 + i) for r < rows, i < n (probabilities past n are
    0, so the repeated last row adds nothing)."""
    dh = acc.shape[1]
    last = n - 1
    pairs = rows - rows % 2
    for i in range(0, n, 4):
        i1 = min(i + 1, last)
        i2 = min(i + 2, last)
        i3 = min(i + 3, last)
        v0 = cache_row(vc, vbuf, table, shift, kvh, t0 + i, i)
        v1 = cache_row(vc, vbuf, table, shift, kvh, t0 + i1, i1)
        v2 = cache_row(vc, vbuf, table, shift, kvh, t0 + i2, i2)
        v3 = cache_row(vc, vbuf, table, shift, kvh, t0 + i3, i3)
        for r in range(0, pairs, 2):
            a0 = s[r, i]
            a1 = s[r, i + 1]
            a2 = s[r, i + 2]
            a3 = s[r, i + 3]
            b0 = s[r + 1, i]
            b1 = s[r + 1, i + 1]
            b2 = s[r + 1, i + 2]
            b3 = s[r + 1, i + 3]
            oa = acc[r]
            ob = acc[r + 1]
            for d in range(dh):
                oa[d] += (a0 * v0[d] + a1 * v1[d]) + (a2 * v2[d] + a3 * v3[d])
                ob[d] += (b0 * v0[d] + b1 * v1[d]) + (b2 * v2[d] + b3 * v3[d])
        if pairs < rows:
            a0 = s[pairs, i]
            a1 = s[pairs, i + 1]
            a2 = s[pairs, i + 2]
            a3 = s[pairs, i + 3]
            oa = acc[pairs]
            for d in range(dh):
                oa[d] += (a0 * v0[d] + a1 * v1[d]) + (a2 * v2[d] + a3 * v3[d])
