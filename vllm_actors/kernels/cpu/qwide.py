"""The 32-weight block types' matmuls of many rows of x (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL
on Q8_0/Q8_1 blocks), in `qmatmul_int`'s float orders, with 16 weight rows as the lanes of
a vector (as `ktiled` does for the K-quants). A chunk of 16 weight rows is decoded once into
bytes, interleaved 4 codes per row, and serves every row of x: per block, group t of 4
weights (t < 8) of all 16 rows against x's 4 quants (broadcast) is one `vpdpbusd`, whose lane
i is row i's int32 lane t of ggml's `vec_dot`. So the 8 float lanes ggml keeps per output
are 8 vectors here, acc_t = fma(float(lanes_t), d_w d_x, acc_t) per block, added at the end
in `hsum_float_8`'s order (+ the min sums of Q4_1/Q5_1, fma(m_w, s_x, summs) per block); the
repacked order (`qmatmul_int.REPACKED`) keeps one chain, fma(block's sum, d_w d_x, acc).

Signed weights reach `vpdpbusd` as unsigned codes: Q4_0/Q5_0's quants as stored (their
offset 8 or 16), Q8_0/IQ4_NL's int8 values plus 128, less offset * (x's sums of 4),
computed once per call (`_offsets`). AVX2 multiplies Q8_0/IQ4_NL's |w| by x carrying w's
sign, as ggml does; the portable path widens. Every path gives the same integers.
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import quants as gguf_quants
from llvmlite import ir
from numba import carray, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from vllm_actors.kernels.cpu import activations, isa
from vllm_actors.kernels.cpu.intrinsics import call_address, data_pointer, stack_i64
from vllm_actors.kernels.cpu.jit import Callback, callback, kernel
from vllm_actors.kernels.cpu.ktiled import (LANES, array_ptr, dot4, fma16, llvm_call,
                                            transpose_rows)
from vllm_actors.kernels.cpu.qdot import AVX2, AVX512, PORTABLE
from vllm_actors.kernels.cpu.qmatmul import SERIAL_MAX_WORK, QuantMatrix
from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT, limit_threads, restore_threads
from vllm_actors.kernels.cpu.qmatmul_simd import fmuladd, splat

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
_B64, _B32, _B16 = ir.VectorType(_I8, 64), ir.VectorType(_I8, 32), ir.VectorType(_I8, 16)
_L16, _L8 = ir.VectorType(_I32, 16), ir.VectorType(_I32, 8)
_F16 = ir.VectorType(ir.FloatType(), 16)
_W16 = ir.VectorType(_I16, 16)
LANES_ORDER, SCALAR_ORDER = 0, 1      # vec_dot's 8 float lanes, or the repacked one chain
OFFSET = {40: 8, 50: 16, 8: 128, 41: 128}   # what the unsigned codes carry (Q4_1/Q5_1: 0)
_LOG2 = {8: 3, 16: 4, 128: 7}


def signed_codes(path: int, kind: int) -> bool:
    """Whether codes stay int8 (Q8_0, IQ4_NL off the VNNI path) instead of biased bytes."""
    return kind in (8, 41) and path != AVX512


def _block(builder, path, kind, packed, bits):  # type: ignore[no-untyped-def]
    """A block's 32 codes as <32 x i8>: element j < 16 the low nibble of byte j, j >= 16 the
    high nibble of byte j - 16 (plus the fifth bit j of `bits` for Q5_x), Q8_0's int8 as
    stored; IQ4_NL's nibbles looked up in its table; Q8_0/IQ4_NL biased by 128 unless
    `signed_codes`."""
    if kind == 8:
        w = packed
    else:
        lo = builder.and_(packed, ir.Constant(_B16, [15] * 16))
        hi = builder.lshr(packed, ir.Constant(_B16, [4] * 16))
        w = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        if kind in (5, 50):
            mask = builder.bitcast(bits, ir.VectorType(_I1, 32))
            w = builder.or_(w, builder.select(mask, ir.Constant(_B32, [16] * 32),
                                              ir.Constant(_B32, [0] * 32)))
        if kind == 41:
            table = [v & 0xFF for v in gguf_quants.IQ4_NL.kvalues]
            if path == PORTABLE:
                out = ir.Constant(_B32, [table[0]] * 32)
                for i in range(1, 16):
                    hit = builder.icmp_unsigned("==", w, ir.Constant(_B32, [i] * 32))
                    out = builder.select(hit, ir.Constant(_B32, [table[i]] * 32), out)
                w = out
            else:
                w = llvm_call(builder, "llvm.x86.avx2.pshuf.b", _B32,
                          [ir.Constant(_B32, table * 2), w])
    if kind in (8, 41) and not signed_codes(path, kind):
        w = builder.xor(w, ir.Constant(_B32, [0x80] * 32))
    return w


@intrinsic
def decode_blocks(typingctx, isa_, kind, q, qoff, step, qh, hoff, nb, codes):  # type: ignore[no-untyped-def]
    """16 weight rows' nb blocks (row l's quant bytes from q.flat[qoff[l]], `step` bytes a
    block; Q5_x's fifth bits qh.flat[hoff[l] + b], uint32) into codes: the 4 codes of group
    t of block b of row l at codes[16 (8 b + t) + l] (int32)."""
    if not (isinstance(isa_, types.IntegerLiteral) and isinstance(kind, types.IntegerLiteral)
            and isinstance(codes, types.Array) and codes.dtype == types.int32):
        return None
    path, form = isa_.literal_value, kind.literal_value
    width = _B32 if form == 8 else _B16

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        step_, nb_ = (context.cast(builder, args[i], sig.args[i], types.intp) for i in (4, 7))
        bases = [[builder.load(array_ptr(context, builder, sig, args, i,
                                         ir.Constant(_I64, lane), _I64))
                  for lane in range(LANES)] for i in (3, 6)]
        with cgutils.for_range(builder, nb_) as loop:
            b = loop.index
            rows = []
            for lane in range(LANES):
                at = builder.add(bases[0][lane], builder.mul(b, step_))
                packed = builder.load(array_ptr(context, builder, sig, args, 2, at, width),
                                      align=1)
                bits = None
                if form in (5, 50):
                    bits = builder.load(array_ptr(context, builder, sig, args, 5,
                                             builder.add(bases[1][lane], b), _I32), align=4)
                rows.append(builder.bitcast(_block(builder, path, form, packed, bits), _L8))
            for t, v in enumerate(transpose_rows(builder, rows)):
                at = builder.mul(builder.add(builder.mul(b, ir.Constant(_I64, 8)),
                                             ir.Constant(_I64, t)), ir.Constant(_I64, LANES))
                builder.store(v, array_ptr(context, builder, sig, args, 8, at, _L16), align=4)
        return context.get_dummy_value()
    return types.none(isa_, kind, q, qoff, step, qh, hoff, nb, codes), codegen


def _dot_signed(builder, path, w, x):  # type: ignore[no-untyped-def]
    """Lane i of (sum over t < 4 of w[4i+t] x[4i+t]) for int8 w and x (Q8_0 / IQ4_NL off the
    VNNI path): AVX2 multiplies |w| by x carrying w's sign (exact unless x holds -128, as
    ggml), the portable path widens."""
    if path == AVX2:
        halves = []
        for h in range(2):
            pick = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))
            wh, xh = (builder.shuffle_vector(v, v, pick) for v in (w, x))
            neg = builder.icmp_signed("<", wh, ir.Constant(_B32, [0] * 32))
            aw = builder.select(neg, builder.neg(wh), wh)
            sx = builder.select(neg, builder.neg(xh), xh)
            pairs = llvm_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [aw, sx])
            halves.append(llvm_call(builder, "llvm.x86.avx2.pmadd.wd", _L8,
                                [pairs, ir.Constant(_W16, [1] * 16)]))
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_L16, list(range(16))))
    wide = ir.VectorType(_I32, 64)
    p = builder.mul(builder.sext(w, wide), builder.sext(x, wide))
    acc = ir.Constant(_L16, [0] * 16)
    for t in range(4):
        pick = ir.Constant(_L16, list(range(t, 64, 4)))
        acc = builder.add(acc, builder.shuffle_vector(p, p, pick))
    return acc


def _hsum8(builder, a):  # type: ignore[no-untyped-def]
    """ggml's `hsum_float_8` of 8 lanes, here 8 vectors: ((a4 + a0) + (a6 + a2)) + ((a5 +
    a1) + (a7 + a3))."""
    f = builder.fadd
    return f(f(f(a[4], a[0]), f(a[6], a[2])), f(f(a[5], a[1]), f(a[7], a[3])))


@intrinsic
def row_dots(typingctx, isa_, kind, order, codes, nb, dw, mw, x, xo, xc, co, xd, xs, so, out, oo):  # type: ignore[no-untyped-def]
    """One row of x (quants at x.flat[xo], 32 a block; offset terms xc.flat[co + 8 b + t];
    scales xd.flat[so + b]; Q8_1's sums xs.flat[so + b]) against a chunk's nb decoded blocks
    (d_w at dw[16 b + i], Q4_1/Q5_1's m_w at mw[16 b + i]): out.flat[oo : oo+16] = the 16
    outputs in `order`'s float order, lane i for weight row i."""
    if not (isinstance(isa_, types.IntegerLiteral) and isinstance(kind, types.IntegerLiteral)
            and isinstance(order, types.IntegerLiteral) and isinstance(x, types.Array)
            and x.dtype == types.int8):
        return None
    path, form, how = isa_.literal_value, kind.literal_value, order.literal_value
    signed = signed_codes(path, form)
    offset = form in OFFSET and not signed
    mins = form in (4, 5)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        nb_, xo_, co_, so_, oo_ = (context.cast(builder, args[i], sig.args[i], types.intp)
                                   for i in (4, 8, 10, 13, 15))
        zero = ir.Constant(_F16, [0.0] * 16)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(8 if how == LANES_ORDER
                                                                        else 0)]
        chain = cgutils.alloca_once_value(builder, zero)      # min sums, or the one chain

        def load(i, idx, ty, align=4):  # type: ignore[no-untyped-def]
            return builder.load(array_ptr(context, builder, sig, args, i, idx, ty), align=align)

        with cgutils.for_range(builder, nb_) as loop:
            b = loop.index
            sb = builder.add(so_, b)
            scale = builder.fmul(load(5, builder.mul(b, ir.Constant(_I64, LANES)), _F16),
                                 splat(builder, load(11, sb, ir.FloatType()), _F16))
            lanes = _block_lanes(builder, path, signed, offset, load, b, xo_, co_)
            if how == SCALAR_ORDER:
                whole = lanes[0]
                for v in lanes[1:]:
                    whole = builder.add(whole, v)
                builder.store(fma16(builder, builder.sitofp(whole, _F16), scale,
                                   builder.load(chain)), chain)
            else:
                for t, v in enumerate(lanes):
                    builder.store(fmuladd(builder, builder.sitofp(v, _F16), scale,
                                          builder.load(accs[t])), accs[t])
                if mins:
                    m_w = load(6, builder.mul(b, ir.Constant(_I64, LANES)), _F16)
                    s_x = splat(builder, load(12, sb, ir.FloatType()), _F16)
                    builder.store(fma16(builder, m_w, s_x, builder.load(chain)), chain)
        if how == SCALAR_ORDER:
            total = builder.load(chain)
        else:
            total = _hsum8(builder, [builder.load(a) for a in accs])
            if mins:
                total = builder.fadd(total, builder.load(chain))
        builder.store(total, array_ptr(context, builder, sig, args, 14, oo_, _F16), align=4)
        return context.get_dummy_value()
    return types.none(isa_, kind, order, codes, nb, dw, mw, x, xo, xc, co, xd, xs, so, out,
                      oo), codegen


def _block_lanes(builder, path, signed, offset, load, b, xo, co):  # type: ignore[no-untyped-def]
    """Block b's 8 integer lanes of all 16 rows (`row_dots`' arguments through `load`): group
    t's 4 codes against x's 4 quants broadcast, less the offset term where the codes carry
    one."""
    lanes = []
    for t in range(8):
        k4 = builder.add(builder.mul(b, ir.Constant(_I64, 8)), ir.Constant(_I64, t))
        xw = load(7, builder.add(xo, builder.mul(k4, ir.Constant(_I64, 4))), _I32, 1)
        xv = builder.bitcast(splat(builder, xw, _L16), _B64)
        w = load(3, builder.mul(k4, ir.Constant(_I64, LANES)), _B64)
        if signed:
            lanes.append(_dot_signed(builder, path, w, xv))
            continue
        init = ir.Constant(_L16, [0] * 16)
        if offset:
            init = splat(builder, load(9, builder.add(co, k4), _I32), _L16)
        lanes.append(dot4(builder, path, init, w, xv))
    return lanes


@functools.cache
def body(path: int, kind: int, order: int, q_dtype: str) -> Callback:
    """The work of one chunk of 16 weight rows (decode every block once, then every row of
    x) for a SIMD path, qdot kind and float order, compiled once as a C callback."""
    has_bits, has_min = kind in (5, 50), kind in (4, 5)

    def chunk(q_p, n, rb, qh_p, d_p, mn_p, lut_p, x_p, m, k, xc_p, xd_p, xs_p, out_p, n16,
              c):  # type: ignore[no-untyped-def]
        nb = k // 32
        q, qh = carray(q_p, (n * rb,)), carray(qh_p, (n * nb if has_bits else 0,))
        d, mn = carray(d_p, (n, nb)), carray(mn_p, (n if has_min else 0, nb))
        lut, x = carray(lut_p, (1 << 16,)), carray(x_p, (m * k,))
        xc, xd, xs = carray(xc_p, (m * k // 4,)), carray(xd_p, (m * nb,)), carray(xs_p, (m * nb,))
        out = carray(out_p, (m * n16,))
        codes = np.empty(nb * 8 * LANES, np.int32)        # the chunk's decoded rows
        dw, mw = np.empty(nb * LANES, np.float32), np.empty(nb * LANES if has_min else 0,
                                                            np.float32)
        qoff, hoff = stack_i64(16), stack_i64(16)
        i0 = LANES * c
        for lane in range(LANES):
            r = min(i0 + lane, n - 1)
            qoff[lane], hoff[lane] = r * rb, r * nb
            for b in range(nb):
                dw[LANES * b + lane] = lut[d[r, b]]
                if has_min:
                    mw[LANES * b + lane] = lut[mn[r, b]]
        decode_blocks(path, kind, q, qoff, rb // nb, qh, hoff, nb, codes)
        for mm in range(m):
            row_dots(path, kind, order, codes, nb, dw, mw, x, mm * k, xc, mm * (k // 4), xd,
                     xs, mm * nb, out, mm * n16 + i0)
    f32, i64 = types.CPointer(types.float32), types.int64
    q_t = types.CPointer(types.int8 if q_dtype == "|i1" else types.uint8)
    return callback(q_t, i64, i64, types.CPointer(types.uint32), types.CPointer(types.uint16),
                    types.CPointer(types.uint16), f32, types.CPointer(types.int8), i64, i64,
                    types.CPointer(types.int32), f32, f32, f32, i64, i64, exact=True)(chunk)


@kernel(exact=True)
def _offsets(xq, shift, out):  # type: ignore[no-untyped-def]
    """out[m, g] = -(x's quants 4g .. 4g+3 summed) << shift: the offset's term of a lane."""
    for m in range(xq.shape[0]):
        for g in range(out.shape[1]):
            total = np.int32(0)
            for t in range(4):
                total += np.int32(xq[m, 4 * g + t])
            out[m, g] = -(total << shift)


@kernel(parallel=True, exact=True)
def _wide(fn, qs, qh, d, mn, lut, xq, xc, xd, xs, out, threads):  # type: ignore[no-untyped-def]
    """out = the body at `fn` on every chunk of 16 weight rows, in parallel (fixed chunks:
    the result does not depend on the thread count)."""
    prev = limit_threads(threads)
    n = qs.shape[0]
    for c in prange((n + LANES - 1) // LANES):
        call_address(fn, (data_pointer(qs), n, qs.shape[1], data_pointer(qh), data_pointer(d),
                          data_pointer(mn), data_pointer(lut), data_pointer(xq), xq.shape[0],
                          xq.shape[1], data_pointer(xc), data_pointer(xd), data_pointer(xs),
                          data_pointer(out), out.shape[1], c))
    restore_threads(prev)


_NO_I32 = np.zeros((0, 0), np.int32)


def matmul(w: QuantMatrix, planes: tuple[np.ndarray, ...], x: activations.Q8Rows, kind: int,
           order: int, path: str | None = None) -> np.ndarray:
    """x's Q8 blocks `[M, K]` -> `[M, N]` for W's planes (qs, qh, d, mn as
    `qmatmul_int._plan` gives them) and qdot `kind`, in `order`: LANES_ORDER (vec_dot's,
    tinyBLAS's) or SCALAR_ORDER (the repacked kernels'). `path` forces a SIMD path."""
    code = isa.code(path) if path else isa.selected_code()
    qs, qh, d, mn = planes
    fn = body(code, kind, order, qs.dtype.str).address
    m, k = x.qs.shape
    xc = _NO_I32
    if kind in OFFSET and not signed_codes(code, kind):
        xc = np.empty((m, k // 4), np.int32)
        _offsets(x.qs, _LOG2[OFFSET[kind]], xc)
    n16 = -(-w.rows // LANES) * LANES
    out = np.empty((m, n16), np.float32)
    threads = 1 if w.rows * w.cols * m <= SERIAL_MAX_WORK else 0
    _wide(fn, qs, qh, d, mn, HALF_LUT, x.qs, xc, x.d, x.s, out, threads)
    return out if n16 == w.rows else np.ascontiguousarray(out[:, :w.rows])
