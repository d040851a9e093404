"""The integer GEMV of the K-quants (Q4_K, Q5_K, Q6_K) on x's Q8_K blocks
(`activations.quantize_q8_k`), as llama.cpp's `vec_dot_q*_K_q8_K`: per superblock of 256,
the weights' unsigned quants times x's int8 quants times the sub-block scales as exact int32
lanes held in registers (`ktotals.superblock_lanes`), then scaled by d_w * d_x into 8 float
lanes (`qdot.kflush`).

With q the stored quants of x, d_x its scale and b_j its sums of 16 (`bsums`), per superblock:
  Q4_K, Q5_K: d_w d_x sum_s sc_s (w_s . q_s) - dmin_w d_x sum_s mn_s (b_2s + b_2s+1)
  Q6_K:       d_w d_x (sum_j scales_j (w_j . q_j) - 32 sum_j scales_j b_j)
(s the 8 sub-blocks of 32, j the 16 of 16; the layouts are `qmatmul_k45`'s), in the float
order of ggml's x86 (AVX2) dots: acc = fma(d_w d_x, lanes, acc) per superblock, Q4_K's mins
in 4 float lanes, Q5_K's in one sum, Q6_K's offset per integer lane, and the lanes added as
`hsum_float_8` adds them. llama.cpp computes some matmuls with other kernels, whose float
orders `matmul` takes where they would run (`row_kinds`): the GEMV and GEMM of Q4_K repacked
into 8-row blocks, and the tiled K-quant matmul at 8+ rows (`ktiled` runs the GEMM and most
of the tiled matmul: its decoded weight rows serve many rows of x; `krow` the repacked GEMV's
1-4 one-row requests, and Q6_K's vec_dot at any count, on weights stored interleaved,
decoding 16 weight rows in registers; no kernel here reads that layout). Compiled without fast
math: ggml's floats bit for bit. Parallel over pairs of weight rows, a body per (SIMD path, kind,
x-row group) called as a C callback, as the other integer GEMVs (`qmatmul_int`).
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
from gguf import GGMLQuantizationType
from numba import carray, prange, types
from numba.extending import overload

from vllm_actors.kernels.cpu import activations, isa, krow, ktiled
from vllm_actors.kernels.cpu.intrinsics import call_address, data_pointer, fma_f32, stack_i32
from vllm_actors.kernels.cpu.jit import Callback, callback, kernel
from vllm_actors.kernels.cpu.lora_gemv import lora_args, lora_loop
from vllm_actors.kernels.cpu.ktotals import (
    FLUSH_REPACKED,
    FLUSH_TILED_NO_MINS,
    lane_totals,
    min_terms,
    pair_flush,
    pair_totals,
    q6_offsets,
    superblock_lanes,
)
from vllm_actors.kernels.cpu.qdot import kflush
from vllm_actors.kernels.cpu.qmatmul import (SERIAL_MAX_WORK, QuantMatrix, one_row_each,
                                             prefetch_rows, row_places)
from vllm_actors.kernels.cpu.qmatmul_int import GROUP, MAX_ROWS, PAIRS, hsum8, pad_rows
from vllm_actors.kernels.cpu.qmatmul_prims import (
    HALF_LUT,
    kept,
    limit_threads,
    prefetch,
    restore_threads,
    stack_f32,
)

T = GGMLQuantizationType
KINDS = {T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}
# The literal `kind` is 10 * order + form: the form (4, 5, 6) decodes the superblock, the
# order is the float epilogue of the llama.cpp kernel that would compute this matmul.
# 44: Q4_K repacked into 8-row interleaved blocks (x86 with AVX2, a multiple of 8 rows, not
# an embedding), its GEMV (1-3 rows of x, and the rows past a multiple of 4): per row and
# superblock the whole integer dot in one sum, acc = fma(sum, d_w d_x, acc), the mins
# likewise, acc - mins at the end.
REPACKED_Q4_K = 44
# 84: the same weights' GEMM (4+ rows of x, in groups of 4): as 44 per pair of sub-blocks
# (`ktiled.GEMM`).
REPACKED_GEMM_Q4_K = 84
# 94, 95, 96: ggml's tiled K-quant matmul (`ggml-cpu/tiled`: 8+ rows of x, weights not
# repacked): per superblock r = fnmadd(dmin_w, mins, float(sum) * d_w), acc = fma(r, d_x, acc).
TILED = 90
TILED_MIN_ROWS = 8
# kind -> (`ktiled`'s float order, the fewest rows of x it takes): its weight rows, decoded
# once as the lanes of a vector, serve every row of x where the kernels here decode them again
# for each group of 4; below those counts the decoding costs more than it saves (Q6_K's six
# bits the most, and the 8B's large matrices). docs/BENCHMARKS.md, "The matmuls of many rows"
# (the repacked GEMV order from 8 rows since Q4_K decodes by transposing its stored bytes;
# on interleaved Q4_K, which needs no transposes, from 5: `_wide`).
# (a prompt chunk's rows can hold a run of GEMM rows shorter than 4: `ktiled` takes any)
_WIDE = {TILED + 4: (ktiled.TILED, 8), TILED + 5: (ktiled.TILED, 8),
         TILED + 6: (ktiled.TILED, 32), REPACKED_GEMM_Q4_K: (ktiled.GEMM, 1),
         REPACKED_Q4_K: (ktiled.GEMV, 8)}
_NO_BITS = np.zeros((0, 0), np.uint8)
_NO_U16 = np.zeros((0, 0), np.uint16)
_NO_F32 = np.zeros((0, 0), np.float32)


@functools.cache
def body(path: int, kind: int, group: int, dtypes: tuple[str, ...]) -> Callback:
    """`gemv`'s loop body for one SIMD path, kind and x-row group (compile-time constants),
    the planes of `dtypes` (qs, qh, sc, mn, d, dmin): pairs of weight rows [g0, g1), all
    rows of x, in groups of `group` (1 or 4; M a multiple of it), each group's sums in
    registers; a pair of weight rows is read from memory once, then from L1. W is Q4_K
    (kind 4: qh empty), Q5_K (5) or Q6_K (6: qs its low quants, sc its int8 scales, mn and
    dmin empty), or another kind's order of them (module constants)."""
    def pairs(qs_p, n, rb, qh_p, qh_r, hb, sc_p, sc_r, sc_c, mn_p, mn_r, mn_c, d_p, d_r, d_c,
              dm_p, dm_r, dm_c, lut_p, xq_p, m, k, xd_p, xd_c, xb_p, xb_c, out_p, dist, g0,
              g1):  # type: ignore[no-untyped-def]
        qs, qh, sc = carray(qs_p, (n, rb)), carray(qh_p, (qh_r, hb)), carray(sc_p, (sc_r, sc_c))
        mn, d, dmin = carray(mn_p, (mn_r, mn_c)), carray(d_p, (d_r, d_c)), carray(dm_p, (dm_r, dm_c))
        lut, xq, out = carray(lut_p, (1 << 16,)), carray(xq_p, (m, k)), carray(out_p, (m, n))
        xd, xb = carray(xd_p, (m, xd_c)), carray(xb_p, (m, xb_c))
        acc = stack_f32(64)
        iacc = stack_i32(64)
        am = stack_f32(32)          # Q4_K/Q5_K's min terms: 4 lanes per (x row, weight row)
        fw = stack_f32(24)          # the one-total kinds' factors per pair (`_pair_scales`)
        iw = stack_i32(40)          # their integer totals (0:8) and min terms (8:40)
        for g in range(g0, g1):
            r0 = 2 * g
            r1 = min(r0 + 1, n - 1)
            p0 = min(r0 + dist, n - 1) * rb
            p1 = min(r0 + dist + 1, n - 1) * rb
            for i in range(24):
                fw[i] = 0
            for m0 in range(0, m, group):
                for i in range(16 * group):
                    acc[i] = 0
                for i in range(8 * group):
                    am[i] = 0
                for sb in range(rb // 128):
                    for o in range(128 * sb, 128 * sb + 128, 32):
                        prefetch(qs, p0 + o)
                        prefetch(qs, p1 + o)
                    _step(path, kind, group, iacc, acc, am, fw, iw, qs, qh, sc, mn, d, dmin,
                          lut, r0, r1, rb, hb, sb, xq, m0 * k + 256 * sb, k, xd, xb, m0)
                for j in range(group):
                    out[m0 + j, r0] = _total(kind, acc, am, 16 * j, 8 * j)
                    if r0 + 1 < n:
                        out[m0 + j, r0 + 1] = _total(kind, acc, am, 16 * j + 8, 8 * j + 4)
    i64, f32 = types.int64, types.CPointer(types.float32)
    plane = [types.CPointer(numba.from_dtype(np.dtype(t))) for t in dtypes]
    return callback(plane[0], i64, i64, plane[1], i64, i64, plane[2], i64, i64, plane[3], i64,
                    i64, plane[4], i64, i64, plane[5], i64, i64, f32,
                    types.CPointer(types.int8), i64, i64, f32, i64,
                    types.CPointer(types.int16), i64, f32, i64, i64, i64, exact=True)(pairs)


@kernel(parallel=True, exact=True)
def gemv(fn, qs, qh, sc, mn, d, dmin, lut, xq, xd, xb, out, dist, threads, quantize, x):  # type: ignore[no-untyped-def]
    """out[M, N] = x @ W.T under the quantized semantics: the body at the address `fn`
    (`body`) on chunks of PAIRS pairs of weight rows, in parallel. Each output is computed
    the same way whichever thread takes its chunk. With `quantize` (the address of
    `activations.q8_k_blocks`, else 0) x's float rows are first quantized into xq/xd/xb on
    this thread, as `qmatmul_int.gemv` does."""
    if quantize != 0:
        _quantize(quantize, x, xq, xd, xb)
    prev = limit_threads(threads)
    pairs = (qs.shape[0] + 1) // 2
    for c in prange((pairs + PAIRS - 1) // PAIRS):
        call_address(fn, _body_args(qs, qh, sc, mn, d, dmin, lut, xq, xd, xb, out, dist)
                     + (c * PAIRS, min(pairs, (c + 1) * PAIRS)))
    restore_threads(prev)


@kernel(parallel=True, exact=True)
def gemv_lora(fn, qs, qh, sc, mn, d, dmin, lut, xq, xd, xb, out, dist, threads, quantize, x,  # type: ignore[no-untyped-def]
              a_fn, a, xr, xa, ready, b_fn, tiles, parts, scales, round_x):
    """`gemv` on one row of x (quantized here) plus a LoRA delta in one parallel loop, as
    `qmatmul_int.gemv_lora` (`lora_gemv`)."""
    _quantize(quantize, x, xq, xd, xb)
    lora_loop(fn, _body_args(qs, qh, sc, mn, d, dmin, lut, xq, xd, xb, out, dist), qs.shape[0],
              threads, x, a_fn, xr, a, xa, ready, b_fn, tiles, parts, scales, out, round_x)


@kernel(inline=True, exact=True)
def _quantize(quantize, x, xq, xd, xb):  # type: ignore[no-untyped-def]
    """x's float rows into Q8_K blocks (xq, xd, xb) by the quantizer at `quantize`."""
    for i in range(x.shape[0]):
        call_address(quantize, (data_pointer(x), x.shape[0], x.shape[1], data_pointer(xq),
                                data_pointer(xd), data_pointer(xb), i, 0, x.shape[1] // 256))


@kernel(inline=True, exact=True)
def _body_args(qs, qh, sc, mn, d, dmin, lut, xq, xd, xb, out, dist):  # type: ignore[no-untyped-def]
    """The body's arguments but the last two (the pairs of weight rows g0..g1)."""
    return (data_pointer(qs), qs.shape[0], qs.shape[1], data_pointer(qh), qh.shape[0],
            qh.shape[1], data_pointer(sc), sc.shape[0], sc.shape[1], data_pointer(mn),
            mn.shape[0], mn.shape[1], data_pointer(d), d.shape[0], d.shape[1],
            data_pointer(dmin), dmin.shape[0], dmin.shape[1], data_pointer(lut),
            data_pointer(xq), xq.shape[0], xq.shape[1], data_pointer(xd), xd.shape[1],
            data_pointer(xb), xb.shape[1], data_pointer(out), dist)


def _step(path, kind, group, iacc, acc, am, fw, iw, qs, qh, sc, mn, d, dmin, lut, r0, r1, rb, hb, sb, xq, xo, k, xd, xb, m0):  # type: ignore[no-untyped-def]
    """Superblock sb of weight rows r0 and r1 against the group's rows of x (from xo), into
    acc/am. Resolved per literal `kind` when a kernel compiles (`_step_for`), so each kernel
    holds only its own superblock code."""


@overload(_step, prefer_literal=True, inline="always")
def _step_for(path, kind, group, iacc, acc, am, fw, iw, qs, qh, sc, mn, d, dmin, lut, r0, r1, rb, hb, sb, xq, xo, k, xd, xb, m0):  # type: ignore[no-untyped-def]
    if not isinstance(kind, types.IntegerLiteral):
        return None
    code = kind.literal_value
    if code < 10 or code == TILED + 6:
        return _lanes_step(code % 10, code == TILED + 6)
    if code == REPACKED_Q4_K:
        return _repacked_step
    raise ValueError(f"kind {code} has no superblock step here (`ktiled` computes it)")


def _lanes_step(form: int, tiled: bool):  # type: ignore[no-untyped-def]
    """ggml's vec_dot (kinds 4, 5, 6): 8 integer lanes per pair of rows, scaled per
    superblock into 8 float lanes; and the tiled matmul on Q6_K (96): the lanes less the
    offset, then one total per pair."""
    hq, sq = (64, 16) if form == 6 else (32, 8)     # high-bit bytes, scales per superblock

    def step(path, kind, group, iacc, acc, am, fw, iw, qs, qh, sc, mn, d, dmin, lut, r0, r1, rb, hb, sb, xq, xo, k, xd, xb, m0):  # type: ignore[no-untyped-def]
        ns = sc.shape[1]
        superblock_lanes(path, form, group, 4, qs, r0 * rb + 128 * sb, r1 * rb + 128 * sb, qh,
                         r0 * hb + hq * sb, r1 * hb + hq * sb, sc, r0 * ns + sq * sb,
                         r1 * ns + sq * sb, xq, xo, k, iacc)
        if form == 6:
            q6_offsets(group, sc, r0 * ns + 16 * sb, r1 * ns + 16 * sb, xb,
                       m0 * xb.shape[1] + 16 * sb, xb.shape[1], iacc)
        if tiled:
            _pair_scales(kind, group, fw, r0, r1, sb, d, dmin, lut, xd, m0)
            lane_totals(iacc, iw, group)
            pair_flush(FLUSH_TILED_NO_MINS, acc, am, iw, iw, 0, fw)
        else:
            for m in range(group):
                _scale_vec_dot(kind, acc, iacc, am, m, r0, r1, sb, sc, mn, d, dmin, lut,
                               xd[m0 + m, sb], xb[m0 + m])
    return step


def _repacked_step(path, kind, group, iacc, acc, am, fw, iw, qs, qh, sc, mn, d, dmin, lut, r0, r1, rb, hb, sb, xq, xo, k, xd, xb, m0):  # type: ignore[no-untyped-def]
    """The repacked Q4_K GEMV (44): one integer total per pair and superblock, then its
    float epilogue."""
    ns = sc.shape[1]
    _pair_scales(kind, group, fw, r0, r1, sb, d, dmin, lut, xd, m0)
    min_terms(group, mn, r0 * ns + 8 * sb, r1 * ns + 8 * sb, xb, m0 * xb.shape[1] + 16 * sb,
              xb.shape[1], iw, 8)
    pair_totals(path, 4, group, 4, qs, r0 * rb + 128 * sb, r1 * rb + 128 * sb, qh, 0, 0, sc,
                r0 * ns + 8 * sb, r1 * ns + 8 * sb, xq, xo, k, iw)
    pair_flush(FLUSH_REPACKED, acc, am, iw, iw, 8, fw)


@numba.njit(inline="always", cache=True)
def _pair_scales(kind, group, fw, r0, r1, sb, d, dmin, lut, xd, m0):  # type: ignore[no-untyped-def]
    """For each pair c = 2m + r of x row m and weight row r (r0, r1) in superblock sb, the
    factors of `ktotals.pair_flush`: fw[c] = d_w d_x and fw[8 + c] = dmin_w d_x (repacked
    Q4_K), or fw[c] = d_w, fw[8 + c] = d_x (tiled Q6_K)."""
    for m in range(group):
        dx = xd[m0 + m, sb]
        for r in range(2):
            row = r1 if r else r0
            c = 2 * m + r
            if kind == TILED + 6:
                fw[c] = lut[d[row, sb]]
                fw[8 + c] = dx
            else:
                fw[c] = lut[d[row, sb]] * dx
                fw[8 + c] = lut[dmin[row, sb]] * dx


@numba.njit(inline="always", cache=True)
def _scale_vec_dot(kind, acc, iacc, am, m, r0, r1, sb, sc, mn, d, dmin, lut, dx, xb):  # type: ignore[no-untyped-def]
    """Row m of x's superblock sb onto weight rows r0 and r1 as ggml's vec_dot scales it
    (Q6_K's offset already off the integer lanes): d_w d_x times them onto acc, Q4_K/Q5_K's
    mins into am."""
    kflush(acc, 16 * m, iacc, 16 * m, lut[d[r0, sb]] * dx)
    kflush(acc, 16 * m + 8, iacc, 16 * m + 8, lut[d[r1, sb]] * dx)
    if kind != 6:
        _mins(kind, am, 8 * m, mn[r0], xb, sb, -dx * lut[dmin[r0, sb]])
        _mins(kind, am, 8 * m + 4, mn[r1], xb, sb, -dx * lut[dmin[r1, sb]])


@numba.njit(inline="always", cache=True)
def _mins(kind, am, i, mn, xb, sb, dmin):  # type: ignore[no-untyped-def]
    """Superblock sb's min term into am[i:i+4], as ggml's AVX2 dots: Q4_K (kind 4) keeps 4
    float lanes, lane t += dmin * (mn_2t b_2t + mn_2t+1 b_2t+1) (b_s x's sum over sub-block
    s); Q5_K (kind 5) adds dmin * (their integer total) to lane 0. Fused multiply-adds, as
    GCC compiles ggml's `+=`."""
    total = np.int32(0)
    for t in range(4):
        prod = np.int32(0)
        for u in range(2 * t, 2 * t + 2):
            prod += np.int32(mn[8 * sb + u]) * (np.int32(xb[16 * sb + 2 * u])
                                                + np.int32(xb[16 * sb + 2 * u + 1]))
        if kind == 4:
            am[i + t] = fma_f32(dmin, np.float32(prod), am[i + t])
        total += prod
    if kind == 5:
        am[i] = fma_f32(dmin, np.float32(total), am[i])


@numba.njit(inline="always", cache=True)
def _total(kind, acc, am, i, j):  # type: ignore[no-untyped-def]
    """A row's result: its 8 float lanes added as ggml adds them, plus (Q4_K/Q5_K) the mins;
    a repacked Q4_K row keeps one float and one min sum (at pair i // 8), as ggml's 8x8
    kernels; a tiled one one float."""
    if kind == REPACKED_Q4_K:
        return acc[i // 8] - am[i // 8]
    if kind // 10 * 10 == TILED:
        return acc[i // 8]
    total = hsum8(acc, i)
    if kind != 6:
        total = total + _hsum4(am, j)
    return total


@numba.njit(inline="always", cache=True)
def _hsum4(a, i):  # type: ignore[no-untyped-def]
    """(a0 + a2) + (a1 + a3), the order of ggml's 4-lane horizontal add."""
    return (a[i] + a[i + 2]) + (a[i + 1] + a[i + 3])


def supports(qtype: int, rows: int) -> bool:
    """Whether the backend should take `matmul` for a weight of `qtype` at `rows` rows of x
    (`qmatmul_int.MAX_ROWS`, as the other integer kernels)."""
    return qtype in KINDS and rows <= MAX_ROWS


def matmul(w: QuantMatrix, x: activations.Q8KRows, path: str | None = None,
           requests: np.ndarray | None = None) -> np.ndarray:
    """x's Q8_K blocks `[M, K]` -> `[M, N]` under the quantized semantics, W of a type in
    `KINDS`, each row in the float order of the llama.cpp kernel that would compute it
    (`row_kinds`). `requests`: the rows of each request, in order (None: one request).
    `path` forces a SIMD path (default `isa.selected()`)."""
    m = x.qs.shape[0]
    kinds = row_kinds(w, [m] if requests is None else requests)
    bounds = [0, *(np.flatnonzero(np.diff(kinds)) + 1).tolist(), m]    # spans of one kind
    if len(bounds) == 2:           # one kind: its kernel's array, not a copy of it
        return _kind_span(w, x, 0, m, int(kinds[0]), path)
    out = np.empty((m, w.rows), np.float32)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        out[start:stop] = _kind_span(w, x, start, stop, int(kinds[start]), path)
    return out


def _kind_span(w: QuantMatrix, x: activations.Q8KRows, start: int, stop: int, kind: int,
               path: str | None) -> np.ndarray:
    """Rows start .. stop of x, all of `kind`, by the kernel that takes that many."""
    rows = stop - start
    order, fewest = _wide(w, kind) or (None, rows + 1)
    if rows >= fewest:
        return ktiled.matmul(w, _row_slice(x, start, stop), order, path)
    if _in_registers(w, kind, rows):
        return krow.matmul(w, _row_slice(x, start, stop), path=path)
    span = pad_rows(_row_slice(x, start, stop), 1 if rows == 1 else GROUP)
    return _run(w, span, rows, kind, path)


def row_kinds(w: QuantMatrix, requests: Any) -> np.ndarray:
    """The kernel kind of each row, as llama.cpp's x86 backend chooses for a call of L rows
    (a request decoded alone, or a prompt's call of up to 512 rows: `requests` is the rows
    of each request, or each row's `qmatmul.RowPlaces`): a repacked Q4_K takes its GEMM on
    the first L - L % 4 rows when L > 3 and its GEMV on the rest; the other K-quants take
    the tiled matmul at 8+ rows (both need AVX2), else vec_dot."""
    places = row_places(requests)
    n = places.size
    if w.qtype == T.Q4_K and w.ggml_repacked:
        gemm = (n > 3) & (places.index < n - n % 4)
        return np.where(gemm, REPACKED_GEMM_Q4_K, REPACKED_Q4_K).astype(np.int64)
    form = KINDS[w.qtype]
    tiled = "avx2" in isa.available()
    return np.where(tiled & (n >= TILED_MIN_ROWS), TILED + form, form).astype(np.int64)


def _in_registers(w: QuantMatrix, kind: int, rows: int) -> bool:
    """Whether `rows` rows of `kind` on W take `krow` (on interleaved rows,
    `qmatmul.interleave`: the repacked Q4_K GEMV's order up to `krow.MAX_ROWS` rows, Q6_K's
    vec_dot at any count)."""
    return w.interleaved and (kind == 6 or (kind == REPACKED_Q4_K and rows <= krow.MAX_ROWS))


def _wide(w: QuantMatrix, kind: int) -> tuple[int, int] | None:
    """(`ktiled`'s float order, the fewest rows of x it takes) for `kind` on W, or None. An
    interleaved W's rows all go to `ktiled` or `krow`: no pair kernel reads that layout."""
    if w.interleaved and kind == REPACKED_Q4_K:
        return ktiled.GEMV, krow.MAX_ROWS + 1
    if w.interleaved and kind == TILED + 6:
        return ktiled.TILED, 1
    return _WIDE.get(kind)


def _row_slice(x: activations.Q8KRows, start: int, stop: int) -> activations.Q8KRows:
    if start == 0 and stop == x.qs.shape[0]:
        return x
    return activations.Q8KRows(x.qs[start:stop], x.d[start:stop], x.bsums[start:stop])


def quantizes_inside(w: QuantMatrix, rows: int, requests: np.ndarray | None) -> bool:
    """Whether `matmul_float` takes these rows: few (as `qmatmul_int.quantizes_inside`),
    and each a request of one row (a decode step), so that every row takes one kernel."""
    return (w.qtype in KINDS and rows * w.cols <= activations.SERIAL_MAX
            and one_row_each(requests, rows))


def matmul_float(w: QuantMatrix, x: np.ndarray, path: str | None = None,
                 requests: np.ndarray | None = None) -> np.ndarray:
    """`matmul(w, activations.quantize_q8_k(x), path, requests)` in one kernel call, for
    `quantizes_inside` rows: x float32 `[M, K]` is quantized inside `gemv` (the same bytes
    and floats, without the quantizer's call and the row-kind bookkeeping), into this
    thread's kept scratch (`_scratch`)."""
    kind = w.memo.get("int_k_one_row")
    if kind is None:
        kind = w.memo["int_k_one_row"] = int(row_kinds(w, [1])[0])
    m, k = x.shape
    if m >= (_wide(w, kind) or (None, m + 1))[1]:    # one-row requests `ktiled` takes together
        return matmul(w, activations.quantize_q8_k(x), path, requests)
    if _in_registers(w, kind, m):
        return krow.matmul(w, floats=x, path=path)
    group = 1 if m == 1 else GROUP
    padded = -(-m // group) * group
    return _run(w, _scratch(padded, k), m, kind, path, np.ascontiguousarray(x, np.float32))


def matmul_float_lora(w: QuantMatrix, x: np.ndarray, lora: Any, round_x: bool,
                      path: str | None = None) -> np.ndarray | None:
    """`matmul_float` of one row plus its LoRA delta (`lora_gemv`) in one call; None for an
    interleaved W, which the pair kernels that carry the delta do not read."""
    if w.interleaved:
        return None
    kind = w.memo.get("int_k_one_row")
    if kind is None:
        kind = w.memo["int_k_one_row"] = int(row_kinds(w, [1])[0])
    k = x.shape[1]
    fn, planes, dist = _decode_plan(w, kind, path, 1)
    blocks = _scratch(1, k)
    out = np.empty((1, w.rows), np.float32)
    threads = 1 if w.rows * w.cols <= SERIAL_MAX_WORK else 0
    gemv_lora(fn, *planes, HALF_LUT, blocks.qs, blocks.d, blocks.bsums, out, dist, threads,
              activations.q8_k_blocks.address, np.ascontiguousarray(x, np.float32),
              *lora_args(lora, k, round_x))
    return out


def _run(w: QuantMatrix, x: activations.Q8KRows, m: int, kind: int, path: str | None,
         floats: np.ndarray | None = None) -> np.ndarray:
    """`kind`'s GEMV on x's blocks (rows padded to the group) for the first m rows; with
    `floats`, x is scratch that `gemv` fills from `floats` first."""
    fn, planes, dist = _decode_plan(w, kind, path, 1 if m == 1 else GROUP)
    out = np.empty((x.qs.shape[0], w.rows), np.float32)
    threads = 1 if w.rows * w.cols * m <= SERIAL_MAX_WORK else 0
    quantize = 0 if floats is None else activations.q8_k_blocks.address
    gemv(fn, *planes, HALF_LUT, x.qs, x.d, x.bsums, out, dist, threads, quantize,
         _NO_F32 if floats is None else floats)
    return out[:m] if x.qs.shape[0] != m else out


def _decode_plan(w: QuantMatrix, kind: int, path: str | None, group: int
                 ) -> tuple[int, tuple[np.ndarray, ...], int]:
    """(the body's address for `kind`, `path` (default `isa.selected()`) and x-row group,
    the planes as `gemv` takes them, the prefetch distance), kept in w's memo: looked up at
    every call, it must cost little."""
    code = isa.code(path) if path else isa.selected_code()
    plan = w.memo.get(("int_k", kind, code, group))
    if plan is None:
        if w.interleaved:
            raise ValueError("the pair kernels read K-quant rows as stored, not interleaved")
        if kind % 10 == 6:      # ql, qh, scales, d
            planes = (w.planes[0], w.planes[1], w.planes[2], _NO_BITS, w.planes[3], _NO_U16)
        elif kind % 10 == 5:    # qh, qs, sc, mn, d, dmin
            planes = (w.planes[1], w.planes[0], *w.planes[2:])
        else:                   # qs, sc, mn, d, dmin (Q4_K, as stored or repacked)
            planes = (w.planes[0], _NO_BITS, *w.planes[1:])
        dtypes = tuple(a.dtype.str for a in planes)
        plan = w.memo[("int_k", kind, code, group)] = (
            body(code, kind, group, dtypes).address, planes, prefetch_rows(w))
    return plan


def _scratch(rows: int, k: int) -> activations.Q8KRows:
    """This thread's Q8_K blocks for `rows` rows of K = k (`kept`; padding rows as in
    `qmatmul_int._scratch`)."""
    return kept(("q8_k", rows, k), lambda: activations.Q8KRows(
        np.zeros((rows, k), np.int8), np.zeros((rows, k // 256), np.float32),
        np.zeros((rows, k // 16), np.int16)))
