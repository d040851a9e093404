"""The integer dot product of one 32-weight block with one Q8 activation block, as a numba
intrinsic: `qdot(isa, kind, acc, ai, q, qi, bits, x, xi, scale)` adds
`scale * lanes(w . x)` to the float32 accumulator acc[ai:ai+8].

- `kind` (a literal) says how the block's 32 weights are stored at q.flat[qi]: 4 = 16 bytes
  of nibbles, element j < 16 the low nibble of byte j and j >= 16 the high nibble of byte
  j - 16 (Q4_1); 5 = the same plus the fifth bit j of `bits` (Q5_1); 40 and 50 = the same
  less the offset 8 or 16 (Q4_0, Q5_0: signed, as ggml's dots); 8 = 32 int8 (Q8_0); 41 = the
  nibbles as indices into IQ4_NL's int8 table (`vpshufb`). Mins are the caller's.
- `isa` (a literal, `isa.code`) picks the instructions: portable widening multiplies,
  AVX2's `vpmaddubsw` + `vpmaddwd`, or VNNI's `vpdpbusd`. Each gives int32 lane i = the sum
  of the products of bytes 4i..4i+3, exactly, so every path produces the same floats.
- x is int8 at x.flat[xi]. Signed weights (Q4_0, Q5_0; Q8_0, IQ4_NL with VNNI) multiply the
  stored unsigned bytes (Q8_0's plus 128) and take offset * (x's sums of 4) off the lanes:
  no per-block sign work, and the sums serve every weight row of the x block. Q8_0 / IQ4_NL
  on AVX2 multiply |w| by x with w's sign (llama.cpp's trick: `vpmaddubsw` would saturate on
  w + 128), exact unless x holds -128 (only a NaN block does, whose scale is NaN anyway).

One block per call, with the accumulator in a stack array that LLVM keeps in a register:
the kernels' loops stay numba code, and nothing moves between numba tuples and vectors.
"""

from __future__ import annotations

from gguf import quants as gguf_quants
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from vllm_actors.kernels.cpu.isa import code
from vllm_actors.kernels.cpu.qmatmul_simd import fmuladd, splat, vector_ptr

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_B32 = ir.VectorType(_I8, 32)
_B16 = ir.VectorType(_I8, 16)
_W16 = ir.VectorType(_I16, 16)
_L8 = ir.VectorType(_I32, 8)
_F8 = ir.VectorType(ir.FloatType(), 8)
PORTABLE, AVX2, AVX512 = code("portable"), code("avx2"), code("avx512")
SIGNED_OFFSET = {40: 8, 50: 16}    # kinds whose quants are stored with an offset (Q4_0, Q5_0)
SIGNED = (8, 41)                    # kinds whose weights are int8 values (Q8_0, IQ4_NL)


def _call(builder, name, ret, args):  # type: ignore[no-untyped-def]
    fn = builder.module.globals.get(name) or ir.Function(
        builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _lookup(builder, isa, w):  # type: ignore[no-untyped-def]
    """IQ4_NL's int8 value of each index 0..15 in w (<32 x i8>): `vpshufb` within each
    128-bit half on x86 paths, a chain of selects on the portable one."""
    table = [v & 0xFF for v in gguf_quants.IQ4_NL.kvalues]
    if isa != PORTABLE:
        return _call(builder, "llvm.x86.avx2.pshuf.b", _B32, [ir.Constant(_B32, table * 2), w])
    out = ir.Constant(_B32, [table[0]] * 32)
    for i in range(1, 16):
        hit = builder.icmp_unsigned("==", w, ir.Constant(_B32, [i] * 32))
        out = builder.select(hit, ir.Constant(_B32, [table[i]] * 32), out)
    return out


def _weights(context, builder, sig, args, kind, at=4):  # type: ignore[no-untyped-def]
    """The block's 32 weights as <32 x i8> as stored: unsigned nibbles or 5-bit values (Q4_0
    and Q5_0 still with their offset), or int8 (Q8_0; IQ4_NL's indices still unlooked).
    q, its offset and the fifth bits are arguments at, at + 1 and at + 2."""
    if kind == 8:
        p = vector_ptr(context, builder, sig.args[at], args[at], sig.args[at + 1],
                       args[at + 1], _B32)
        return builder.load(p, align=1)
    p = vector_ptr(context, builder, sig.args[at], args[at], sig.args[at + 1], args[at + 1],
                   _B16)
    packed = builder.load(p, align=1)
    lo = builder.and_(packed, ir.Constant(_B16, [15] * 16))
    hi = builder.lshr(packed, ir.Constant(_B16, [4] * 16))
    w = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    if kind in (5, 50):
        bits = context.cast(builder, args[at + 2], sig.args[at + 2], types.uint32)
        mask = builder.bitcast(bits, ir.VectorType(ir.IntType(1), 32))
        fifth = builder.select(mask, ir.Constant(_B32, [16] * 32), ir.Constant(_B32, [0] * 32))
        w = builder.or_(w, fifth)
    return w


def _lanes_portable(builder, w, x, signed_w):  # type: ignore[no-untyped-def]
    wide = ir.VectorType(_I32, 32)
    p = builder.mul((builder.sext if signed_w else builder.zext)(w, wide), builder.sext(x, wide))
    quarters = [builder.shuffle_vector(p, ir.Constant(wide, ir.Undefined),
                                       ir.Constant(_L8, list(range(t, 32, 4))))
                for t in range(4)]
    return builder.add(builder.add(quarters[0], quarters[1]),
                       builder.add(quarters[2], quarters[3]))


def _offset_lanes(builder, isa, w, x, offset):  # type: ignore[no-untyped-def]
    """int32 lane i = sum over t < 4 of (w[4i+t] - offset) * x[4i+t] for unsigned w: the
    products of the stored bytes less offset * (x's sums of 4), whose product with a
    constant LLVM computes once per x block. Exact: `vpdpbusd` does not saturate, and
    `vpmaddubsw`'s int16 pairs stay within +-2 * 31 * 128 (AVX2 takes only w <= 31)."""
    off = ir.Constant(_B32, [offset] * 32)
    if isa == AVX512:
        zero = ir.Constant(_L8, [0] * 8)
        sums = _call(builder, "llvm.x86.avx512.vpdpbusd.256", _L8,
                     [zero, builder.bitcast(off, _L8), builder.bitcast(x, _L8)])
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _L8,
                     [builder.sub(zero, sums), builder.bitcast(w, _L8), builder.bitcast(x, _L8)])
    pairs = builder.sub(_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [w, x]),
                        _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [off, x]))
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _L8, [pairs, ir.Constant(_W16, [1] * 16)])


def _lanes(builder, isa, w, x, kind):  # type: ignore[no-untyped-def]
    """int32 lane i = sum over t < 4 of w[4i+t] * x[4i+t], w the block's signed values
    (Q4_0 and Q5_0 less their offset)."""
    if kind == 41:
        w = _lookup(builder, isa, w)
    if kind in SIGNED_OFFSET and isa != PORTABLE:
        return _offset_lanes(builder, isa, w, x, SIGNED_OFFSET[kind])
    if kind in SIGNED and isa == AVX512:   # int8 w + 128 is unsigned: the same identity
        return _offset_lanes(builder, isa, builder.xor(w, ir.Constant(_B32, [0x80] * 32)),
                             x, 128)
    if kind in SIGNED_OFFSET:               # portable: the offset inside the integers
        w = builder.sub(w, ir.Constant(_B32, [SIGNED_OFFSET[kind]] * 32))
    signed_w = kind in (*SIGNED, 40, 50)
    if isa == PORTABLE:
        return _lanes_portable(builder, w, x, signed_w)
    if signed_w:      # Q8_0, IQ4_NL on AVX2: |w| unsigned, x carrying w's sign (ggml's trick)
        neg = builder.icmp_signed("<", w, ir.Constant(_B32, [0] * 32))
        w = builder.select(neg, builder.neg(w), w)
        x = builder.select(neg, builder.neg(x), x)
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [w, x])
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _L8,
                 [pairs, ir.Constant(_W16, [1] * 16)])


@intrinsic
def qdot(typingctx, isa, kind, acc, ai, q, qi, bits, x, xi, scale):  # type: ignore[no-untyped-def]
    """acc[ai:ai+8] += scale * lanes(block of q . block of x); see the module docstring."""
    if not (isinstance(isa, types.IntegerLiteral) and isinstance(kind, types.IntegerLiteral)
            and kind.literal_value in (4, 5, 8, 40, 41, 50) and isinstance(acc, types.Array)
            and acc.dtype == types.float32 and isinstance(x, types.Array)
            and x.dtype == types.int8 and isinstance(q, types.Array)):
        return None
    path, form = isa.literal_value, kind.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        w = _weights(context, builder, sig, args, form)
        xv = builder.load(vector_ptr(context, builder, sig.args[7], args[7], sig.args[8],
                                     args[8], _B32), align=1)
        lanes = builder.sitofp(_lanes(builder, path, w, xv, form), _F8)
        s = splat(builder, context.cast(builder, args[9], sig.args[9], types.float32), _F8)
        pa = vector_ptr(context, builder, sig.args[2], args[2], sig.args[3], args[3], _F8)
        builder.store(fmuladd(builder, lanes, s, builder.load(pa, align=4)), pa, align=4)
        return context.get_dummy_value()
    return types.none(isa, kind, acc, ai, q, qi, bits, x, xi, scale), codegen


@intrinsic
def qsum(typingctx, isa, kind, q, qi, bits, x, xi):  # type: ignore[no-untyped-def]
    """The block's whole integer dot product (int32, exact) of q's block with x's: llama.cpp's
    repacked Q4_0 / IQ4_NL kernels scale one such sum per block (see `qdot` for the
    arguments)."""
    if not (isinstance(isa, types.IntegerLiteral) and isinstance(kind, types.IntegerLiteral)
            and kind.literal_value in (40, 41) and isinstance(x, types.Array)
            and x.dtype == types.int8 and isinstance(q, types.Array)):
        return None
    path, form = isa.literal_value, kind.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        w = _weights(context, builder, sig, args, form, at=2)
        xv = builder.load(vector_ptr(context, builder, sig.args[5], args[5], sig.args[6],
                                     args[6], _B32), align=1)
        return _call(builder, "llvm.vector.reduce.add.v8i32", _I32,
                     [_lanes(builder, path, w, xv, form)])
    return types.int32(isa, kind, q, qi, bits, x, xi), codegen


# -- K-quants (Q4_K, Q5_K, Q6_K) with Q8_K activations ---------------------------------------

def _two_scales(builder, sa, sb, vecty):  # type: ignore[no-untyped-def]
    """[sa] * (n/2) + [sb] * (n/2) as `vecty` (n lanes)."""
    n = vecty.count
    sa, sb = (builder.trunc(v, vecty.element) if vecty.element != _I32 else v for v in (sa, sb))
    return builder.shuffle_vector(splat(builder, sa, vecty), splat(builder, sb, vecty),
                                  ir.Constant(ir.VectorType(_I32, n), [0] * (n // 2) + [n] * (n // 2)))


def scaled_lanes(builder, path, w, x, acc, sa, sb):  # type: ignore[no-untyped-def]
    """acc + lanes(w . x) * (sa on lanes 0-3, sb on 4-7), in exact int32 (lane i: bytes
    4i..4i+3) for unsigned K-quant weights w <= 63 and x's int8 (|x| <= 127 keeps
    `vpmaddubsw`'s int16 pairs from saturating). Every path gives the same sums; LLVM IR for
    the K-quant intrinsics of `ktotals`."""
    if path == PORTABLE:
        lanes = _lanes_portable(builder, w, x, False)
        return builder.add(acc, builder.mul(lanes, _two_scales(builder, sa, sb, _L8)))
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [w, x])
    scales = _two_scales(builder, sa, sb, _W16)
    if path == AVX512:
        return _call(builder, "llvm.x86.avx512.vpdpwssd.256", _L8,
                     [acc, builder.bitcast(pairs, _L8), builder.bitcast(scales, _L8)])
    return builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", _L8, [pairs, scales]))


@intrinsic
def kflush(typingctx, acc, ai, iacc, ii, scale):  # type: ignore[no-untyped-def]
    """acc[ai:ai+8] (float32) += float(iacc[ii:ii+8]) * scale, then iacc[ii:ii+8] = 0: one
    superblock's exact integer sums, scaled by d_w * d_x."""
    if not (isinstance(acc, types.Array) and acc.dtype == types.float32
            and isinstance(iacc, types.Array) and iacc.dtype == types.int32):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        pi = vector_ptr(context, builder, sig.args[2], args[2], sig.args[3], args[3], _L8)
        pa = vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _F8)
        lanes = builder.sitofp(builder.load(pi, align=4), _F8)
        s = splat(builder, context.cast(builder, args[4], sig.args[4], types.float32), _F8)
        builder.store(fmuladd(builder, lanes, s, builder.load(pa, align=4)), pa, align=4)
        builder.store(ir.Constant(_L8, [0] * 8), pi, align=4)
        return context.get_dummy_value()
    return types.none(acc, ai, iacc, ii, scale), codegen
