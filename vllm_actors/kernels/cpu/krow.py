"""A decode step's K-quant linear: 1 to 4 rows of x (Q8_K blocks, one-row requests) against
a Q4_K weight that llama.cpp repacks (`qmatmul_int_k.REPACKED_Q4_K`, its 8x8 GEMV's float
order), with 16 weight rows as the lanes of a vector and no decoded copy: the quants are
stored 16 rows interleaved (`qmatmul.interleave`), so each 64 bytes of a chunk's
superblock are one vector of 4 bytes a row, split into nibbles on all rows at once and
multiplied by each row of x's 4 quants (broadcast) with one 4-byte dot product a group
(`ktiled.dot4`). Sub-block s's sums a_s then give the exact integers

    total = sum_s sc_s a_s          mins = sum_s mn_s (b_2s + b_2s+1)

(b x's sums of 16) and ggml's epilogue per superblock, acc = fma(total, d_w d_x, acc), am =
fma(mins, dmin_w d_x, am), the result acc - am: bit for bit the pair GEMV's floats
(`tests/kernels/test_ktiled.py`). A chunk is one contiguous run of bytes; as each
superblock goes, the next chunk's is prefetched a line a vector, and its scales, mins, d and
dmin when the chunk starts. Parallel over fixed chunks of 16 weight rows. `matmul` also
serves an interleaved Q6_K (`krow6`: its vec_dot order, any number of rows).
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import carray, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from vllm_actors.kernels.cpu import activations, isa, krow6
from vllm_actors.kernels.cpu.intrinsics import call_address, data_pointer, prefetch_line
from vllm_actors.kernels.cpu.jit import Callback, callback, kernel
from vllm_actors.kernels.cpu.ktiled import (INT16_RUN, LANES, NO_SUMS, ByteDots, arguments,
                                            array_ptr, bit_field, fma16, lane_bytes,
                                            madd_pairs, sums_of_32)
from vllm_actors.kernels.cpu.qmatmul import SERIAL_MAX_WORK, QuantMatrix
from vllm_actors.kernels.cpu.qmatmul_prims import (HALF_LUT, kept, limit_threads, prefetch_span,
                                                   restore_threads)
from vllm_actors.kernels.cpu.qmatmul_simd import splat
from vllm_actors.kernels.cpu.qwide import half_lanes

_I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (8, 16, 32, 64))
_B64 = ir.VectorType(_I8, 64)
_L16 = ir.VectorType(_I32, 16)
_F16 = ir.VectorType(ir.FloatType(), 16)
CHUNK_BYTES = 128 * LANES        # a superblock's quants of 16 interleaved rows
MAX_ROWS = 4                     # rows of x a call takes (`ktiled` decodes for more)
_NO_F32 = np.zeros((0, 0), np.float32)


@intrinsic
def q4_k_rows(typingctx, isa_, m, q, qo, sc, mn, so, d, dm, do, nsb, lut, x, xb, xd, out, oo, po, no):  # type: ignore[no-untyped-def]
    """x's m rows (a literal; row r's quants at x.flat[r 256 nsb + 256 sb ..], sums of 32 at
    xb.flat[r 8 nsb + 8 sb ..], scales at xd.flat[r nsb + sb]) against a chunk of 16
    interleaved Q4_K weight rows (`qmatmul.interleave`): superblock sb's quants at
    q.flat[qo + 2048 sb ..], the 16 rows' 8 scales and mins at sc.flat / mn.flat[so +
    128 sb ..] (word v of row l at byte 64 v + 4 l), d and dmin at d.flat / dm.flat[do +
    16 sb ..] (row l's at l); out.flat[r no + oo : .. + 16] =
    the 16 outputs of x's row r in the repacked GEMV's float order. Each vector of quants is
    loaded and split once for all m rows; the chunk at q.flat[po ..] is prefetched as the
    superblocks go."""
    if not (isinstance(isa_, types.IntegerLiteral) and isinstance(m, types.IntegerLiteral)
            and isinstance(x, types.Array) and x.dtype == types.int8):
        return None
    path, count = isa_.literal_value, m.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        (qo_, so_, do_, nsb_, oo_, po_, no_), load = arguments(context, builder, sig, args,
                                                              (3, 6, 9, 10, 16, 17, 18))

        def at(r, per, sb):  # type: ignore[no-untyped-def]
            """Element sb * per of x's row r in an array of `per` values a superblock."""
            return builder.mul(builder.add(builder.mul(nsb_, ir.Constant(_I64, r)), sb),
                               ir.Constant(_I64, per))

        zero = ir.Constant(_F16, [0.0] * 16)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(2)]
                for _ in range(count)]
        with cgutils.for_range(builder, nsb_) as loop:
            sb = loop.index
            base = builder.mul(sb, ir.Constant(_I64, CHUNK_BYTES))
            ahead = builder.add(po_, base)

            def hint(off):  # type: ignore[no-untyped-def]
                prefetch_line(builder, array_ptr(context, builder, sig, args, 2,
                                                 builder.add(ahead, off), _I8))
            sa = builder.add(so_, builder.mul(sb, ir.Constant(_I64, 8 * LANES)))
            scales, mins = (lane_bytes(builder, [load(i, builder.add(sa, ir.Constant(
                _I64, 64 * v)), _L16) for v in range(2)], 8, False) for i in (4, 5))
            totals = _totals(builder, path, load, builder.add(qo_, base),
                             [at(r, 256, sb) for r in range(count)], scales, hint)
            ha = builder.add(do_, builder.mul(sb, ir.Constant(_I64, LANES)))

            def halves(i):  # type: ignore[no-untyped-def]
                return half_lanes(builder, load(i, ha, ir.VectorType(_I16, LANES), 2),
                                  lambda v: load(11, builder.zext(v, _I64), ir.FloatType(), 4))
            _epilogue(builder, path, load, accs, totals, _pairs(builder, mins), halves(7),
                      halves(8), lambda r, per: at(r, per, sb))
        for r, (acc, am) in enumerate(accs):
            o = builder.add(builder.mul(no_, ir.Constant(_I64, r)), oo_)
            builder.store(builder.fsub(builder.load(acc), builder.load(am)),
                          array_ptr(context, builder, sig, args, 15, o, _F16), align=4)
        return context.get_dummy_value()
    return types.none(isa_, m, q, qo, sc, mn, so, d, dm, do, nsb, lut, x, xb, xd, out, oo,
                      po, no), codegen


def _totals(builder, path, load, base, xos, scales, hint):  # type: ignore[no-untyped-def]
    """sum_s sc_s a_s (exact int32 lanes) of 16 interleaved rows against each row of x
    (quants at x.flat[xo], xo in `xos`), a_s sub-block s's integer dot: the superblock at
    q.flat[base ..], vector v = 8 p + 4 h + g holding bytes 32 p + 16 h + 4 g .. + 3 of every
    row, weights 64 p + 16 h + 4 g .. of sub-block 2 p (low nibbles) and the same of
    sub-block 2 p + 1 (high nibbles). A loop over the 4 pairs p of sub-blocks, each summed
    and scaled before the next is loaded: unrolled, LLVM split all 64 vectors of nibbles
    first and spilled them (4 rows of x: 129 against 166 G MAC/s in cache). `hint(offset)` after each load:
    one prefetch a vector, spread through the work (a burst of 32 at the end of each
    superblock streamed 5-10 % slower, docs/BENCHMARKS.md)."""
    zero = ir.Constant(_L16, [0] * 16)
    slots = [cgutils.alloca_once_value(builder, zero) for _ in xos]
    table = cgutils.alloca_once(builder, _L16, size=8)
    for s, v in enumerate(scales):
        builder.store(v, builder.gep(table, [ir.Constant(_I64, s)]))
    with cgutils.for_range(builder, ir.Constant(_I64, 4)) as loop:
        p = loop.index
        sums = [[ByteDots(builder, path, INT16_RUN[4]) for _ in range(2)] for _ in xos]
        for j in range(8):
            off = builder.add(builder.mul(p, ir.Constant(_I64, 512)), ir.Constant(_I64, 64 * j))
            nibbles = load(2, builder.add(base, off), _B64)
            hint(off)
            for half in range(2):
                part = bit_field(builder, path, nibbles, 4 * half, 15)
                pos = builder.add(builder.mul(p, ir.Constant(_I64, 64)), ir.Constant(
                    _I64, 32 * half + 16 * (j // 4) + 4 * (j % 4)))
                for r, xo in enumerate(xos):
                    xv = builder.bitcast(splat(builder, load(12, builder.add(xo, pos), _I32),
                                               _L16), _B64)
                    sums[r][half].add(part, xv)
        two_p = builder.mul(p, ir.Constant(_I64, 2))
        low_sc, high_sc = (builder.load(builder.gep(table, [builder.add(two_p, ir.Constant(
            _I64, h))])) for h in range(2))
        sums = [[dots.total() for dots in row] for row in sums]
        for slot, (low, high) in zip(slots, sums):
            builder.store(builder.add(builder.load(slot), builder.add(
                builder.mul(low, low_sc), builder.mul(high, high_sc))), slot)
    return [builder.load(slot) for slot in slots]


def _epilogue(builder, path, load, accs, totals, pairs, dw, dmin, at):  # type: ignore[no-untyped-def]
    """ggml's float epilogue of a superblock for each row r of x (accumulators accs[r]):
    acc = fma(total, d_w d_x, acc), am = fma(mins, dmin_w d_x, am), with x's sums of 32 at
    xb.flat[at(r, 8) ..] (int16, a pair of sub-blocks a 32-bit word) and d_x at
    xd.flat[at(r, 1)], the mins as int16 pairs (`_pairs`)."""
    for r, (acc, am) in enumerate(accs):
        bo = at(r, 8)
        b = [splat(builder, load(13, builder.add(bo, ir.Constant(_I64, 2 * p)), _I32, 2), _L16)
             for p in range(4)]
        dx = splat(builder, load(14, at(r, 1), ir.FloatType(), 4), _F16)
        builder.store(fma16(builder, builder.sitofp(totals[r], _F16), builder.fmul(dw, dx),
                            builder.load(acc)), acc)
        builder.store(fma16(builder, builder.sitofp(_min_total(builder, path, pairs, b), _F16),
                            builder.fmul(dmin, dx), builder.load(am)), am)


def _pairs(builder, mins):  # type: ignore[no-untyped-def]
    """The 8 sub-blocks' mins of 16 rows (8 vectors, each at most 63) as 4 vectors of int16
    pairs: sub-block 2 p in the low half of each lane of vector p, 2 p + 1 in the high."""
    return [builder.or_(mins[2 * p], builder.shl(mins[2 * p + 1], ir.Constant(_L16, [16] * 16)))
            for p in range(4)]


def _min_total(builder, path, pairs, sums):  # type: ignore[no-untyped-def]
    """sum_s mn_s (b_2s + b_2s+1) of 16 rows, exact int32 lanes, from the mins as int16
    pairs (`_pairs`) and one row of x's sums of 32 (within +-4096) paired the same way, in
    every lane (sums[p]: sub-blocks 2 p and 2 p + 1): one multiply-add of pairs
    (`ktiled.madd_pairs`) a pair of sub-blocks where two 32-bit multiplies and adds were."""
    total = ir.Constant(_L16, [0] * 16)
    for p in range(4):
        total = builder.add(total, madd_pairs(builder, path, pairs[p], sums[p]))
    return total


@functools.cache
def body(path: int, m: int) -> Callback:
    """One chunk of 16 interleaved Q4_K weight rows against x's m rows (`q4_k_rows`),
    compiled once per SIMD path and row count as a C callback."""
    def chunk(q_p, n, rb, sc_p, mn_p, d_p, dm_p, lut_p, x_p, rows, k, xb_p, xd_p, out_p, c):  # type: ignore[no-untyped-def]
        nsb = k // 256
        q, sc, mn = carray(q_p, (n * rb,)), carray(sc_p, (n * 8 * nsb,)), carray(mn_p, (n * 8 * nsb,))
        d, dm, lut = carray(d_p, (n * nsb,)), carray(dm_p, (n * nsb,)), carray(lut_p, (1 << 16,))
        x, xb, xd = carray(x_p, (m * k,)), carray(xb_p, (m * k // 32,)), carray(xd_p, (m * nsb,))
        out = carray(out_p, (m * n,))
        r0 = LANES * c
        p0 = min(r0 + LANES, n - LANES)
        if p0 > r0:         # the next chunk's scales, mins, d and dmin, a few lines each
            prefetch_span(sc, p0 * 8 * nsb, (p0 + LANES) * 8 * nsb, 64)
            prefetch_span(mn, p0 * 8 * nsb, (p0 + LANES) * 8 * nsb, 64)
            prefetch_span(d, p0 * nsb, (p0 + LANES) * nsb, 32)
            prefetch_span(dm, p0 * nsb, (p0 + LANES) * nsb, 32)
        q4_k_rows(path, m, q, r0 * rb, sc, mn, r0 * 8 * nsb, d, dm, r0 * nsb, nsb, lut, x, xb,
                  xd, out, r0, p0 * rb, n)
    u8, u16, i64, f32 = (types.CPointer(types.uint8), types.CPointer(types.uint16), types.int64,
                         types.CPointer(types.float32))
    return callback(u8, i64, i64, u8, u8, u16, u16, f32, types.CPointer(types.int8), i64, i64,
                    types.CPointer(types.int16), f32, f32, i64, exact=True)(chunk)


@kernel(parallel=True, exact=True)
def _rows(fn, q, sc, mn, d, dmin, lut, xq, xd, xb, sums32, out, threads, quantize, x):  # type: ignore[no-untyped-def]
    """out = the body at `fn` on every chunk of 16 weight rows, in parallel; with `quantize`
    (`activations.q8_k_blocks`' address, else 0) x's float rows are first quantized into
    xq/xd/xb on this thread. Where sums32 has columns (a Q4_K's body), the body reads x's
    sums of 32 (`ktiled.sums_of_32`, written there) in place of its sums of 16."""
    if quantize != 0:
        for i in range(x.shape[0]):
            call_address(quantize, (data_pointer(x), x.shape[0], x.shape[1], data_pointer(xq),
                                    data_pointer(xd), data_pointer(xb), i, 0,
                                    x.shape[1] // 256))
    sums = sums_of_32(xb, sums32)
    prev = limit_threads(threads)
    n = q.shape[0]
    for c in prange(n // LANES):
        call_address(fn, (data_pointer(q), n, q.shape[1], data_pointer(sc), data_pointer(mn),
                          data_pointer(d), data_pointer(dmin), data_pointer(lut),
                          data_pointer(xq), xq.shape[0], xq.shape[1], data_pointer(sums),
                          data_pointer(xd),
                          data_pointer(out), c))
    restore_threads(prev)


def matmul(w: QuantMatrix, x: activations.Q8KRows | None = None,
           floats: np.ndarray | None = None, path: str | None = None) -> np.ndarray:
    """x's rows `[M, K]` through W interleaved (`qmatmul.interleave`), each row in the order
    llama.cpp computes a one-row request in: a repacked Q4_K's GEMV (M <= `MAX_ROWS`) or
    Q6_K's vec_dot (`krow6`, any M). x as Q8_K blocks (`x`), or as floats quantized inside
    the kernel's call into this thread's kept scratch (`floats`)."""
    if (x is None) == (floats is None):
        raise TypeError("krow.matmul takes x's Q8_K blocks or its floats, one of them")
    if not w.interleaved:
        raise ValueError("krow.matmul reads a Q4_K or Q6_K whose rows are interleaved")
    m, k = (x.qs if floats is None else floats).shape
    six = w.qtype == T.Q6_K
    if m < 1 or (m > MAX_ROWS and not six):
        raise ValueError(f"krow.matmul takes 1 to {MAX_ROWS} rows of x on a Q4_K, not {m}")
    code = isa.code(path) if path else isa.selected_code()
    plan = w.memo.get(("krow", code, 0 if six else m))
    if plan is None:
        fn = krow6.body(code).address if six else body(code, m).address
        planes = w.planes
        if six:                  # low bits, scales (as bytes), high bits, d, (no dmin)
            planes = (planes[0], planes[2].view(np.uint8), planes[1], planes[3], planes[3])
        plan = w.memo[("krow", code, 0 if six else m)] = (fn, planes)
    fn, (q, sc, mn, d, dmin) = plan
    threads = 1 if w.rows * w.cols * m <= SERIAL_MAX_WORK else 0
    out = np.empty((m, w.rows), np.float32)
    if floats is not None:
        x = kept(("krow", m, k), lambda: activations.Q8KRows(
            np.zeros((m, k), np.int8), np.zeros((m, k // 256), np.float32),
            np.zeros((m, k // 16), np.int16)))
    sums32 = NO_SUMS if six else kept(("krow sums", m, k),
                                       lambda: np.zeros((m, k // 32), np.int16))
    _rows(fn, q, sc, mn, d, dmin, HALF_LUT, x.qs, x.d, x.bsums, sums32, out, threads,
          0 if floats is None else activations.q8_k_blocks.address,
          _NO_F32 if floats is None else np.ascontiguousarray(floats, np.float32))
    return out
