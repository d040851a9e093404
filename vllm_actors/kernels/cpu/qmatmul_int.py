"""`--gguf-activations quantized` with integer dot products, as llama.cpp computes it: x
quantized once to Q8_0/Q8_1 blocks (`activations.quantize_q8`), each weight block multiplied
with them as exact int32 lanes (`qdot`, on the SIMD path `isa.selected()` names), scaled by
d_w * d_x into 8 float lanes.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (the 32-weight blocks), each in the float order of
ggml's x86 `vec_dot_*_q8_*`: per block acc = fma(d_w * d_x, lanes, acc) (Q4_0/Q5_0 with
their offset inside the integers), Q4_1/Q5_1's min term summed as summs = fma(m_w, s_x,
summs) with s_x Q8_1's stored sum, and the result hsum(acc) (+ summs), the 8 lanes added as
ggml's `hsum_float_8` adds them. IQ4_NL (its table's values, or its exact Q8_0 form
`qmatmul_layout.iq4_nl_as_q8_0`) takes that order where llama.cpp takes tinyBLAS (a request
of two rows or more), and for a request of one row `vec_dot_iq4_nl_q8_0`'s (`ONE_ROW`: even
and odd blocks in two chains, hsum(even + odd), an odd last block added as fma(d_w * d_x,
its integer sum, total)). Q4_0 and IQ4_NL weights llama.cpp repacks (x86 with AVX2, rows a
multiple of 8; `QuantMatrix.ggml_repacked`) take the order of its 8-row interleaved kernels
at every row count (`REPACKED`): per block the whole block's integer sum, acc = fma(sum,
d_w * d_x, acc), one chain per output. Compiled without fast math, so the floats are ggml's
bit for bit (bench/llamacpp_tensors.py). Parallel over pairs of weight rows, the body a C
callback compiled once per (SIMD path, type, x-row group) (`jit.Callback`); where faster,
`qwide` takes the rows in the same float order, 16 weight rows as a vector's lanes (`_wide`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numba
import numpy as np
from gguf import GGMLQuantizationType
from numba import carray, prange, types

from vllm_actors.kernels.cpu import activations, isa, qwide
from vllm_actors.kernels.cpu.activations import quantize_at
from vllm_actors.kernels.cpu.intrinsics import call_address, data_pointer, fma_f32
from vllm_actors.kernels.cpu.jit import Callback, callback, kernel
from vllm_actors.kernels.cpu.lora_gemv import lora_args, lora_loop
from vllm_actors.kernels.cpu.qdot import qdot, qsum
from vllm_actors.kernels.cpu.qmatmul import (SERIAL_MAX_WORK, QuantMatrix, one_row_each,
                                             prefetch_rows, row_places)
from vllm_actors.kernels.cpu.qmatmul_prims import (
    HALF_LUT,
    byte_codes,
    kept,
    limit_threads,
    prefetch,
    restore_threads,
    stack_f32,
)

T = GGMLQuantizationType

# type -> qdot's kind
KINDS: dict[int, int] = {T.Q4_0: 40, T.Q4_1: 4, T.Q5_0: 50, T.Q5_1: 5, T.Q8_0: 8,
                         T.IQ4_NL: 41}
# the body's kind for a one-row request of an IQ4_NL weight (as itself, or in Q8_0 form) ->
# the lanes' kind
ONE_ROW: dict[int, int] = {49: 41, 48: 8}
_ONE_ROW_OF = {41: 49, 8: 48}
# the body's kind for a Q4_0 / IQ4_NL weight llama.cpp repacks -> the lanes' kind
REPACKED: dict[int, int] = {140: 40, 141: 41}
# Up to this many rows of x, `matmul` runs the integer kernels; beyond, x~ through the float
# kernels (`activations.simulate`: the same numbers up to summation order). Every step: only
# the integer kernels give llama.cpp's floats bit for bit.
MAX_ROWS = 1 << 30
GROUP = 4         # x rows per register group beyond one row (the kernels' stack arrays hold 4)

_NO_U32 = np.zeros((0, 0), np.uint32)
_NO_U16 = np.zeros((0, 0), np.uint16)
_NO_F32 = np.zeros((0, 0), np.float32)


@numba.njit(inline="always", cache=True)
def hsum8(a, i):  # type: ignore[no-untyped-def]
    """a[i] + ... + a[i+7] in the order of ggml's `hsum_float_8` (high half onto low, then
    pairs): ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))."""
    return ((a[i + 4] + a[i]) + (a[i + 6] + a[i + 2])) + ((a[i + 5] + a[i + 1])
                                                         + (a[i + 7] + a[i + 3]))


@numba.njit(inline="always", cache=True)
def _total(has_min, acc, summs, i, j):  # type: ignore[no-untyped-def]
    """A row's result: hsum8 of its lanes, plus the min sum where the type has mins (ggml
    adds nothing otherwise, which keeps a -0.0)."""
    total = hsum8(acc, i)
    if has_min:
        total = total + summs[j]
    return total


_MIN_KINDS = (KINDS[T.Q4_1], KINDS[T.Q5_1])


@numba.njit(inline="always", cache=True)
def _two_chains(acc, odd, i, odd_count, tail):  # type: ignore[no-untyped-def]
    """`vec_dot_iq4_nl_q8_0`'s result for the row whose even blocks' lanes are at acc[i:i+8]
    and odd blocks' at odd[i:i+8]: hsum(even + odd); for an odd block count the last block's
    integer lanes (odd[64+i:72+i], exact in float32 below 2^24) then add fma(d_w * d_x of
    that block, their sum, total)."""
    for t in range(8):
        odd[128 + t] = acc[i + t] + odd[i + t]
    total = hsum8(odd, 128)
    if odd_count:
        whole = np.float32(0.0)
        for t in range(8):
            whole += odd[64 + i + t]
        total = fma_f32(tail, whole, total)
    return total


_LANES, _CHAINS, _SCALAR = 0, 1, 2      # how a body sums a row: `_order`


def _order(kind: int) -> int:
    """The float order a body kind sums in: 8 lanes and hsum (ggml's vec_dot, tinyBLAS),
    two chains of lanes (`ONE_ROW`), or one scalar chain (`REPACKED`)."""
    return _CHAINS if kind in ONE_ROW else _SCALAR if kind in REPACKED else _LANES


@numba.njit(inline="always", cache=True)
def _clear(acc, odd, summs, group, order):  # type: ignore[no-untyped-def]
    """Zero the sums a body keeps for one group of x rows (`odd` only with two chains)."""
    for i in range(16 * group):
        acc[i] = 0
        if order == _CHAINS:
            odd[i] = 0
            odd[64 + i] = 0
    for i in range(2 * group):
        summs[i] = 0


@numba.njit(inline="always", cache=True)
def _result(order, has_min, acc, odd, summs, i, j, tail, odd_count):  # type: ignore[no-untyped-def]
    """One output of a body: lanes at acc[i:i+8] (and odd[i:i+8] with two chains), or
    the scalar chain in summs[j]."""
    if order == _SCALAR:
        return summs[j]
    if order == _CHAINS:
        return _two_chains(acc, odd, i, odd_count, tail)
    return _total(has_min, acc, summs, i, j)


@numba.njit(inline="always", cache=True)
def _store(out, m0, group, r0, n, order, has_min, acc, odd, summs, lut, d, xd):  # type: ignore[no-untyped-def]
    """A pair of weight rows' outputs for x rows m0 .. m0 + group."""
    nb = d.shape[1]
    for j in range(group):
        dx = xd[m0 + j, nb - 1]
        out[m0 + j, r0] = _result(order, has_min, acc, odd, summs, 16 * j, 2 * j,
                                  lut[d[r0, nb - 1]] * dx, nb % 2 == 1)
        if r0 + 1 < n:
            out[m0 + j, r0 + 1] = _result(order, has_min, acc, odd, summs, 16 * j + 8,
                                          2 * j + 1, lut[d[r0 + 1, nb - 1]] * dx, nb % 2 == 1)


@numba.njit(inline="always", cache=True)
def _add_mins(summs, j, m_0, m_1, s_x):  # type: ignore[no-untyped-def]
    """Q4_1/Q5_1's min terms of a block: summs = fma(m_w, s_x, summs), per weight row."""
    summs[2 * j] = fma_f32(m_0, s_x, summs[2 * j])
    summs[2 * j + 1] = fma_f32(m_1, s_x, summs[2 * j + 1])


PAIRS = 8          # pairs of weight rows per call of a kernel body


@functools.cache
def body(path: int, kind: int, group: int) -> Callback:
    """`gemv`'s loop body for one SIMD path, weight kind and x-row group (compile-time
    constants): pairs of weight rows [g0, g1), all rows of x. x's rows go in groups of
    `group` (1 or 4; M a multiple of it), each group's sums in registers; a pair of weight
    rows is read from memory once, then from L1. `xs`: Q8_1's stored sums s_x (types with
    mins). `kind`: `KINDS`' or `ONE_ROW`'s / `REPACKED`'s (`_order`)."""
    has_min = kind in _MIN_KINDS          # constants: no min or fifth-bit code for the rest
    has_bits = kind in (5, 50)
    order = _order(kind)
    kind = ONE_ROW.get(kind, REPACKED.get(kind, kind))
    qs_type = types.int8 if kind == 8 else types.uint8

    def pairs(qs_p, n, rb, qh_p, d_p, mn_p, lut_p, xq_p, m, k, xd_p, xs_p, out_p, dist, g0,
              g1):  # type: ignore[no-untyped-def]
        nb = k // 32
        step = rb // nb                   # quant bytes per block: 16 or 32
        qs, d = carray(qs_p, (n, rb)), carray(d_p, (n, nb))
        qh = carray(qh_p, (n if has_bits else 0, nb))
        mn = carray(mn_p, (n if has_min else 0, nb))
        lut, xq = carray(lut_p, (1 << 16,)), carray(xq_p, (m, k))
        xd, xs, out = carray(xd_p, (m, nb)), carray(xs_p, (m, nb)), carray(out_p, (m, n))
        acc, summs = stack_f32(64), stack_f32(8)
        odd = stack_f32(136)     # two chains: the odd blocks' [0:64], a last block's [64:128]
        for g in range(g0, g1):
            r0 = 2 * g
            r1 = min(r0 + 1, n - 1)
            p0, p1 = min(r0 + dist, n - 1) * rb, min(r0 + dist + 1, n - 1) * rb
            for m0 in range(0, m, group):
                _clear(acc, odd, summs, group, order)
                for b in range(nb):
                    prefetch(qs, p0 + b * step)
                    prefetch(qs, p1 + b * step)
                    d0, d1 = lut[d[r0, b]], lut[d[r1, b]]
                    h0 = qh[r0, b] if has_bits else 0
                    h1 = qh[r1, b] if has_bits else 0
                    o0, o1 = r0 * rb + b * step, r1 * rb + b * step
                    for j in range(group):
                        dx = xd[m0 + j, b]
                        xo = (m0 + j) * k + 32 * b
                        if order == _SCALAR:     # one chain per output, in summs
                            summs[2 * j] = fma_f32(np.float32(qsum(
                                path, kind, qs, o0, h0, xq, xo)), d0 * dx, summs[2 * j])
                            summs[2 * j + 1] = fma_f32(np.float32(qsum(
                                path, kind, qs, o1, h1, xq, xo)), d1 * dx, summs[2 * j + 1])
                            continue
                        last = order == _CHAINS and b + 1 == nb and nb % 2 == 1   # integers
                        to = odd if order == _CHAINS and (last or b % 2 == 1) else acc
                        at = 16 * j + (64 if last else 0)
                        one = np.float32(1.0)
                        qdot(path, kind, to, at, qs, o0, h0, xq, xo, one if last else d0 * dx)
                        qdot(path, kind, to, at + 8, qs, o1, h1, xq, xo,
                             one if last else d1 * dx)
                        if has_min:
                            _add_mins(summs, j, lut[mn[r0, b]], lut[mn[r1, b]], xs[m0 + j, b])
                _store(out, m0, group, r0, n, order, has_min, acc, odd, summs, lut, d, xd)
    f32, i64 = types.CPointer(types.float32), types.int64
    u16 = types.CPointer(types.uint16)
    return callback(types.CPointer(qs_type), i64, i64, types.CPointer(types.uint32), u16, u16,
                    f32, types.CPointer(types.int8), i64, i64, f32, f32, f32, i64, i64, i64,
                    exact=True)(pairs)


@kernel(parallel=True, exact=True)
def gemv(fn, qs, qh, d, mn, lut, xq, xd, xs, out, dist, threads, quantize, x, xdsum):  # type: ignore[no-untyped-def]
    """out[M, N] = the quantized semantics' x @ W.T: the body at the address `fn` (`body`)
    on chunks of PAIRS pairs of weight rows, in parallel. Each output is computed the same
    way whichever thread takes its chunk. With `quantize` (the address of
    `activations.q8_0_blocks`, else 0) x's float rows are first quantized into xq/xd/xs/
    xdsum on this thread: one call from Python for a decode step's linear."""
    if quantize != 0:
        quantize_at(quantize, x, lut, xq, xd, xs, xdsum)
    prev = limit_threads(threads)
    n = qs.shape[0]
    pairs = (n + 1) // 2
    for c in prange((pairs + PAIRS - 1) // PAIRS):
        call_address(fn, (data_pointer(qs), n, qs.shape[1], data_pointer(qh), data_pointer(d),
                          data_pointer(mn), data_pointer(lut), data_pointer(xq), xq.shape[0],
                          xq.shape[1], data_pointer(xd), data_pointer(xs), data_pointer(out),
                          dist, c * PAIRS, min(pairs, (c + 1) * PAIRS)))
    restore_threads(prev)


def _scratch(rows: int, k: int) -> tuple[np.ndarray, ...]:
    """This thread's Q8 blocks (qs, d, s, dsum) for `rows` rows of K = k (`kept`). The
    quantizer rewrites x's rows; padding rows keep zeros or an earlier call's blocks, whose
    outputs are cut off (each output row depends on its own x row alone)."""
    return kept(("q8", rows, k), lambda: (np.zeros((rows, k), np.int8),
                                          *np.zeros((3, rows, k // 32), np.float32)))


@kernel(parallel=True, exact=True)
def gemv_lora(fn, qs, qh, d, mn, lut, xq, xd, xs, out, dist, threads, quantize, x, xdsum,  # type: ignore[no-untyped-def]
              a_fn, a, xr, xa, ready, b_fn, tiles, parts, scales, round_x):
    """`gemv` on one row of x (quantized here) plus a LoRA delta, in one parallel loop
    (`lora_gemv`): each chunk of weight rows computes its rows, then adds B's products."""
    quantize_at(quantize, x, lut, xq, xd, xs, xdsum)
    n = qs.shape[0]
    lora_loop(fn, (data_pointer(qs), n, qs.shape[1], data_pointer(qh), data_pointer(d),
                   data_pointer(mn), data_pointer(lut), data_pointer(xq), xq.shape[0],
                   xq.shape[1], data_pointer(xd), data_pointer(xs), data_pointer(out), dist),
              n, threads, x, a_fn, xr, a, xa, ready, b_fn, tiles, parts, scales, out, round_x)


def pad_rows(x: Any, group: int) -> Any:
    """x's quantized rows (a `Q8Rows` or `Q8KRows`) padded with zero rows to a multiple of
    `group`: a zero row has scale 0 and sums 0, so its outputs are 0 and are cut off."""
    m = x.qs.shape[0]
    if m % group == 0:
        return x
    extra = group - m % group
    return type(x)(*(np.concatenate([a, np.zeros((extra, a.shape[1]), a.dtype)])
                     for a in (getattr(x, f.name) for f in dataclasses.fields(x))))


# Types the backend sends here: all of them, since these give ggml's floats bit for bit (the
# float kernels on x~ give the same numbers only up to summation order).
FASTER = frozenset(KINDS)


def row_kinds(w: QuantMatrix, requests: Any) -> np.ndarray:
    """Each row's body kind, as llama.cpp computes a call of L rows (`requests` as
    `qmatmul_int_k.row_kinds` takes them): unrepacked IQ4_NL takes `vec_dot_iq4_nl_q8_0`
    for a call of one row and tinyBLAS (Q8_0's order) for more; the other types (repacked
    ones too) one order at every row count."""
    places = row_places(requests)
    kind = _base_kind(w)
    if not _iq4_nl(w) or kind in REPACKED:
        return np.full(len(places), kind, np.int64)
    return np.where(places.size == 1, _ONE_ROW_OF[kind], kind).astype(np.int64)


def _iq4_nl(w: QuantMatrix) -> bool:
    return w.qtype == T.IQ4_NL or w.stored_as == T.IQ4_NL


def _one_row_kind(w: QuantMatrix) -> int | None:
    """The body's kind for a request of one row where it differs from `_base_kind`."""
    return _ONE_ROW_OF[KINDS[w.qtype]] if _iq4_nl(w) and not w.ggml_repacked else None


def _base_kind(w: QuantMatrix) -> int:
    """The body's kind for a weight whatever the request: its type's, or llama.cpp's
    repacked order's."""
    kind = KINDS[w.qtype]
    return kind + 100 if w.ggml_repacked and kind + 100 in REPACKED else kind


def supports(qtype: int, rows: int) -> bool:
    """Whether the backend should take `matmul` for a weight of `qtype` at `rows` rows of x."""
    return qtype in FASTER and rows <= MAX_ROWS


def matmul(w: QuantMatrix, x: activations.Q8Rows, path: str | None = None,
           requests: Any = None) -> np.ndarray:
    """x's Q8 blocks `[M, K]` -> `[M, N]` under the quantized semantics, W of a type in
    `KINDS`. `path` forces a SIMD path (default `isa.selected()`). `requests` (the rows of
    each request, in order; None: one request) matters to unrepacked IQ4_NL alone
    (`row_kinds`): llama.cpp computes the other types in one float order at every row
    count (its vec_dot, and llamafile's GEMM for Q4_0/Q5_0/Q8_0 alike)."""
    m = x.qs.shape[0]
    if not _iq4_nl(w):                   # one order at every row count: one call
        return _span(w, x, m, _base_kind(w), path)
    kinds = row_kinds(w, [m] if requests is None else requests)
    out = np.empty((m, w.rows), np.float32)
    bounds = [0, *(np.flatnonzero(np.diff(kinds)) + 1).tolist(), m]    # spans of one kind
    for start, stop in zip(bounds[:-1], bounds[1:]):
        rows = stop - start
        span = x if rows == m else activations.Q8Rows(*(
            getattr(x, f.name)[start:stop] for f in dataclasses.fields(x)))
        out[start:stop] = _span(w, span, rows, int(kinds[start]), path)
    return out


# From this many rows of x on, `qwide` takes a matmul in the lanes' and the repacked order:
# its weight rows, decoded once, serve every row of x (docs/BENCHMARKS.md, "The matmuls of
# many rows"); one row (`qwide.one_row`, from 16 weight rows) decodes each block in
# registers. Q8_0's 8.5 bits stream faster through the GEMV below 16 rows of x (a
# 262144-row LM head).
WIDE_ROWS = {8: 16}
_WIDE_ORDERS = {_LANES: qwide.LANES_ORDER, _SCALAR: qwide.SCALAR_ORDER}


def _wide(w: QuantMatrix, kind: int, m: int) -> bool:
    """Whether `qwide` takes m rows of body `kind` on W: all of them where W is
    interleaved (`qmatmul.interleave`), which no pair kernel reads."""
    return _order(kind) in _WIDE_ORDERS and (
        w.interleaved or m >= WIDE_ROWS.get(REPACKED.get(kind, kind), 1))


def _span(w: QuantMatrix, x: activations.Q8Rows, m: int, kind: int, path: str | None
          ) -> np.ndarray:
    """m rows of x in the order of body `kind`: `qwide` where it is faster, else `_run`."""
    order = _WIDE_ORDERS.get(_order(kind))
    if not _wide(w, kind, m) or (m == 1 and w.rows < qwide.LANES):
        return _run(w, pad_rows(x, 1 if m == 1 else GROUP), m, kind, path)
    planes = (w.memo.get("int") or _plan(w))[1]
    return qwide.matmul(w, planes, x, REPACKED.get(kind, kind), order, path)


def quantizes_inside(w: QuantMatrix, rows: int, requests: Any = None) -> bool:
    """Whether `matmul_float` takes `rows` rows for W: few enough that quantizing them on
    one thread (as `activations.quantize_q8` then does too) costs less than a call, and of
    one row kind (`row_kinds`: for IQ4_NL, each a request of one row, or one request)."""
    one_kind = not _iq4_nl(w) or w.ggml_repacked or requests is None or \
        len(np.unique(row_kinds(w, requests))) == 1
    return w.qtype in FASTER and rows * w.cols <= activations.SERIAL_MAX and one_kind


def matmul_float(w: QuantMatrix, x: np.ndarray, path: str | None = None,
                 requests: Any = None) -> np.ndarray:
    """`matmul(w, activations.quantize_q8(x))`, for `quantizes_inside` row counts: x float32
    `[M, K]` is quantized inside `gemv` where one call computes it (a row, or rows `qwide`
    does not take). `path` as `matmul`'s. The same bytes and floats as the two calls,
    without the quantizer's own call and its `Q8Rows` (a few us of Python per linear, much
    of a decode step's overhead)."""
    m, k = x.shape
    one_rows = one_row_each(requests, m)
    # one row: the plan's kind unless it is a prompt's row (a step left it alone: a prefix
    # cache hit, a chunk's last row) of a type whose kind depends on the call's rows
    if m == 1 and (one_rows or _one_row_kind(w) is None):
        plan = w.memo.get(("one_row", path))
        if plan is None:
            plan = w.memo[("one_row", path)] = _one_row_plan(w, path) or False
        if plan:
            return qwide.run_one_row(plan, x)
    kind = _one_row_kind(w) if one_rows else None
    if (m > 1 or not one_rows) and _wide(w, kind or _base_kind(w), m):
        return matmul(w, activations.quantize_q8(x), path, requests)
    return gemv_float(w, x, kind, path)


def one_row_plan_taken(w: QuantMatrix, path: str | None) -> tuple | None:
    """The `qwide` plan `matmul_float` runs W's one quantized row by, once a call has made
    it (None before, False where none serves): the backend's decode steps go straight to
    it, without the Python of the calls between."""
    return w.memo.get(("one_row", path))


def gemv_float(w: QuantMatrix, x: np.ndarray, kind: int | None = None,
               path: str | None = None) -> np.ndarray:
    """x float32 `[M, K]` through `gemv` with the body of `kind` (None: the weight type's),
    quantized inside its call."""
    m, k = x.shape
    group = 1 if m == 1 else GROUP
    padded = -(-m // group) * group
    fn, planes, dist = _decode_plan(w, path, group, kind)
    out = np.empty((padded, w.rows), np.float32)
    threads = 1 if w.rows * w.cols * m <= SERIAL_MAX_WORK else 0
    xq, xd, xs, xdsum = _scratch(padded, k)
    gemv(fn, *planes, HALF_LUT, xq, xd, xs, out, dist, threads,
         activations.q8_0_blocks.address, np.ascontiguousarray(x, np.float32), xdsum)
    return out[:m] if padded != m else out


def _one_row_plan(w: QuantMatrix, path: str | None) -> tuple | None:
    """`qwide.one_row_plan` where `qwide` takes W's requests of one row, else None."""
    kind = _one_row_kind(w) or _base_kind(w)
    if w.rows < qwide.LANES or not _wide(w, kind, 1):
        return None
    return qwide.one_row_plan(w, (w.memo.get("int") or _plan(w))[1], REPACKED.get(kind, kind),
                              _WIDE_ORDERS[_order(kind)], path)


def matmul_float_lora(w: QuantMatrix, x: np.ndarray, lora: Any, round_x: bool,
                      path: str | None = None) -> np.ndarray | None:
    """`matmul_float` of one row plus its LoRA delta (`lora_gemv`) in one call; None for an
    interleaved W, which the pair kernels that carry the delta do not read."""
    if w.interleaved:
        return None
    k = x.shape[1]
    fn, planes, dist = _decode_plan(w, path, 1, _one_row_kind(w))
    out = np.empty((1, w.rows), np.float32)
    threads = 1 if w.rows * w.cols <= SERIAL_MAX_WORK else 0
    xq, xd, xs, xdsum = _scratch(1, k)
    gemv_lora(fn, *planes, HALF_LUT, xq, xd, xs, out, dist, threads,
              activations.q8_0_blocks.address, np.ascontiguousarray(x, np.float32), xdsum,
              *lora_args(lora, k, round_x))
    return out


def _run(w: QuantMatrix, x: activations.Q8Rows, m: int, kind: int, path: str | None
         ) -> np.ndarray:
    """`gemv` with the body of `kind` on x's blocks (rows padded to the group) for the first
    m rows."""
    fn, planes, dist = _decode_plan(w, path, 1 if m == 1 else GROUP, kind)
    out = np.empty((x.qs.shape[0], w.rows), np.float32)
    threads = 1 if w.rows * w.cols * m <= SERIAL_MAX_WORK else 0
    gemv(fn, *planes, HALF_LUT, x.qs, x.d, x.s, out, dist, threads, 0, _NO_F32, _NO_F32)
    return out[:m]


def _decode_plan(w: QuantMatrix, path: str | None, group: int, kind: int | None = None
                 ) -> tuple[int, tuple[np.ndarray, ...], int]:
    """(the body's address for `path` (default `isa.selected()`), x-row group and body
    kind (`row_kinds`; None: the weight type's), the planes as `gemv` takes them, its
    prefetch distance), kept in w's memo: looked up at every call, it must cost little."""
    code = isa.code(path) if path else isa.selected_code()
    plan = w.memo.get(("int", code, group, kind))
    if plan is None:
        if w.interleaved:
            raise ValueError("the pair kernels read rows as stored, not interleaved")
        base, planes, dist = w.memo.get("int") or _plan(w)
        plan = w.memo[("int", code, group, kind)] = (
            body(code, base if kind is None else kind, group).address, byte_codes(planes), dist)
    return plan


def _plan(w: QuantMatrix) -> tuple[int, tuple[np.ndarray, ...], int]:
    """(qdot's kind, the planes as `gemv` takes them, its prefetch distance) of a weight,
    kept in its memo."""
    qs, rest = w.planes[0], w.planes[1:]
    has_bits = w.qtype in (T.Q5_0, T.Q5_1)
    qh = rest[0] if has_bits else _NO_U32
    d = rest[1] if has_bits else rest[0]
    mn = rest[-1] if w.qtype in (T.Q4_1, T.Q5_1) else _NO_U16
    w.memo["int"] = _base_kind(w), (qs, qh, d, mn), prefetch_rows(w)
    return w.memo["int"]
