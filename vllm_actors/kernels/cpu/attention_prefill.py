"""Prefill work items (many query rows of one KV head): register-blocked micro-kernels over a
transposed layout, so the arithmetic runs across query rows. Tiles of PK keys.

Queries and accumulator are held transposed, qT[d, r] and accT[d, r] (row r = i * g + j:
query token i, head j of the KV head's group; rows zero-padded to a multiple of 16). Per tile:

- scores sT[i, r] = key i . q_r: blocks of 4 keys x 16 rows, whose 8 vector accumulators stay
  in registers (`stack_f32`) across the head dim; each step broadcasts 4 key elements and
  loads 16 query values: 8 FMAs for 6 loads, no horizontal sums;
- softmax step across rows: key kk = t0 + i is visible to rows with kk - pos0 <= r // g
  (< kk - pos0 + window under a sliding window), a range [cut, cutw) of each key's row;
  soft-capping is a pass over the masked tile (-inf stays); max, rescale and exponentials
  run elementwise across r, and accT is rescaled only when some row's max grew by more than
  2^LAZY (a lagging reference point is as exact and saves a pass over accT);
- accT[d, r] += sum_i v_i[d] p[i, r]: blocks of 4 dims x 16 rows, registers again, summed
  over the tile's keys before touching accT.

Key and value rows are read in place from the cache (offsets from `stage_rows`; a float16
cache is converted into a per-thread tile first). Needs head_dim % 4 == 0 (else the item runs
through `attend_item`).
"""

from __future__ import annotations

import numpy as np

from vllm_actors.kernels.cpu.attention_math import (exp2, row_source, sink_scale, stage_rows,
                                                    tanh)
from vllm_actors.kernels.cpu.attention_tiles import NEG_INF, ZERO, prefetch_rows
from vllm_actors.kernels.cpu.intrinsics import stack_f32
from vllm_actors.kernels.cpu.jit import kernel

U = np.uint64
PK = 64                      # keys per prefill tile (a multiple of 4)
LAZY = np.float32(8.0)       # log2 headroom before the softmax reference moves


@kernel
def block_scores(src, o0, o1, o2, o3, qf, ld, dh, rows_p, sf, i, cut0, cutw0, g, n, tmax):
    """sT[i + k, :rows_p] = key k . q rows (k < 4; key k at src[ok:ok + dh]), in blocks of 16
    rows; -inf where masked (key i + k >= n, row r < cut0 + g * (i + k): the key is in the
    row's future, or r >= cutw0 + g * (i + k): it is before the row's window);
    tmax[r] = max(tmax[r], the visible scores)."""
    acc = stack_f32(64)
    for r0 in range(0, rows_p, 16):
        for x in range(64):
            acc[x] = ZERO
        for d in range(dh):
            e = U(d)
            k0 = src[o0 + e]
            k1 = src[o1 + e]
            k2 = src[o2 + e]
            k3 = src[o3 + e]
            qb = U(d * ld + r0)
            for r in range(16):
                y = qf[qb + U(r)]
                acc[r] += k0 * y
                acc[16 + r] += k1 * y
                acc[32 + r] += k2 * y
                acc[48 + r] += k3 * y
        s0 = U(i * ld + r0)
        for k in range(4):
            cut = cut0 + g * (i + k) - r0 if i + k < n else 16
            cutw = cutw0 + g * (i + k) - r0
            if cutw >= 16:                     # no row of the block is past its window
                for r in range(16):
                    x = acc[16 * k + r] if r >= cut else NEG_INF
                    sf[s0 + U(k * ld + r)] = x
                    tmax[r0 + r] = max(tmax[r0 + r], x)
            else:
                for r in range(16):
                    x = acc[16 * k + r] if (r >= cut) & (r < cutw) else NEG_INF
                    sf[s0 + U(k * ld + r)] = x
                    tmax[r0 + r] = max(tmax[r0 + r], x)


@kernel
def block_pv(src, offs, n, pf, ld, d0, rows_p, af):
    """accT[d0:d0 + 4, :rows_p] += sum_i value_i[d0:d0 + 4] x p[i, :rows_p], in blocks of
    16 rows."""
    acc = stack_f32(64)
    for r0 in range(0, rows_p, 16):
        for x in range(64):
            acc[x] = ZERO
        for i in range(n):
            o = offs[i] + U(d0)
            v0 = src[o]
            v1 = src[o + U(1)]
            v2 = src[o + U(2)]
            v3 = src[o + U(3)]
            pb = U(i * ld + r0)
            for r in range(16):
                y = pf[pb + U(r)]
                acc[r] += v0 * y
                acc[16 + r] += v1 * y
                acc[32 + r] += v2 * y
                acc[48 + r] += v3 * y
        a0 = U(d0 * ld + r0)
        for k in range(4):
            for r in range(16):
                af[a0 + U(k * ld + r)] += acc[16 * k + r]


@kernel
def softcap_t(sT, rows_p, cap, tmax):
    """Soft-cap a tile's masked scores in place, sT = cap * tanh(sT / cap) (-inf stays), and
    their max per row likewise (tanh is increasing: the max of the capped is the capped max)."""
    inv = np.float32(1.0) / cap
    for i in range(PK):
        for r in range(rows_p):
            x = sT[i, r]
            sT[i, r] = cap * tanh(x * inv) if x != NEG_INF else NEG_INF
    for r in range(rows_p):
        x = tmax[r]
        tmax[r] = cap * tanh(x * inv) if x != NEG_INF else NEG_INF


@kernel
def softmax_t(sT, rows_p, m, l, accT, tmax):
    """Online-softmax step of a tile in the transposed layout (see the module doc), given the
    masked scores and their max per row (tmax, reused as scratch): turns sT into probabilities,
    updates m, l and rescales accT.

    m is a reference point, not the exact running max: it moves only when a row's max passes
    it by more than LAZY (so p <= 2^LAZY), which leaves accT alone on almost every tile."""
    dh = accT.shape[0]
    moved = False
    for r in range(rows_p):
        mx = tmax[r]
        if mx > m[r] + LAZY:                  # also every row's first visible tile (m = -inf)
            alpha = exp2(m[r] - mx)
            l[r] *= alpha
            tmax[r] = alpha                    # tmax now holds the row's rescale factor
            m[r] = mx
            moved = True
        else:
            tmax[r] = np.float32(1.0)
    if moved:
        for d in range(dh):
            for r in range(rows_p):
                accT[d, r] *= tmax[r]
    for r in range(rows_p):
        tmax[r] = m[r] if m[r] != NEG_INF else ZERO   # nothing visible yet: p = 0
    for i in range(PK):
        for r in range(rows_p):
            p = exp2(sT[i, r] - tmax[r])
            sT[i, r] = p
            l[r] += p


@kernel(inline=True)
def attend_prefill(q, kc, vc, table, shift, hk, tok0, pos0, nq, g, kvh, k0, k1, qscale, window,
                   cap, qT, accT, sT, m, l, mref, kbuf, vbuf, offs):
    """Rows of query tokens tok0..tok0+nq-1 (positions pos0..) under KV head kvh over keys
    k0..k1-1, causal within the sliding `window`, scores soft-capped at `cap` (as in
    `attention_kernels.attend_item`); leaves m, l and accT (transposed) for `finish_prefill`
    (m = -inf, l = 0 for a row that saw no key)."""
    dh = qT.shape[0]
    ld = qT.shape[1]
    rows = nq * g
    rows_p = (rows + 15) // 16 * 16
    for d in range(dh):
        for r in range(rows_p):
            qT[d, r] = ZERO
            accT[d, r] = ZERO
    for i in range(nq):
        for j in range(g):
            r = i * g + j
            for d in range(dh):
                qT[d, r] = q[tok0 + i, kvh * g + j, d] * qscale
    for r in range(rows_p):
        m[r] = NEG_INF
        l[r] = ZERO
    qf = qT.reshape(-1)
    sf = sT.reshape(-1)
    af = accT.reshape(-1)
    ksrc = row_source(kc, kbuf)
    vsrc = row_source(vc, vbuf)
    end = min(k1, pos0 + nq)
    for t0 in range(max(k0, pos0 - window + 1), end, PK):   # from the first row's window
        n = min(PK, end - t0)
        ahead = min(PK, end - t0 - n)
        prefetch_rows(kc, table, shift, hk, dh, kvh, kvh + 1, t0 + n, ahead)
        prefetch_rows(vc, table, shift, hk, dh, kvh, kvh + 1, t0 + n, ahead)
        stage_rows(kc, table, shift, hk, kvh, t0, n, kbuf, offs)
        last = n - 1
        for r in range(rows_p):
            mref[r] = NEG_INF
        for i in range(0, PK, 4):
            if i >= n:                         # keys past the tile's end: p = 0
                for k in range(i, PK):
                    for r in range(rows_p):
                        sT[k, r] = NEG_INF
                break
            o0 = offs[i]
            o1 = offs[min(i + 1, last)]
            o2 = offs[min(i + 2, last)]
            o3 = offs[min(i + 3, last)]
            block_scores(ksrc, o0, o1, o2, o3, qf, ld, dh, rows_p, sf, i, g * (t0 - pos0),
                         g * (t0 - pos0 + window), g, n, mref)
        if cap > ZERO:
            softcap_t(sT, rows_p, cap, mref)
        softmax_t(sT, rows_p, m, l, accT, mref)
        stage_rows(vc, table, shift, hk, kvh, t0, n, vbuf, offs)
        for d0 in range(0, dh, 4):
            block_pv(vsrc, offs, n, sf, ld, d0, rows_p, af)


@kernel(inline=True)
def finish_prefill(tok0, nq, g, kvh, m, l, accT, part, out, pm, pl, pacc, sinks):
    """Normalized rows into `out` (sinks as in `sink_scale`), or the raw state into partial
    slot `part`."""
    dh = accT.shape[0]
    for i in range(nq):
        for j in range(g):
            r = i * g + j
            if part < 0:
                inv = sink_scale(sinks, kvh * g + j, m[r], l[r])
                for d in range(dh):
                    out[tok0 + i, kvh * g + j, d] = accT[d, r] * inv
            else:
                pm[part, r] = m[r]
                pl[part, r] = l[r]
                for d in range(dh):
                    pacc[part, r, d] = accT[d, r]
