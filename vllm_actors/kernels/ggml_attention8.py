"""llama.cpp's attention over a float16 cache in the orders of a build without AVX-512 (AVX2
and FMA: 8 lanes, `ggml_math.ggml_width` 8), the work items `ggml_attention` runs where the
host's llama.cpp is 8 lanes wide. The graph is the same (Q rounded to float16, K . Q,
soft_max, P rounded to float16, P . V); the orders are the 8-lane ones:
- a step of several query tokens through llamafile's tinyBLAS<8>: one fused multiply-add
  chain of 8 lanes per output over the row, then its `hsum`: the two 128-bit halves added,
  then (0 + 2) + (1 + 3);
- a one-token step through `ggml_vec_dot_f16`: 4 accumulators of 8 lanes over chunks of 32,
  combined as (a0 + a2) + (a1 + a3), the halves added, two horizontal adds, and leftovers
  past the last whole 32 added in float64;
- soft_max: exp by `ggml_math.expf8` (AVX2's `ggml_v_expf`), each 8's sum by the same
  `hsum`, added in float64; probabilities scaled by float32(1 / sum) and rounded.
Scores and softmax run over whole 32s of keys from the first (llama.cpp pads the cache
with cells whose scores are masked, which add zeros). Lanes are independent chains, so a
16-wide vector operation (`intrinsics.fma16`) carries two keys' 8 lanes in the scores and
16 dimensions of every chain in P . V; the sums across lanes then follow the orders above.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import carray

from vllm_actors.kernels.cpu.intrinsics import fma16, stack_f32, widen16
from vllm_actors.kernels.cpu.jit import Callback, callback
from vllm_actors.kernels.ggml_attention_parts import (_ITEM_ARGS, TILE, _cell, _half, _half_unit,
                                                     _key_offsets, shifted_exps)
from vllm_actors.kernels.ggml_math import NORMAL_HIGH, NORMAL_LOW, expf8, expf8_normal

LANES = 8
DOT = 32            # `ggml_vec_dot_f16`'s chunk: 4 accumulators of 8 lanes


@numba.njit(inline="always", cache=True)
def _hsum(a, o):  # type: ignore[no-untyped-def]
    """tinyBLAS's and soft_max's sum of the 8 lanes a[o:o + 8]: h_i = a[o + 4 + i] + a[o + i],
    then (h0 + h2) + (h1 + h3)."""
    h0, h1 = a[o + 4] + a[o], a[o + 5] + a[o + 1]
    h2, h3 = a[o + 6] + a[o + 2], a[o + 7] + a[o + 3]
    return (h0 + h2) + (h1 + h3)


ROWS = 4            # query rows `_tile_scores` multiplies by each key pair's loaded chunk
_ROW_LANES = 2 * LANES * ROWS
_CHAINS8 = 16 * LANES       # tinyBLAS's 8 chains of 16 dimensions
_HALF_CHAINS = _CHAINS8 // 2


@numba.njit(inline="always", cache=True)
def _tile_scores(kf2, q2, p, dh, scale, s):  # type: ignore[no-untyped-def]
    """s[r, j] = (K_j . q_r) * scale for ROWS query rows (q2: each row doubled, as
    `_pair_rows` pairs the keys) and keys j <= p (and the next, to a whole pair) in
    tinyBLAS<8>'s order: element 8c + l chained onto lane l, then `_hsum`. Two keys a
    vector; each chunk of a key pair is loaded once for the ROWS rows, whose chains stay on
    the stack (in registers)."""
    acc = stack_f32(_ROW_LANES)
    for pair in range(p // 2 + 1):
        for i in range(_ROW_LANES):
            acc[i] = np.float32(0.0)
        for c in range(dh // LANES):
            for r in range(ROWS):
                fma16(acc, r * 2 * LANES, kf2, pair * 2 * dh + c * 2 * LANES, q2,
                      r * 2 * dh + c * 2 * LANES)
        for r in range(ROWS):
            s[r, 2 * pair] = np.float32(_hsum(acc, r * 2 * LANES) * scale)
            s[r, 2 * pair + 1] = np.float32(_hsum(acc, r * 2 * LANES + LANES) * scale)


@numba.njit(inline="always", cache=True)
def _reduce_dot(acc, o):  # type: ignore[no-untyped-def]
    """GGML_F32x8_REDUCE of the 4 registers of 8 in acc[o:o + 32]: (x0 + x2) + (x1 + x3),
    the halves added, two horizontal adds."""
    a = stack_f32(LANES)
    for lane in range(LANES):
        a[lane] = (acc[o + lane] + acc[o + 16 + lane]) + (acc[o + 8 + lane] + acc[o + 24 + lane])
    t0, t1 = a[0] + a[4], a[1] + a[5]
    t2, t3 = a[2] + a[6], a[3] + a[7]
    return (t0 + t1) + (t2 + t3)


@numba.njit(inline="always", cache=True)
def _vec_dot_scores(kflat, koff, q16, p, dh, scale, s):  # type: ignore[no-untyped-def]
    """s[j] = (K_j . q) * scale for keys j <= p as AVX2's `ggml_vec_dot_f16`: element d of
    each whole 32 chained onto accumulator d % 32 (its float16 row read from the cache),
    `_reduce_dot`, leftovers past the last whole 32 added in float64."""
    whole = dh - dh % DOT
    acc = stack_f32(DOT)
    for j in range(p + 1):
        for lane in range(DOT):
            acc[lane] = np.float32(0.0)
        for c in range(0, whole, DOT):
            fma16(acc, 0, kflat, koff[j] + c, q16, c)
            fma16(acc, 16, kflat, koff[j] + c + 16, q16, c + 16)
        dot = _reduce_dot(acc, 0)
        if whole < dh:
            total = np.float64(dot)
            for d in range(whole, dh):
                total += np.float64(np.float32(q16[d] * _cell(kflat[koff[j] + d])))
            dot = np.float32(total)
        s[j] = np.float32(dot * scale)


@numba.njit(inline="always", cache=True)
def _tiny_values(vb, s, n, dh, nk, out, row, head):  # type: ignore[no-untyped-def]
    """out[row, head] = P . V over the keys j < n (a multiple of 8; probability 0 past the
    query's position, which adds nothing) in tinyBLAS<8>'s order: key j chained onto lane
    j % 8 of every dimension, then `_hsum` across the lanes. 16 dimensions at a time over V
    as `_value_blocks` lays it out, chains 0-3 then 4-7 on the stack (in registers: 8 of
    AVX2's 16, 4 of AVX-512's 32)."""
    acc, lanes = stack_f32(_HALF_CHAINS), stack_f32(_CHAINS8)
    for d0 in range(0, dh, 16):
        base = d0 * nk
        for half in range(2):
            for i in range(_HALF_CHAINS):
                acc[i] = np.float32(0.0)
            for j0 in range(half * 4, n, LANES):
                for k in range(4):
                    fma16(acc, k * 16, vb, base + (j0 + k) * 16, s[j0 + k], 0)
            for i in range(_HALF_CHAINS):
                lanes[half * _HALF_CHAINS + i] = acc[i]
        for i in range(16):
            a0, a1, a2, a3 = lanes[i], lanes[16 + i], lanes[32 + i], lanes[48 + i]
            a4, a5, a6, a7 = lanes[64 + i], lanes[80 + i], lanes[96 + i], lanes[112 + i]
            out[row, head, d0 + i] = ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))


@numba.njit(inline="always", cache=True)
def _value_blocks(flat, koff, dh, out):  # type: ignore[no-untyped-def]
    """V's float16 rows as float32 in blocks of 16 dimensions, keys in order within a block:
    out[d0 nk + 16 j + i] = V[j, d0 + i] (d0 a multiple of 16), read in sequence by
    `_tiny_values`."""
    nk = koff.shape[0]
    for j in range(nk):
        for d0 in range(0, dh, 16):
            widen16(out, d0 * nk + j * 16, flat, koff[j] + d0)


@numba.njit(inline="always", cache=True)
def _vec_dot_values(vflat, koff, s, p, dh, acc, out, row, head):  # type: ignore[no-untyped-def]
    """out[row, head] = P . V over keys j <= p as AVX2's `ggml_vec_dot_f16` (a one-token
    step): key j chained onto accumulator j % 32 of every dimension (keys past p have
    probability 0 and add nothing), then `_reduce_dot` across them. acc: 32 x Dh floats."""
    for i in range(DOT * dh):
        acc[i] = np.float32(0.0)
    for j in range(p + 1):
        w = s[j]
        if w != 0.0:            # fma(v, 0, a) = a: skipping is exact
            base = (j % DOT) * dh
            for d0 in range(0, dh, 16):
                fma16(acc, base + d0, vflat, koff[j] + d0, w, 0)
    for lane in range(LANES):   # (x0 + x2) + (x1 + x3) of the 4 registers, into chains 0-7
        for d in range(dh):
            acc[lane * dh + d] = ((acc[lane * dh + d] + acc[(16 + lane) * dh + d])
                                  + (acc[(8 + lane) * dh + d] + acc[(24 + lane) * dh + d]))
    for d in range(dh):         # the halves added, then two horizontal adds
        a0, a1, a2, a3 = acc[d], acc[dh + d], acc[2 * dh + d], acc[3 * dh + d]
        a4, a5, a6, a7 = acc[4 * dh + d], acc[5 * dh + d], acc[6 * dh + d], acc[7 * dh + d]
        out[row, head, d] = ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))


@numba.njit(inline="always", cache=True)
def softmax(s, n, e):  # type: ignore[no-untyped-def]
    """s[:n] (n a multiple of 32) -> float16-rounded probabilities as AVX2's soft_max: the
    row's max, x - max in float32, `expf8`, each 8's `_hsum` added in float64, then scaled
    by float32(1 / sum) and rounded. The exp runs branch-free over the row (`expf8_normal`,
    a loop LLVM vectorizes) and is redone where x is outside its normal range (masked keys'
    -inf). e: scratch of n floats."""
    first, last = shifted_exps(s, n, e, expf8_normal)
    for i in range(first, last + 1):
        if not NORMAL_LOW <= s[i] <= NORMAL_HIGH:
            e[i] = expf8(s[i])
    total = 0.0
    for c in range(0, n, LANES):
        total += np.float64(_hsum(e, c))
    inv = np.float32(1.0 / total)
    for i in range(n):
        s[i] = _half_unit(np.float32(e[i] * inv))


@numba.njit(inline="always", cache=True)
def _pair_rows(flat, koff, dh, out):  # type: ignore[no-untyped-def]
    """Keys' float16 rows as float32, two keys interleaved by 8s for `_tile_scores`:
    out[(j // 2) 2 Dh + 16 c + 8 (j % 2) + l] = element 8c + l of key j's row."""
    for j in range(koff.shape[0]):
        base = (j // 2) * 2 * dh + (j % 2) * LANES
        for c in range(dh // LANES):
            for lane in range(LANES):
                out[base + c * 2 * LANES + lane] = _cell(flat[koff[j] + c * LANES + lane])


@numba.njit(inline="always", cache=True)
def _mask_softmax(s, p, n, window, e):  # type: ignore[no-untyped-def]
    """A query at position p: keys past it or its sliding window to -inf, then `softmax`
    over the first n (whole 32s)."""
    for j in range(n):
        if j > p or (window > 0 and j <= p - window):
            s[j] = -np.inf
    softmax(s, n, e)


@numba.njit(inline="always", cache=True)
def _query_row(q, row, head, lut, q16):  # type: ignore[no-untyped-def]
    """q[row, head] rounded to float16 (as float32), into q16."""
    for d in range(q.shape[2]):
        q16[d] = _half(q[row, head, d], lut)


@numba.njit(inline="always", cache=True)
def _doubled(q16, q2, r):  # type: ignore[no-untyped-def]
    """q16 doubled by 8s into row r of q2, as `_pair_rows` pairs the keys."""
    dh = q16.shape[0]
    for c in range(dh // LANES):
        for lane in range(LANES):
            q2[r * 2 * dh + c * 2 * LANES + lane] = q16[c * LANES + lane]
            q2[r * 2 * dh + c * 2 * LANES + LANES + lane] = q16[c * LANES + lane]


@numba.njit(inline="always", cache=True)
def _decode_item(q, kflat, vflat, lut, koff, kvh, g, row, p, window, scale, out):  # type: ignore[no-untyped-def]
    """A one-token request's work item: KV head kvh's g query heads of q's row (position
    p) in `ggml_vec_dot_f16`'s orders."""
    dh, nk = q.shape[2], koff.shape[0]
    q16 = np.empty(dh, np.float32)
    s, e = np.empty(nk, np.float32), np.empty(nk, np.float32)
    vacc = np.empty(DOT * dh, np.float32)
    for gi in range(g):
        _query_row(q, row, kvh * g + gi, lut, q16)
        _vec_dot_scores(kflat, koff, q16, p, dh, scale, s)
        _mask_softmax(s, p, nk, window, e)
        _vec_dot_values(vflat, koff, s, p, dh, vacc, out, row, kvh * g + gi)


@numba.njit(inline="always", cache=True)
def _tile_item(q, kflat, vflat, lut, koff, kvh, g, first, ctx, nt, window, scale, out):  # type: ignore[no-untyped-def]
    """A work item of a step of several tokens: KV head kvh's g query heads of q's rows
    first .. first + nt - 1 (positions ctx ..) in tinyBLAS<8>'s orders, ROWS (token, head)
    rows at a time against the keys."""
    dh, nk = q.shape[2], koff.shape[0]
    kf2, vb = np.empty(nk * dh, np.float32), np.empty(nk * dh, np.float32)
    _pair_rows(kflat, koff, dh, kf2)
    _value_blocks(vflat, koff, dh, vb)
    q16, q2 = np.empty(dh, np.float32), np.zeros(ROWS * 2 * dh, np.float32)
    s, e = np.empty((ROWS, nk), np.float32), np.empty(nk, np.float32)
    total = nt * g
    for r0 in range(0, total, ROWS):
        count = min(ROWS, total - r0)
        for r in range(count):
            _query_row(q, first + (r0 + r) // g, kvh * g + (r0 + r) % g, lut, q16)
            _doubled(q16, q2, r)
        _tile_scores(kf2, q2, ctx + (r0 + count - 1) // g, dh, scale, s)
        for r in range(count):
            p = ctx + (r0 + r) // g
            n = -(-(p + 1) // DOT) * DOT
            _mask_softmax(s[r], p, n, window, e)
            _tiny_values(vb, s[r], n, dh, nk, out, first + (r0 + r) // g,
                         kvh * g + (r0 + r) % g)


def _item_for(one_token: bool) -> Callback:
    """`ggml_attention._attend`'s loop body in 8-lane orders, its arguments as
    `ggml_attention._item_for`'s."""
    def item(q_p, t, heads, dh, k_p, v_p, blocks, cells, hk, lut_p, qs_p, ql_p, c0_p, reqs,
             tab_p, width, block_size, scale, window, r, kvh, t0, out_p):  # type: ignore[no-untyped-def]
        q, out = carray(q_p, (t, heads, dh)), carray(out_p, (t, heads, dh))
        lut, table = carray(lut_p, (1 << 16,)), carray(tab_p, (reqs, width))[r]
        first = carray(qs_p, (reqs + 1,))[r] + t0
        ctx = carray(c0_p, (reqs,))[r] + t0
        nt = 1 if one_token else min(TILE, carray(ql_p, (reqs,))[r] - t0)
        size = blocks * cells * hk * dh
        kflat, vflat = carray(k_p, (size,)), carray(v_p, (size,))
        last = ctx + nt - 1
        koff = np.zeros(-(-(last + 1) // DOT) * DOT, np.int64)    # past last: offset 0
        _key_offsets(table, block_size, cells, hk, dh, kvh, last, koff)
        if one_token:
            _decode_item(q, kflat, vflat, lut, koff, kvh, heads // hk, first, ctx, window,
                         scale, out)
        else:
            _tile_item(q, kflat, vflat, lut, koff, kvh, heads // hk, first, ctx, nt, window,
                       scale, out)
    return callback(*_ITEM_ARGS, exact=True)(item)


DECODE_ITEM, PREFILL_ITEM = _item_for(True), _item_for(False)
