"""A decode step's K-quant linear: one row of x (Q8_K blocks) against a Q4_K weight that
llama.cpp repacks (`qmatmul_int_k.REPACKED_Q4_K`, its 8x8 GEMV's float order), with 16 weight
rows as the lanes of a vector and no decoded copy: per superblock, every 16 stored bytes of
the 16 rows are loaded and transposed in registers (`ktiled.transpose_words`), split into
nibbles on all rows at once, and multiplied by x's 4 quants (broadcast) with one 4-byte dot
product a group (`ktiled.dot4`). Sub-block s's sums a_s then give the exact integers

    total = sum_s sc_s a_s          mins = sum_s mn_s (b_2s + b_2s+1)

(b x's sums of 16) and ggml's epilogue per superblock, acc = fma(total, d_w d_x, acc), am =
fma(mins, dmin_w d_x, am), the result acc - am: bit for bit the pair GEMV's floats
(`tests/kernels/test_ktiled.py`). As `qwide.one_row` does for the 32-weight types, the last
chunk overlaps the one before, so every chunk has one row stride, and the next chunk's rows
are prefetched as the superblocks go. Parallel over fixed chunks of 16 weight rows.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import carray, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from vllm_actors.kernels.cpu import activations, isa
from vllm_actors.kernels.cpu.intrinsics import call_address, data_pointer, prefetch_line
from vllm_actors.kernels.cpu.jit import Callback, callback, kernel
from vllm_actors.kernels.cpu.ktiled import (LANES, array_ptr, dot4, fma16, transpose_words)
from vllm_actors.kernels.cpu.qmatmul import SERIAL_MAX_WORK, QuantMatrix
from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT, kept, limit_threads, restore_threads
from vllm_actors.kernels.cpu.qmatmul_simd import splat
from vllm_actors.kernels.cpu.qwide import half_vector

_I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (8, 16, 32, 64))
_B64 = ir.VectorType(_I8, 64)
_L16 = ir.VectorType(_I32, 16)
_F16 = ir.VectorType(ir.FloatType(), 16)
_NO_F32 = np.zeros((0, 0), np.float32)


@intrinsic
def q4_k_row(typingctx, isa_, q, qo, rb, sc, mn, so, d, dm, do, nsb, lut, x, xb, xd, out, oo, po):  # type: ignore[no-untyped-def]
    """x's one row (quants x.flat[256 sb ..], sums of 16 xb.flat[16 sb ..], scales xd.flat[sb])
    against 16 Q4_K weight rows: row l's quants at q.flat[qo + l rb], its 8 scales and mins a
    superblock at sc.flat / mn.flat[so + l 8 nsb + 8 sb], d and dmin at d.flat / dm.flat[do +
    l nsb + sb]; out.flat[oo : oo+16] = the 16 outputs in the repacked GEMV's float order. The
    rows at q.flat[po + l rb] are prefetched as the superblocks go."""
    if not (isinstance(isa_, types.IntegerLiteral) and isinstance(x, types.Array)
            and x.dtype == types.int8):
        return None
    path = isa_.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        qo_, rb_, so_, do_, nsb_, oo_, po_ = (
            context.cast(builder, args[i], sig.args[i], types.intp)
            for i in (2, 3, 6, 9, 10, 16, 17))

        def load(i, idx, ty, align=1):  # type: ignore[no-untyped-def]
            return builder.load(array_ptr(context, builder, sig, args, i, idx, ty), align=align)

        def rows(start, stride):  # type: ignore[no-untyped-def]
            return [builder.add(start, builder.mul(stride, ir.Constant(_I64, lane)))
                    for lane in range(LANES)]

        zero = ir.Constant(_F16, [0.0] * 16)
        acc, am = (cgutils.alloca_once_value(builder, zero) for _ in range(2))
        with cgutils.for_range(builder, nsb_) as loop:
            sb = loop.index
            base = builder.mul(sb, ir.Constant(_I64, 128))
            sums = _sub_block_sums(builder, path, load, rows(builder.add(qo_, base), rb_),
                                   builder.mul(sb, ir.Constant(_I64, 256)))
            _prefetch(context, builder, sig, args, rows(builder.add(po_, base), rb_))
            at = rows(builder.add(so_, builder.mul(sb, ir.Constant(_I64, 8))),
                      builder.mul(nsb_, ir.Constant(_I64, 8)))
            total, mins = _scaled(builder, sums, _bytes8(builder, load, 4, at),
                                  _bytes8(builder, load, 5, at),
                                  [load(13, builder.add(builder.mul(sb, ir.Constant(_I64, 16)),
                                                        ir.Constant(_I64, u)), _I16, 2)
                                   for u in range(16)])
            hs = rows(builder.add(do_, sb), nsb_)
            dx = splat(builder, load(14, sb, ir.FloatType(), 4), _F16)

            def halves(i):  # type: ignore[no-untyped-def]
                return half_vector(builder, [load(i, h, _I16, 2) for h in hs],
                               lambda v: load(11, builder.zext(v, _I64), ir.FloatType(), 4))
            builder.store(fma16(builder, builder.sitofp(total, _F16),
                                builder.fmul(halves(7), dx), builder.load(acc)), acc)
            builder.store(fma16(builder, builder.sitofp(mins, _F16),
                                builder.fmul(halves(8), dx), builder.load(am)), am)
        builder.store(builder.fsub(builder.load(acc), builder.load(am)),
                      array_ptr(context, builder, sig, args, 15, oo_, _F16), align=4)
        return context.get_dummy_value()
    return types.none(isa_, q, qo, rb, sc, mn, so, d, dm, do, nsb, lut, x, xb, xd, out, oo,
                      po), codegen


def _sub_block_sums(builder, path, load, at, xo):  # type: ignore[no-untyped-def]
    """The 8 sub-blocks' integer dots a_s of 16 rows (row l's superblock quants at
    q.flat[at[l]], x's at x.flat[xo]): bytes 32 p + 16 h + 4 g .. + 3 of every row, one
    transposed vector, hold weights 64 p + 16 h + 4 g .. of sub-block 2 p (low nibbles) and
    the same of sub-block 2 p + 1 (high nibbles)."""
    sums = [ir.Constant(_L16, [0] * 16)] * 8
    for p in range(4):
        for h in range(2):
            stored = [load(1, builder.add(o, ir.Constant(_I64, 32 * p + 16 * h)),
                           ir.VectorType(_I32, 4)) for o in at]
            for g, v in enumerate(transpose_words(builder, stored)):
                nibbles = builder.bitcast(v, _B64)
                for half in range(2):
                    part = builder.lshr(nibbles, ir.Constant(_B64, [4] * 64)) if half else nibbles
                    part = builder.and_(part, ir.Constant(_B64, [15] * 64))
                    pos = 64 * p + 32 * half + 16 * h + 4 * g
                    xv = builder.bitcast(splat(builder, load(12, builder.add(
                        xo, ir.Constant(_I64, pos)), _I32), _L16), _B64)
                    s = 2 * p + half
                    sums[s] = dot4(builder, path, sums[s], part, xv)
    return sums


def _bytes8(builder, load, i, at):  # type: ignore[no-untyped-def]
    """16 rows' 8 unsigned bytes (row l's at array i's flat[at[l]]) as 8 vectors <16 x
    i32>, byte s of every row in vector s."""
    v = ir.Constant(ir.VectorType(_I64, 16), ir.Undefined)
    for lane, o in enumerate(at):
        v = builder.insert_element(v, load(i, o, _I64), ir.Constant(_I32, lane))
    raw = builder.bitcast(v, ir.VectorType(_I8, 128))
    return [builder.zext(builder.shuffle_vector(raw, raw, ir.Constant(
        ir.VectorType(_I32, 16), [8 * lane + s for lane in range(LANES)])), _L16)
        for s in range(8)]


def _scaled(builder, sums, scales, mins, bsums):  # type: ignore[no-untyped-def]
    """(sum_s sc_s a_s, sum_s mn_s (b_2s + b_2s+1)) of 16 rows, exact int32 lanes, from the
    sub-blocks' sums, scales and mins (8 vectors each) and x's 16 sums of 16 (int16)."""
    total = mins_total = ir.Constant(_L16, [0] * 16)
    for s in range(8):
        total = builder.add(total, builder.mul(sums[s], scales[s]))
        b = builder.add(builder.sext(bsums[2 * s], _I32), builder.sext(bsums[2 * s + 1], _I32))
        mins_total = builder.add(mins_total, builder.mul(mins[s], splat(builder, b, _L16)))
    return total, mins_total


def _prefetch(context, builder, sig, args, at):  # type: ignore[no-untyped-def]
    """Hints of the next chunk's superblock (row l's 128 bytes from q.flat[at[l]]), each of
    its 32 lines once: asking twice, as `qwide.fused_row` does, measured slower here (39-43
    against 45-49 GB/s on the 8B's 14336x4096, docs/BENCHMARKS.md)."""
    for line in (0, 64):
        for o in at:
            off = builder.add(o, ir.Constant(_I64, line))
            prefetch_line(builder, array_ptr(context, builder, sig, args, 1, off, _I8))


@functools.cache
def body(path: int) -> Callback:
    """One chunk of 16 Q4_K weight rows against x's one row (`q4_k_row`), compiled once per
    SIMD path as a C callback."""
    def chunk(q_p, n, rb, sc_p, mn_p, d_p, dm_p, lut_p, x_p, k, xb_p, xd_p, out_p, c):  # type: ignore[no-untyped-def]
        nsb = k // 256
        q, sc, mn = carray(q_p, (n * rb,)), carray(sc_p, (n * 8 * nsb,)), carray(mn_p, (n * 8 * nsb,))
        d, dm, lut = carray(d_p, (n * nsb,)), carray(dm_p, (n * nsb,)), carray(lut_p, (1 << 16,))
        x, xb, xd = carray(x_p, (k,)), carray(xb_p, (k // 16,)), carray(xd_p, (nsb,))
        out = carray(out_p, (LANES * c + LANES,))
        r0 = min(LANES * c, n - LANES)     # the last chunk overlaps the one before
        p0 = min(r0 + LANES, n - LANES)
        q4_k_row(path, q, r0 * rb, rb, sc, mn, r0 * 8 * nsb, d, dm, r0 * nsb, nsb, lut, x, xb,
                 xd, out, r0, p0 * rb)
    u8, u16, i64, f32 = (types.CPointer(types.uint8), types.CPointer(types.uint16), types.int64,
                         types.CPointer(types.float32))
    return callback(u8, i64, i64, u8, u8, u16, u16, f32, types.CPointer(types.int8), i64,
                    types.CPointer(types.int16), f32, f32, i64, exact=True)(chunk)


@kernel(parallel=True, exact=True)
def _rows(fn, q, sc, mn, d, dmin, lut, xq, xd, xb, out, threads, quantize, x):  # type: ignore[no-untyped-def]
    """out = the body at `fn` on every chunk of 16 weight rows, in parallel; with `quantize`
    (`activations.q8_k_blocks`' address, else 0) x's float row is first quantized into
    xq/xd/xb on this thread."""
    if quantize != 0:
        call_address(quantize, (data_pointer(x), 1, x.shape[1], data_pointer(xq),
                                data_pointer(xd), data_pointer(xb), 0, 0, x.shape[1] // 256))
    prev = limit_threads(threads)
    n = q.shape[0]
    for c in prange((n + LANES - 1) // LANES):
        call_address(fn, (data_pointer(q), n, q.shape[1], data_pointer(sc), data_pointer(mn),
                          data_pointer(d), data_pointer(dmin), data_pointer(lut),
                          data_pointer(xq), xq.shape[1], data_pointer(xb), data_pointer(xd),
                          data_pointer(out), c))
    restore_threads(prev)


def matmul(w: QuantMatrix, x: activations.Q8KRows | None = None,
           floats: np.ndarray | None = None, path: str | None = None) -> np.ndarray:
    """x's one row `[1, K]` through W, a Q4_K of 16 rows or more in the repacked GEMV's
    order: as Q8_K blocks (`x`), or as floats quantized inside the kernel's call into this
    thread's kept scratch (`floats`)."""
    if (x is None) == (floats is None):
        raise TypeError("krow.matmul takes x's Q8_K blocks or its floats, one of them")
    code = isa.code(path) if path else isa.selected_code()
    plan = w.memo.get(("krow", code))
    if plan is None:
        threads = 1 if w.rows * w.cols <= SERIAL_MAX_WORK else 0
        plan = w.memo[("krow", code)] = (body(code).address, w.planes, threads)
    fn, (q, sc, mn, d, dmin), threads = plan
    k = w.cols
    out = np.empty((1, w.rows), np.float32)
    if floats is not None:
        x = kept(("krow", k), lambda: activations.Q8KRows(
            np.zeros((1, k), np.int8), np.zeros((1, k // 256), np.float32),
            np.zeros((1, k // 16), np.int16)))
    _rows(fn, q, sc, mn, d, dmin, HALF_LUT, x.qs, x.d, x.bsums, out, threads,
          0 if floats is None else activations.q8_k_blocks.address,
          _NO_F32 if floats is None else np.ascontiguousarray(floats, np.float32))
    return out
