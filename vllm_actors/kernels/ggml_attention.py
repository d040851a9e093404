"""Attention over a float16 cache as llama.cpp's CPU path computes it (flash attention off,
its default), for the quantized GGUF semantics on the numpy and cpu backends.

Per query row (ggml's non-flash graph: mul_mat, soft_max, mul_mat):
- Q rounded to float16; scores = K . Q as ggml multiplies float16 rows: a step of several
  query tokens through llamafile's tinyBLAS (16 lanes, one fused multiply-add chain per lane
  over the row, then `_mm512_reduce_add_ps`), a one-token step through `ggml_vec_dot_f16`
  (4 accumulators of 16 lanes over chunks of 64, combined, then the same reduction); a
  prompt's row that a step holds alone (a prefix-cache hit's last row, a chunk of one) in
  the several-token order of llama.cpp's call of the whole prompt (`one_token`);
- soft_max: scores * scale, masked keys -inf, exp by `ggml_math.expf16` per 16 keys, each
  16's sum reduced in float32 and added in float64; probabilities scaled by float32(1 / sum)
  and rounded to float16;
- out = P . V in the same two orders over the context (the cache is padded to 256 cells in
  llama.cpp; the padding is zeros, which add nothing).
Keys past a sliding window are masked as llama.cpp masks them. The 16-lane orders are those
of a llama.cpp built with AVX-512 (`ggml_math.ggml_width`); bench/llamacpp_tensors.py shows
them bit for bit on llama.cpp's inputs. A build without AVX-512 computes in 8 lanes: its
work items are `ggml_attention8`'s, run by the same `_attend` and layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numba
import numpy as np
from numba import carray, prange

from vllm_actors.kernels.cpu.intrinsics import (
    call_address,
    data_pointer,
    fma16,
    key_tile,
    prefetch,
    reduce16x16,
    reduce64,
    stack_f32,
    widen16,
)
from vllm_actors.kernels.cpu.jit import Callback, callback, kernel
from vllm_actors.kernels.ggml_attention_parts import (
    _ITEM_ARGS,
    TILE,
    _cell,
    _half,
    _half_unit,
    _key_offsets,
    shifted_exps,
)
from vllm_actors.kernels.ggml_math import NORMAL_HIGH, NORMAL_LOW, expf16, expf16_normal

LANES = 16
PAD = 256                    # llama.cpp's KV cells per padding step (n_kv)


class GgmlCache(NamedTuple):
    """A float16 (K, V) cache slot `[num_blocks, block_size, Hk, Dh]` (uint16 bits) that
    attention reads the llama.cpp way (`KVFormat.ggml_products`)."""

    k: np.ndarray
    v: np.ndarray


@numba.njit(inline="always", cache=True)
def _reduce16(a):  # type: ignore[no-untyped-def]
    """a[0] + ... + a[15] as GCC's `_mm512_reduce_add_ps`: halves, quarters, then pairs."""
    t0, t1, t2, t3 = a[8] + a[0], a[9] + a[1], a[10] + a[2], a[11] + a[3]
    t4, t5, t6, t7 = a[12] + a[4], a[13] + a[5], a[14] + a[6], a[15] + a[7]
    return ((t4 + t0) + (t6 + t2)) + ((t5 + t1) + (t7 + t3))


@numba.njit(cache=True)
def _softmax16(s, n, e):  # type: ignore[no-untyped-def]
    """s[:n] (n a multiple of 16) -> float16-rounded probabilities, as ggml's soft_max: the
    row's float32 max, x - max in float32 (as ggml subtracts it) per element, exp, each 16's
    sum reduced in `_mm512_reduce_add_ps`' order and added in float64, then scaled by
    float32(1 / sum) and rounded. Pass by pass over the row, each a loop LLVM vectorizes
    (one 16 at a time did not: 2.3 ns a key); exp outside its normal range (masked keys'
    -inf) redone after. e: scratch of n floats."""
    first, last = shifted_exps(s, n, e, expf16_normal)
    if last >= 0:
        _exp_outside(s, first - first % LANES, last + 1, e)
    inv = np.float32(1.0 / _chunk_sums(e, n))
    for i in range(n):
        s[i] = _half_unit(np.float32(e[i] * inv))


@numba.njit(inline="always", cache=True)
def _exp_outside(x, start, stop, e):  # type: ignore[no-untyped-def]
    """e[i] = `expf16`(x[i]) where x[i] (start <= i < stop) is outside exp's normal range,
    looked for 16 at a time (a test of 16 vectorizes; a branch a key took 1 ns). start: a
    multiple of 16."""
    for c in range(start, stop, LANES):
        outside = 0
        for lane in range(LANES):
            outside += not NORMAL_LOW <= x[c + lane] <= NORMAL_HIGH
        if outside:
            for lane in range(LANES):
                if not NORMAL_LOW <= x[c + lane] <= NORMAL_HIGH:
                    e[c + lane] = expf16(x[c + lane])


@numba.njit(inline="always", cache=True)
def _chunk_sums(e, n):  # type: ignore[no-untyped-def]
    """The float64 sum, in order, of `_reduce16` of each 16 of e[:n] (n a multiple of 16):
    16 of those reductions at once by `intrinsics.reduce16x16`, the rest one by one."""
    sums = stack_f32(LANES)
    total = 0.0
    whole = n - n % (LANES * LANES)
    for c in range(0, whole, LANES * LANES):
        reduce16x16(e, c, sums, 0)
        for k in range(LANES):
            total += np.float64(sums[k])
    for c in range(whole, n, LANES):
        total += np.float64(_reduce16(e[c:c + LANES]))
    return total





@numba.njit(cache=True)
def _scores(q16, kc, table, block_size, kvh, pos, window, one_token, scale, s, kt, acc,
            krow):  # type: ignore[no-untyped-def]
    """s[i, :] = the scores of query row i (position pos[i]) against every key up to the
    tile's last position, masked keys -inf. 16 keys at a time, one per vector lane: each
    lane runs the dot in ggml's order (`_dot`), so a vector op advances 16 dots at once;
    kt holds the 16 keys' rows transposed ([Dh, 16]), decoded one value at a time. The
    per-lane reference of the paths the steps take (`tests/kernels/test_ggml_attention.py`):
    `_tile_scores` (steps of several tokens), and in its `one_token` form `_decode_scores`."""
    rows, dh = q16.shape
    last = pos.max()
    tiny = stack_f32(256)        # 16 x 16: tinyBLAS's 16 accumulators of 16 keys, in registers
    for j0 in range(0, last + 1, LANES):
        for lane in range(LANES):
            j = j0 + lane
            if j <= last:
                blk = table[j // block_size]
                for d in range(dh):
                    kt[d * LANES + lane] = _cell(kc[blk, j % block_size, kvh, d])
            else:
                for d in range(dh):
                    kt[d * LANES + lane] = 0.0
        for i in range(rows):
            if one_token:
                _dots16(q16, i, kt, dh, one_token, acc, krow)
            else:
                _tiny_dots16(q16, i, kt, dh, tiny, krow)
            _store_scores(s, i, j0, krow, pos[i], window, scale)


DOT_TILE = 16     # dots a register tile carries: 16 accumulators of 16 lanes, rows x columns
# of 4 x 4 (scores: query rows x keys) or 8 x 2 (P . V: query rows x output dimensions)


@numba.njit(inline="always", cache=True)
def _dot_tile(a, ai, a_row, a_step, b, bi, b_row, b_step, steps, rows, acc, out):  # type: ignore[no-untyped-def]
    """out[r C + c] = the dot of a's row r and b's row c (C = DOT_TILE / rows columns; a row
    is `steps` vectors of 16, `*_step` apart, rows `*_row` apart from `*i`, flat float32
    arrays) in tinyBLAS's order: element e of each dot chained onto lane e % 16 of its own
    accumulator, then `_mm512_reduce_add_ps` (`reduce16x16`, the 16 dots at once). Each
    vector loaded feeds C or `rows` of the 16 chains, where a key-per-lane form broadcast a
    query value for every product. acc: a stack array of 256 (LLVM keeps it in registers);
    `rows` a literal."""
    cols = DOT_TILE // rows
    for x in range(DOT_TILE * LANES):
        acc[x] = 0.0
    for k in range(steps):
        for r in range(rows):
            for c in range(cols):
                fma16(acc, (r * cols + c) * LANES, b, bi + c * b_row + k * b_step, a,
                      ai + r * a_row + k * a_step)
    reduce16x16(acc, 0, out, 0)


@numba.njit(cache=True)
def _tile_scores(q16, kf, pos, scale, s):  # type: ignore[no-untyped-def]
    """`_scores` of a step of several tokens (tinyBLAS's order) from the keys' rows as
    float32 (kf `[keys padded to 16, Dh]`, flat): 4 query rows x 4 keys a register tile
    (`_dot_tile`), the keys 16 at a time so that their rows stay in L1 while the query rows
    pass. q16: rows padded to a multiple of 4 (pos has the real ones). Masked keys are
    the caller's (`_tile_item`): keys past every row's position in a tile are left unwritten,
    the rest scaled, so that a tile's stores need no test."""
    n, dh = pos.shape[0], q16.shape[1]
    width = s.shape[1]
    flat = s.reshape(-1)
    last = pos[n - 1]            # rows come in the order of their positions
    acc, dots = stack_f32(256), stack_f32(16)
    for j0 in range(0, last + 1, LANES):
        for i in range(0, n, 4):
            top = pos[min(i + 3, n - 1)]
            for c0 in range(j0, min(j0 + LANES, top + 1), 4):
                _dot_tile(q16, i * dh, dh, LANES, kf, c0 * dh, dh, LANES, dh // LANES, 4,
                          acc, dots)
                for r in range(min(4, n - i)):
                    at = np.uint64((i + r) * width + c0)     # unsigned: no wraparound test
                    for c in range(4):
                        flat[at + np.uint64(c)] = np.float32(dots[4 * r + c] * scale)


@numba.njit(inline="always", cache=True)
def _store_scores(s, i, j0, dots, p, window, scale):  # type: ignore[no-untyped-def]
    """s[i, j0 + l] = dots[l] * scale for the 16 keys from j0, -inf where a query at position
    p must not see them (past p, or past its sliding window)."""
    for lane in range(LANES):
        j = j0 + lane
        if j > p or (window > 0 and j <= p - window):
            s[i, j] = -np.inf
        else:
            s[i, j] = np.float32(dots[lane] * scale)


@numba.njit(inline="always", cache=True)
def _dots16(q, i, kt, dh, one_token, acc, out):  # type: ignore[no-untyped-def]
    """out[l] = q[i] . key l for the 16 keys in kt ([Dh, 16]; float32 holding float16 values),
    each in ggml's order: tinyBLAS (16 accumulators, element d into d % 16, a fused chain)
    or, for a one-token step, `ggml_vec_dot_f16` (64 accumulators over chunks of 64, then
    (a0 + a2) + (a1 + a3) per lane, leftovers added in float64); then the reduction of
    `_mm512_reduce_add_ps`. acc: scratch of 64 x 16 (acc[a * 16 + l], accumulator a of key l)."""
    count = LANES if not one_token else 64
    for a in range(count * LANES):
        acc[a] = 0.0
    if not one_token:       # tinyBLAS: accumulator d % 16, a chain over d // 16
        for d in range(dh):
            fma16(acc, (d % LANES) * LANES, kt, d * LANES, q[i, d], 0)
        _tree16(acc, LANES, out)
        return
    whole = dh - dh % 64    # vec_dot_f16: accumulator d % 64 over chunks of 64, combined
    for d in range(whole):
        fma16(acc, (d % 64) * LANES, kt, d * LANES, q[i, d], 0)
    for a in range(LANES):
        for lane in range(LANES):
            acc[a * LANES + lane] = ((acc[a * LANES + lane] + acc[(32 + a) * LANES + lane])
                                     + (acc[(16 + a) * LANES + lane]
                                        + acc[(48 + a) * LANES + lane]))
    _tree16(acc, LANES, out)
    for lane in range(LANES):
        total = np.float64(out[lane])
        for d in range(whole, dh):
            total += np.float64(q[i, d] * kt[d * LANES + lane])
        out[lane] = np.float32(total)


@numba.njit(inline="always", cache=True)
def _tiny_dots16(q, i, kt, dh, acc, out):  # type: ignore[no-untyped-def]
    """`_dots16`'s tinyBLAS order (element d into accumulator d % 16, a chain over d // 16)
    with acc a stack array of 16 x 16 indexed by constants only: each chain's 16 steps are
    unrolled, so the accumulators stay in registers."""
    for a in range(LANES):
        for lane in range(LANES):
            acc[a * LANES + lane] = 0.0
    for d0 in range(0, dh, LANES):
        for a in range(LANES):
            fma16(acc, a * LANES, kt, (d0 + a) * LANES, q[i, d0 + a], 0)
    _tree16(acc, LANES, out)


@numba.njit(inline="always", cache=True)
def _tree16(acc, n, out):  # type: ignore[no-untyped-def]
    """out[c] = `_reduce16` of acc[c], acc[n + c], ..., acc[15n + c] for c < n (16
    accumulators of n columns: the keys of a score tile, or output dimensions)."""
    for c in range(n):
        t0 = acc[8 * n + c] + acc[c]
        t1 = acc[9 * n + c] + acc[n + c]
        t2 = acc[10 * n + c] + acc[2 * n + c]
        t3 = acc[11 * n + c] + acc[3 * n + c]
        t4 = acc[12 * n + c] + acc[4 * n + c]
        t5 = acc[13 * n + c] + acc[5 * n + c]
        t6 = acc[14 * n + c] + acc[6 * n + c]
        t7 = acc[15 * n + c] + acc[7 * n + c]
        out[c] = ((t4 + t0) + (t6 + t2)) + ((t5 + t1) + (t7 + t3))


AHEAD = 16        # keys between a row's prefetch and its use: the cache mostly comes from
# memory, the step's weights having streamed through the caches since the layer wrote it


@numba.njit(inline="always", cache=True)
def _prefetch_key(kflat, vflat, off, dh):  # type: ignore[no-untyped-def]
    """Hint a key's K and V rows (dh float16 values from off) into L2, a line at a time."""
    for d in range(0, dh, 32):
        prefetch(kflat, off + d)
        prefetch(vflat, off + d)


@numba.njit(cache=True)
def _decode_scores(q16, kflat, vflat, koff, p, window, scale, s):  # type: ignore[no-untyped-def]
    """A one-token step's scores, as `_scores` gives them in `ggml_vec_dot_f16`'s order, one
    key at a time (its row at kflat[koff[j]:], `_key_offsets`, converted 16 halves at a time
    as it is multiplied), and for each query row the products of chunk c of 64 chained onto
    accumulator d % 64, the four 16-lane registers combined as (r0 + r2) + (r1 + r3),
    `_reduce16`, and leftovers past the last whole 64 added in float64. All of it runs along
    vectors (`intrinsics.reduce64` ends the dot with shuffles in the reduction's order),
    where `_dots16` put one key per lane. The rows AHEAD keys on (K's and vflat's V) are
    prefetched as it goes."""
    rows, dh = q16.shape
    whole = dh - dh % 64
    acc = stack_f32(64)          # on the stack: LLVM keeps them in registers
    for j in range(p + 1):
        if window > 0 and j <= p - window:
            for i in range(rows):
                s[i, j] = -np.inf
            continue
        if j + AHEAD <= p:       # this head's rows of keys and values to come, into L2
            _prefetch_key(kflat, vflat, koff[j + AHEAD], dh)
        key = koff[j]
        for i in range(rows):
            for a in range(64):
                acc[a] = 0.0
            for c in range(0, whole, 64):
                for r in range(0, 64, LANES):
                    fma16(acc, r, kflat, key + c + r, q16, i * dh + c + r)
            dot = reduce64(acc, 0)
            if whole < dh:
                total = np.float64(dot)
                for d in range(whole, dh):
                    total += np.float64(q16[i, d] * _cell(kflat[key + d]))
                dot = np.float32(total)
            s[i, j] = np.float32(dot * scale)


@numba.njit(inline="always", cache=True)
def _values(vc, table, block_size, kvh, last, vbuf):  # type: ignore[no-untyped-def]
    """vbuf[j Dh : (j + 1) Dh] = value row j as float32, for keys j <= last."""
    dh = vc.shape[3]
    for j in range(last + 1):
        blk = table[j // block_size]
        for d in range(dh):
            vbuf[j * dh + d] = _cell(vc[blk, j % block_size, kvh, d])


ROWS = 4          # query rows `_decode_values` carries at once (s padded to a multiple)
_CHAINS = 4 * ROWS * LANES      # its accumulators: 4 chains of 16 lanes a row
TILE_ROWS = 8     # query rows of `_tile_values`' register tiles (s padded to a multiple)


@numba.njit(inline="always", cache=True)
def _chain(acc, base, vflat, koff, a, step, p, s, i0, d0, rows):  # type: ignore[no-untyped-def]
    """ggml's accumulator a (of `step`: 64 for vec_dot, 16 for tinyBLAS) of the output dims
    d0 .. d0+15 for query rows i0 + i (i < rows): acc[(base + i) 16 ..] chains keys a, a +
    step, ... <= p, each value row (at vflat[koff[j]:]) converted once for the rows."""
    for j in range(a, p + 1, step):
        off = koff[j] + d0
        for i in range(rows):
            fma16(acc, (base + i) * LANES, vflat, off, s[i0 + i, j], 0)


@numba.njit(cache=True)
def _decode_values(vflat, koff, p, s, comb, out):  # type: ignore[no-untyped-def]
    """A one-token step's P . V as `_weighted_values` gives it (`ggml_vec_dot_f16`'s
    order: key j chained onto lane j % 64 of every output dimension, the 64 lanes combined
    as the scores' are), 16 dimensions and ROWS query rows at a time: for each of the
    reduction's 16 lanes l, its four chains (l, 16 + l, 32 + l, 48 + l) stay in registers and
    are combined at once, then `_tree16` along the dimensions. Every key's product is
    chained, where the per-lane form skips zero probabilities: the same floats, as a sum
    that starts at +0 never holds -0 (products of nonzero float16s do not underflow in
    float32), so adding 0 * v leaves it as it is. comb: scratch of ROWS x 16 x 16; s: at
    least a multiple of ROWS rows (the rows past out's are read, not used)."""
    rows, dh = out.shape
    acc = stack_f32(_CHAINS)       # chain r of row i at (r ROWS + i) 16
    for i0 in range(0, rows, ROWS):
        for d0 in range(0, dh, LANES):
            for lane in range(LANES):
                for a in range(_CHAINS):
                    acc[a] = 0.0
                _chain(acc, 0, vflat, koff, lane, 64, p, s, i0, d0, ROWS)
                _chain(acc, ROWS, vflat, koff, 16 + lane, 64, p, s, i0, d0, ROWS)
                _chain(acc, 2 * ROWS, vflat, koff, 32 + lane, 64, p, s, i0, d0, ROWS)
                _chain(acc, 3 * ROWS, vflat, koff, 48 + lane, 64, p, s, i0, d0, ROWS)
                for i in range(ROWS):
                    for e in range(LANES):
                        r0, r1 = acc[i * LANES + e], acc[(ROWS + i) * LANES + e]
                        r2, r3 = acc[(2 * ROWS + i) * LANES + e], acc[(3 * ROWS + i) * LANES + e]
                        comb[(i * LANES + lane) * LANES + e] = (r0 + r2) + (r1 + r3)
            for i in range(min(ROWS, rows - i0)):
                _tree16(comb[i * LANES * LANES:], LANES, out[i0 + i, d0:])


@numba.njit(cache=True)
def _tile_values(vt, nk, s, pos, out):  # type: ignore[no-untyped-def]
    """A tile's P . V in tinyBLAS's order, as `_weighted_values` gives it: key j chained onto
    lane j % 16 of its output's accumulator, then the reduction across the lanes; 8 query
    rows x 2 output dimensions a register tile (`_dot_tile`: a row of P and a column of V
    a vector at a time). vt: the values transposed (`[Dh, nk]`, flat), so a dimension's
    keys are contiguous. s: each row's probabilities over the first nk keys, zeros past its
    own (as `_decode_values`, whose docstring says why chaining zero probabilities changes
    no float, nor leaving out the 16s of keys past a tile's last position), rows padded to
    a multiple of TILE_ROWS; pos: each row's position."""
    rows, dh = out.shape
    width = s.shape[1]
    flat = s.reshape(-1)
    acc, dots = stack_f32(256), stack_f32(16)
    for i in range(0, rows, TILE_ROWS):
        steps = pos[min(i + TILE_ROWS, rows) - 1] // LANES + 1    # rows in position order
        for d in range(0, dh, 2):
            _dot_tile(flat, i * width, width, LANES, vt, d * nk, nk, LANES, steps,
                      TILE_ROWS, acc, dots)
            for r in range(min(TILE_ROWS, rows - i)):
                out[i + r, d] = dots[2 * r]
                out[i + r, d + 1] = dots[2 * r + 1]


@numba.njit(cache=True)
def _weighted_values(vc, table, block_size, kvh, pos, one_token, s, acc, vbuf, out):  # type: ignore[no-untyped-def]
    """out[i, :] = P[i] . V in ggml's order: lane j % 16 (tinyBLAS) or j % 64 (vec_dot) of
    each output dimension chains the keys j in order (acc `[lanes, Dh]`, 16 dimensions a
    vector). The V rows are decoded once into vbuf; a row's accumulators stay in L1 while
    the keys stream past. The per-lane reference (as `_scores`) of `_tile_values` and, in
    its `one_token` form, `_decode_values`."""
    rows, dh = out.shape
    width = 64 if one_token else LANES
    _values(vc, table, block_size, kvh, pos.max(), vbuf)
    lanes = np.empty(64, np.float32)
    for i in range(rows):
        for a in range(width * dh):
            acc[a] = 0.0
        for j in range(pos[i] + 1):
            p = s[i, j]
            if p != 0:
                base = (j % width) * dh
                for d0 in range(0, dh, LANES):
                    fma16(acc, base + d0, vbuf, j * dh + d0, p, 0)
        if not one_token:       # the 16 lanes of every dimension at once, along d
            _tree16(acc, dh, out[i])
            continue
        for d in range(dh):
            for lane in range(width):
                lanes[lane] = acc[lane * dh + d]
            for lane in range(LANES):
                lanes[lane] = (lanes[lane] + lanes[32 + lane]) + (lanes[16 + lane]
                                                                  + lanes[48 + lane])
            out[i, d] = _reduce16(lanes)




def _item_for(one_token: bool) -> Callback:
    """`_attend`'s loop body for the items of one-token steps (`one_token`) or of steps of
    several tokens, as two callbacks: a process compiles only the paths its steps take (the
    cold-start helper of `workers.warm_up` compiles the second while the engine runs its
    one-token step). The arrays come as pointers and shapes."""
    def item(q_p, t, heads, dh, k_p, v_p, blocks, cells, hk, lut_p, qs_p, ql_p, c0_p, reqs,
             tab_p, width, block_size, scale, window, r, kvh, t0, out_p):  # type: ignore[no-untyped-def]
        q, out = carray(q_p, (t, heads, dh)), carray(out_p, (t, heads, dh))
        lut, table = carray(lut_p, (1 << 16,)), carray(tab_p, (reqs, width))[r]
        first = carray(qs_p, (reqs + 1,))[r] + t0      # the tile's first query row
        ctx = carray(c0_p, (reqs,))[r] + t0           # its position
        g = heads // hk
        if one_token:
            size = blocks * cells * hk * dh
            _decode_item(q, carray(k_p, (size,)), carray(v_p, (size,)), lut, table,
                         block_size, cells, hk, kvh, g, first, ctx, window, scale, out)
            return
        kc, vc = carray(k_p, (blocks, cells, hk, dh)), carray(v_p, (blocks, cells, hk, dh))
        nt = min(TILE, carray(ql_p, (reqs,))[r] - t0)
        _tile_item(q, kc, vc, lut, table, block_size, kvh, g, first, ctx, nt, window, scale,
                   out)
    return callback(*_ITEM_ARGS, exact=True)(item)


@numba.njit(inline="always", cache=True)
def _tile_item(q, kc, vc, lut, table, block_size, kvh, g, first, ctx, nt, window, scale,
               out):  # type: ignore[no-untyped-def]
    """A work item of a step of several tokens: KV head kvh's g query heads of q's rows
    first .. first + nt - 1 (positions ctx ..) over the cache slots, into out's rows.
    Inlined into its callback, as `_decode_item`."""
    dh, cells, hk = q.shape[2], kc.shape[1], kc.shape[2]
    n = nt * g
    q16 = _queries16(q, first, nt, kvh, g, lut, 4, _aligned(-(-n // 4) * 4 * dh))
    pos = np.empty(n, np.int64)
    for ti in range(nt):
        pos[ti * g:(ti + 1) * g] = ctx + ti
    last = ctx + nt - 1
    nk = -(-(last + 1) // LANES) * LANES
    koff = np.zeros(nk, np.int64)   # past last: offset 0
    _key_offsets(table, block_size, cells, hk, dh, kvh, last, koff)
    kf, vt = _float_keys(kc.reshape(-1), vc.reshape(-1), koff, dh)
    padded = -(-n // TILE_ROWS) * TILE_ROWS
    s = _aligned(padded * nk).reshape(padded, nk)
    s[:] = 0.0
    _tile_scores(q16, kf, pos, scale, s)
    scratch = np.empty(nk, np.float32)
    for i in range(n):
        m = ((pos[i] + LANES) // LANES) * LANES      # whole 16s; past them exp is 0
        for j in range(pos[i] + 1, m):
            s[i, j] = -np.inf
        if window > 0:                               # past the sliding window
            for j in range(pos[i] - window + 1):
                s[i, j] = -np.inf
        _softmax16(s[i], m, scratch)
        s[i, m:] = 0.0
    rows = np.empty((n, dh), np.float32)
    _tile_values(vt, nk, s, pos, rows)
    _put_rows(out, rows, first, nt, kvh, g)


@numba.njit(inline="always", cache=True)
def _aligned(n):  # type: ignore[no-untyped-def]
    """n float32s (not set) from a 64-byte boundary: a register tile's vector loads each
    within one cache line (a tile of P . V on rows 16 bytes off: 0.8 FMA a cycle, aligned
    1.2)."""
    a = np.empty(n + LANES, np.float32)
    skip = (-a.ctypes.data) % 64 // 4
    return a[skip:skip + n]


@numba.njit(inline="always", cache=True)
def _float_keys(kflat, vflat, koff, dh):  # type: ignore[no-untyped-def]
    """(K's rows as float32, `[keys, Dh]`; V's transposed, `[Dh, keys]`, by
    `intrinsics.key_tile`) of the keys at koff (a multiple of 16 of them), converted once
    for a work item's rows."""
    nk = koff.shape[0]
    kf, vt = _aligned(nk * dh), _aligned(nk * dh)
    for j in range(nk):
        for d in range(0, dh, LANES):
            widen16(kf, j * dh + d, kflat, koff[j] + d)
    for j0 in range(0, nk, LANES):
        for d0 in range(0, dh, LANES):
            key_tile(vflat, koff, j0, d0, vt[j0:], nk)
    return kf, vt


_DECODE_ITEM, _PREFILL_ITEM = _item_for(True), _item_for(False)


@numba.njit(inline="always", cache=True)
def _decode_item(q, kflat, vflat, lut, table, block_size, cells, hk, kvh, g, row, p, window,
                 scale, out):  # type: ignore[no-untyped-def]
    """A one-token request's work item: KV head kvh's g query heads of q's row `row` (at
    position p) over the flat cache slots, into out's row. Inlined into its callback, its
    one caller, so that its code is generated there only (`jit.Callback`)."""
    dh = q.shape[2]
    q16 = _queries16(q, row, 1, kvh, g, lut, 1, np.empty(g * q.shape[2], np.float32))
    koff = np.empty(p + 1, np.int64)
    _key_offsets(table, block_size, cells, hk, dh, kvh, p, koff)
    m = ((p + LANES) // LANES) * LANES      # whole 16s; past them exp is 0
    s = np.zeros((-(-g // ROWS) * ROWS, m), np.float32)
    for j in range(min(AHEAD, p + 1)):
        _prefetch_key(kflat, vflat, koff[j], dh)
    _decode_scores(q16, kflat, vflat, koff, p, window, scale, s)
    scratch = np.empty(m, np.float32)
    for i in range(g):
        for j in range(p + 1, m):
            s[i, j] = -np.inf
        _softmax16(s[i], m, scratch)
    rows = np.empty((g, dh), np.float32)
    _decode_values(vflat, koff, p, s, np.empty(ROWS * LANES * LANES, np.float32), rows)
    _put_rows(out, rows, row, 1, kvh, g)


@numba.njit(inline="always", cache=True)
def _queries16(q, first, nt, kvh, g, lut, pad, flat):  # type: ignore[no-untyped-def]
    """KV head kvh's g query heads of q's rows first .. first + nt - 1, rounded to float16
    (as float32), token by token: row ti g + gi for head gi of token ti; rows of zeros up
    to a multiple of `pad`. flat: the storage (that many rows)."""
    dh = q.shape[2]
    q16 = flat.reshape(-(-nt * g // pad) * pad, dh)
    q16[nt * g:] = 0.0              # the padding rows only: the rest is written below
    for ti in range(nt):
        for gi in range(g):
            for d in range(dh):
                q16[ti * g + gi, d] = _half(q[first + ti, kvh * g + gi, d], lut)
    return q16


@numba.njit(inline="always", cache=True)
def _put_rows(out, rows, first, nt, kvh, g):  # type: ignore[no-untyped-def]
    """`_queries16`'s rows' outputs back into out's rows first .. and KV head kvh's heads,
    element by element: a slice assignment compiles numba's shape-mismatch message (1.3 s
    of a cold start)."""
    for ti in range(nt):
        for gi in range(g):
            for d in range(rows.shape[1]):
                out[first + ti, kvh * g + gi, d] = rows[ti * g + gi, d]


@kernel(parallel=True, exact=True)
def _attend(decode, prefill, q, kc, vc, lut, q_start, q_lens, ctx0, tables, block_size, scale,
            window, items, one, out):  # type: ignore[no-untyped-def]
    """Each work item (request r, KV head, tile of up to TILE query tokens; `_work_items`)
    on its own, by the callback at the address `decode` (`one[r]`: a one-token request) or
    `prefill`: rows are independent, so how items share threads changes no value."""
    t, heads, dh = q.shape
    blocks, cells, hk = kc.shape[0], kc.shape[1], kc.shape[2]
    for u in prange(items.shape[0]):
        r = items[u, 0]
        call_address(decode if one[r] else prefill, (
            data_pointer(q), t, heads, dh, data_pointer(kc), data_pointer(vc), blocks, cells,
            hk, data_pointer(lut), data_pointer(q_start), data_pointer(q_lens),
            data_pointer(ctx0), q_lens.shape[0], data_pointer(tables), tables.shape[1],
            block_size, scale, window, r, items[u, 1], items[u, 2], data_pointer(out)))


def _items() -> tuple[Callback, Callback]:
    """The (one-token, several-token) work items in the orders of the host's llama.cpp: 16
    lanes here, 8 in `ggml_attention8` (a build without AVX-512)."""
    from vllm_actors.kernels.ggml_math import ggml_width
    if ggml_width() == LANES:
        return _DECODE_ITEM, _PREFILL_ITEM
    from vllm_actors.kernels import ggml_attention8
    return ggml_attention8.DECODE_ITEM, ggml_attention8.PREFILL_ITEM


def compile_prefill() -> None:
    """Compile (or load from the cache) the work item of steps of several tokens."""
    _items()[1].address   # noqa: B018


def _work_items(q_lens: np.ndarray, ctx0: np.ndarray, hk: int) -> np.ndarray:
    """(request, KV head, first query token) of each tile, ordered so that the equal
    contiguous shares numba gives its threads hold equal work: sorted by the keys a tile
    reads, then dealt from both ends (the longest with the shortest)."""
    items = [(r, h, t0) for r in range(len(q_lens)) for h in range(hk)
             for t0 in range(0, int(q_lens[r]), TILE)]
    items.sort(key=lambda it: ctx0[it[0]] + it[2])
    dealt = [items[i // 2] if i % 2 == 0 else items[-1 - i // 2] for i in range(len(items))]
    return np.array(dealt, np.int64).reshape(-1, 3)


def reads(fmt, head_dim: int, softcap: float = 0.0, sinks=None) -> bool:  # type: ignore[no-untyped-def]
    """Whether attention over a cache of `fmt` takes this path: llama.cpp's products on a
    float16 cache (in the host's llama.cpp's lanes: 16, or 8 without AVX-512,
    `ggml_attention8`), head dimensions a multiple of 16, no soft-cap or sinks (those keep
    the backend's own attention, rounded as ggml rounds: `KVFormat`)."""
    from vllm_actors.kernels import kv_quant
    return (fmt is not None and fmt.ggml_products and fmt.kind == kv_quant.FLOAT16
            and head_dim % LANES == 0 and not softcap and sinks is None)


def one_token(query_start_loc: np.ndarray, seq_lens: np.ndarray,
              prompt_lens: np.ndarray | None) -> np.ndarray:
    """Which requests' one row llama.cpp computes in a call of one row (the one-token order):
    a decode, not a prompt's row that this step holds alone while llama.cpp's call of the
    whole prompt holds more (`qmatmul.RowPlaces`; `prompt_lens` None: every request's rows
    are a call of their own)."""
    from vllm_actors.kernels.cpu.qmatmul import prompt_call
    q_lens = np.diff(np.asarray(query_start_loc, np.int64))
    one = q_lens == 1
    if prompt_lens is None:
        return one
    pos = np.asarray(seq_lens, np.int64) - q_lens         # a one-row request's position
    prompt = np.asarray(prompt_lens, np.int64)
    inside = one & (pos < prompt)
    if not inside.any():                                  # decodes only
        return one
    return one & ~(inside & (prompt_call(pos, prompt)[1] > 1))


def _layout(query_start_loc: np.ndarray, seq_lens: np.ndarray, hk: int,
            prompt_lens: np.ndarray | None) -> tuple[Any, ...]:
    """(query starts, query lengths, context before the step, work items, the addresses of
    the one-token and several-token items' callbacks, 0 where no item takes it, and which
    requests take the one-token one) of a step."""
    q_start = np.asarray(query_start_loc, np.int64)
    q_lens = np.diff(q_start)
    ctx0 = np.asarray(seq_lens, np.int64) - q_lens
    one = one_token(q_start, seq_lens, prompt_lens)
    decode_item, prefill_item = _items()
    decode = decode_item.address if one.any() else 0
    prefill = 0 if one.all() else prefill_item.address
    return (q_start, q_lens, ctx0, _work_items(q_lens, ctx0, hk), decode, prefill,
            one.astype(np.uint8))


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, query_start_loc: np.ndarray,
           seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int, scale: float,
           window: int = 0, memo: dict | None = None,
           prompt_lens: np.ndarray | None = None) -> np.ndarray:
    """q [T, H, Dh] float32 over the float16 cache slot k, v (uint16 bits, `[num_blocks,
    block_size, Hk, Dh]`) -> [T, H, Dh], as llama.cpp computes it (module docstring).
    `memo`: a dict that lives as long as the step's layout (the backend's prepared
    attention), where the layout is kept for the step's other layers; `prompt_lens` as
    `AttentionMetadata`'s (`one_token`)."""
    from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT
    key = ("ggml", k.shape[2])
    layout = None if memo is None else memo.get(key)
    if layout is None:
        layout = _layout(query_start_loc, seq_lens, k.shape[2], prompt_lens)
        if memo is not None:
            memo[key] = layout
    q_start, q_lens, ctx0, items, decode, prefill, one = layout
    out = np.empty(q.shape, np.float32)
    if not (k.flags.c_contiguous and v.flags.c_contiguous):
        raise ValueError("ggml attention reads C-contiguous cache slots")
    _attend(decode, prefill, np.ascontiguousarray(q, np.float32), k, v, HALF_LUT, q_start,
            q_lens, ctx0, np.ascontiguousarray(block_tables, np.int32), int(block_size),
            np.float32(scale), int(window), items, one, out)
    return out
