"""The 32-weight block types' matmuls of many rows of x (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL
on Q8_0/Q8_1 blocks), in `qmatmul_int`'s float orders, with 16 weight rows as the lanes of
a vector (as `ktiled` does for the K-quants). A chunk of 16 weight rows is decoded once into
bytes, interleaved 4 codes per row, and serves every row of x, two at a time (each loaded
block of codes feeds both): per block, group t of 4 weights (t < 8) of all 16 rows against
x's 4 quants (broadcast) is one `vpdpbusd`, whose lane i is row i's int32 lane t of ggml's
`vec_dot`. So the 8 float lanes ggml keeps per output are 8 vectors here, acc_t =
fma(float(lanes_t), d_w d_x, acc_t) per block, added at the end in `hsum_float_8`'s order
(+ the min sums of Q4_1/Q5_1, fma(m_w, s_x, summs) per block); the repacked order
(`qmatmul_int.REPACKED`) keeps one chain, fma(block's sum, d_w d_x, acc).

A decode step's one row (`one_row`) keeps no decoded copy: each block of the 16 rows is
transposed into codes in registers (`fused_row`), or, stored interleaved
(`qmatmul.interleave`), loaded a group a vector (`interleaved_row`, 8 rows a pass on AVX2).

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
from vllm_actors.kernels.cpu.intrinsics import (HARDWARE_HALF, call_address, data_pointer,
                                                prefetch_line, realign_stack, stack_i64,
                                                transpose_rows)
from vllm_actors.kernels.cpu.jit import Callback, callback, kernel
from vllm_actors.kernels.cpu.ktiled import (LANES, array_ptr, byte_pairs, dot4, joined,
                                            llvm_call, pair_sums, transpose_words,
                                            vector_part)
from vllm_actors.kernels.cpu.qdot import AVX2, AVX512, PORTABLE
from vllm_actors.kernels.cpu.qmatmul import SERIAL_MAX_WORK, QuantMatrix
from vllm_actors.kernels.cpu.qmatmul_prims import (HALF_LUT, byte_codes, kept, limit_threads,
                                                   line_aligned, prefetch_span, restore_threads)
from vllm_actors.kernels.cpu.qmatmul_simd import fmuladd, splat

_I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (8, 16, 32, 64))
_B64, _B32 = ir.VectorType(_I8, 64), ir.VectorType(_I8, 32)
_L16, _L8, _L4 = ir.VectorType(_I32, 16), ir.VectorType(_I32, 8), ir.VectorType(_I32, 4)
_F32 = ir.FloatType()
_F16 = ir.VectorType(_F32, 16)
_W16 = ir.VectorType(_I16, 16)
LANES_ORDER, SCALAR_ORDER = 0, 1      # vec_dot's 8 float lanes, or the repacked one chain
OFFSET = {40: 8, 50: 16, 8: 128, 41: 128}   # what the unsigned codes carry (Q4_1/Q5_1: 0)
_LOG2 = {8: 3, 16: 4, 128: 7}


def signed_codes(path: int, kind: int) -> bool:
    """Whether codes stay int8 (Q8_0, IQ4_NL off the VNNI path) instead of biased bytes."""
    return kind in (8, 41) and path != AVX512


def split_signs(path: int, kind: int) -> bool:
    """Whether a chunk's decoded codes are kept twice for the many-row body (`body`): |w|,
    then w, one copy after the other. AVX2 multiplies Q8_0/IQ4_NL's |w| by x carrying w's
    sign; taken once at decode, |w| costs each row of x a load instead of a `vpabsb`."""
    return path == AVX2 and kind in (8, 41)


def _stored_codes(context, builder, sig, args, path, kind, codes_arg, idx, nb, v):  # type: ignore[no-untyped-def]
    """Store group vector v of decoded codes at codes.flat[idx] (int32 index), and, where
    `split_signs`, its |w| there and v itself one copy (nb * 8 * LANES words) later."""
    if split_signs(path, kind):
        zero = ir.Constant(v.type, [0] * v.type.count)
        later = builder.add(idx, builder.mul(nb, ir.Constant(_I64, 8 * LANES)))
        builder.store(v, array_ptr(context, builder, sig, args, codes_arg, later, v.type),
                      align=4)
        v = builder.select(builder.icmp_signed("<", v, zero), builder.neg(v), v)
    builder.store(v, array_ptr(context, builder, sig, args, codes_arg, idx, v.type), align=4)


def _codes(builder, path, kind, w):  # type: ignore[no-untyped-def]
    """Codes as `vpdpbusd` takes them (<64 x i8>, or <32 x i8> for 8 rows off the AVX-512
    path) from w, the values as stored (Q8_0's int8, the other types' 4- or 5-bit codes):
    IQ4_NL's looked up in its table, Q8_0's and IQ4_NL's biased by 128 unless
    `signed_codes`."""
    count = w.type.count
    vec = ir.VectorType(_I8, count)
    if kind == 41:
        table = [v & 0xFF for v in gguf_quants.IQ4_NL.kvalues]
        if path == PORTABLE:
            out = ir.Constant(vec, [table[0]] * count)
            for i in range(1, 16):
                hit = builder.icmp_unsigned("==", w, ir.Constant(vec, [i] * count))
                out = builder.select(hit, ir.Constant(vec, [table[i]] * count), out)
            w = out
        elif path == AVX512:
            w = llvm_call(builder, "llvm.x86.avx512.pshuf.b.512", _B64,
                          [ir.Constant(_B64, table * 4), w])
        else:
            halves = [llvm_call(builder, "llvm.x86.avx2.pshuf.b", _B32,
                                [ir.Constant(_B32, table * 2), vector_part(builder, w, 32, h)])
                      for h in range(count // 32)]
            w = joined(builder, halves)
    if kind in (8, 41) and not signed_codes(path, kind):
        w = builder.xor(w, ir.Constant(vec, [0x80] * count))
    return w


def _fifth(builder, bits, t):  # type: ignore[no-untyped-def]
    """Q5_x's fifth bits of group t of 16 rows (or 8: `bits` <16 x i32> or <8 x i32>, row
    l's 32 bits, bit j for weight j) as 16 per byte of <64 x i8> (<32 x i8>): byte t // 2 of
    each row's bits copied to its 4 bytes, byte k tested against bit 4 (t % 2) + k."""
    lanes = bits.type.count
    vec = ir.VectorType(_I8, 4 * lanes)
    raw = builder.bitcast(bits, vec)
    spread = builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, 4 * lanes), [
        4 * lane + t // 2 for lane in range(lanes) for _ in range(4)]))
    test = builder.and_(spread, ir.Constant(vec, [1 << (4 * (t % 2) + k)
                                                  for _ in range(lanes) for k in range(4)]))
    zero = ir.Constant(vec, [0] * 4 * lanes)
    hit = builder.icmp_unsigned("!=", test, zero)
    return builder.select(hit, ir.Constant(vec, [16] * 4 * lanes), zero)


def _fifth_of_group(builder, bits, t):  # type: ignore[no-untyped-def]
    """`_fifth` for bits stored by group (`qmatmul_layout.fifth_bits_by_group`: byte k of a
    row's 32 bits holds group t's bit at bit t): each row's lane shifted so that bit t of
    every byte lands on bit 4, then masked."""
    lanes = bits.type.count
    words = ir.VectorType(_I32, lanes)
    if t < 4:
        bits = builder.shl(bits, ir.Constant(words, [4 - t] * lanes))
    elif t > 4:
        bits = builder.lshr(bits, ir.Constant(words, [t - 4] * lanes))
    masked = builder.and_(bits, ir.Constant(words, [0x10101010] * lanes))
    return builder.bitcast(masked, ir.VectorType(_I8, 4 * lanes))


@intrinsic
def decode_blocks(typingctx, isa_, kind, q, qoff, step, qh, hoff, nb, codes):  # type: ignore[no-untyped-def]
    """16 weight rows' nb blocks (row l's quant bytes from q.flat[qoff[l]], `step` bytes a
    block; Q5_x's fifth bits qh.flat[hoff[l] + b], uint32) into codes: the 4 codes of group
    t of block b of row l at codes[16 (8 b + t) + l] (int32)."""
    if not (isinstance(isa_, types.IntegerLiteral) and isinstance(kind, types.IntegerLiteral)
            and isinstance(codes, types.Array) and codes.dtype == types.int32):
        return None
    path, form = isa_.literal_value, kind.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        step_, nb_ = (context.cast(builder, args[i], sig.args[i], types.intp) for i in (4, 7))
        bases = _bases(context, builder, sig, args, (3, 6))
        with cgutils.for_range(builder, nb_) as loop:
            b = loop.index
            vs = _decoded(context, builder, sig, args, path, form,
                          [builder.add(o, builder.mul(b, step_)) for o in bases[0]],
                          [builder.add(o, b) for o in bases[1]], (2, 5))
            for t, v in enumerate(vs):
                at = builder.mul(builder.add(builder.mul(b, ir.Constant(_I64, 8)),
                                             ir.Constant(_I64, t)), ir.Constant(_I64, LANES))
                _stored_codes(context, builder, sig, args, path, form, 8, at, nb_, v)
        return context.get_dummy_value()
    return types.none(isa_, kind, q, qoff, step, qh, hoff, nb, codes), codegen


def _bases(context, builder, sig, args, which):  # type: ignore[no-untyped-def]
    """The 16 lanes' offsets held in the intrinsic's stack arrays `which`."""
    return [[builder.load(array_ptr(context, builder, sig, args, i, ir.Constant(_I64, lane),
                                    _I64)) for lane in range(LANES)] for i in which]


def _decoded(context, builder, sig, args, path, form, at, hat, which, bits=None):  # type: ignore[no-untyped-def]
    """A block of 16 weight rows as 8 vectors <64 x i8>: vector t holds the 4 codes of group
    t (weights 4t .. 4t+3) of every row (row l's quant bytes at q.flat[at[l]], its fifth
    bits at qh.flat[hat[l]], or `bits` <16 x i32> where given; q and qh the arguments
    `which`). The stored bytes are transposed first, so each step after works on all 16
    rows at once."""
    def load(i, idx, ty):  # type: ignore[no-untyped-def]
        return builder.load(array_ptr(context, builder, sig, args, which[i], idx, ty), align=1)
    if form == 8:
        words = transpose_rows(builder, [load(0, a, _L8) for a in at])
        return [_codes(builder, path, form, builder.bitcast(v, _B64)) for v in words]
    nibbles = [builder.bitcast(v, _B64) for v in transpose_words(builder, [load(0, a, _L4) for a in at])]
    low = [builder.and_(v, ir.Constant(_B64, [15] * 64)) for v in nibbles]
    high = [builder.lshr(v, ir.Constant(_B64, [4] * 64)) for v in nibbles]
    groups = low + high          # byte j's low nibble is weight j, its high one weight j + 16
    if form in (5, 50):
        if bits is None:
            bits = lane_words(builder, [load(1, h, _I32) for h in hat])
        groups = [builder.or_(v, _fifth(builder, bits, t)) for t, v in enumerate(groups)]
    return [_codes(builder, path, form, v) for v in groups]


def _dot_signed(builder, path, w, x, aw=None):  # type: ignore[no-untyped-def]
    """Lane i of (sum over t < 4 of w[4i+t] x[4i+t]) for int8 w and x (Q8_0 / IQ4_NL off the
    VNNI path; 16 lanes, or 8): AVX2 multiplies |w| (aw, where given) by x carrying w's sign
    (exact unless x holds -128, as ggml), the portable path widens."""
    lanes = w.type.count // 4
    if path == AVX2:
        zero = ir.Constant(w.type, [0] * w.type.count)
        if aw is None:
            aw = builder.select(builder.icmp_signed("<", w, zero), builder.neg(w), w)  # vpabsb
        sx = joined(builder, [llvm_call(builder, "llvm.x86.avx2.psign.b", _B32, [   # x sign(w)
            vector_part(builder, x, 32, h), vector_part(builder, w, 32, h)])
            for h in range(lanes // 8)])
        return pair_sums(builder, byte_pairs(builder, aw, sx))
    wide, out = ir.VectorType(_I32, 4 * lanes), ir.VectorType(_I32, lanes)
    p = builder.mul(builder.sext(w, wide), builder.sext(x, wide))
    acc = ir.Constant(out, [0] * lanes)
    for t in range(4):
        pick = ir.Constant(out, list(range(t, 4 * lanes, 4)))
        acc = builder.add(acc, builder.shuffle_vector(p, p, pick))
    return acc


def _hsum8(builder, a):  # type: ignore[no-untyped-def]
    """ggml's `hsum_float_8` of 8 lanes, here 8 vectors: ((a4 + a0) + (a6 + a2)) + ((a5 +
    a1) + (a7 + a3))."""
    f = builder.fadd
    return f(f(f(a[4], a[0]), f(a[6], a[2])), f(f(a[5], a[1]), f(a[7], a[3])))


class _Sums:
    """A chunk's float sums for one row of x in `order`: the 8 lane vectors (acc_t) and the
    min sums, or the one chain; `add` takes a block, `total` gives the 16 outputs."""

    def __init__(self, builder, order, mins, path, lanes=LANES):  # type: ignore[no-untyped-def]
        self.vec = ir.VectorType(_F32, lanes)
        zero = ir.Constant(self.vec, [0.0] * lanes)
        self.builder, self.order, self.mins = builder, order, mins
        self.biased = biased(path, order)
        self.accs = [cgutils.alloca_once_value(builder, zero)
                     for _ in range(8 if order == LANES_ORDER else 0)]
        self.chain = cgutils.alloca_once_value(builder, zero)   # min sums, or the one chain
        self.whole = None       # the one chain's block: its lane vectors' sum so far
        self.pairs = self.offset = None     # or its int16 pairs and offset terms so far

    def add(self, lanes, scale, m_w, s_x):  # type: ignore[no-untyped-def]
        """A block's 8 integer lane vectors, d_w d_x, and (types with mins) m_w and s_x."""
        for t, v in enumerate(lanes):
            self.add_lane(t, v, scale)
        self.end_block(scale, m_w, s_x)

    def add_lane(self, t, v, scale):  # type: ignore[no-untyped-def]
        """Lane vector t of a block (any order of t; `end_block` after the 8): into acc_t,
        or into the block's integer sum for the one chain."""
        builder = self.builder
        if self.order == SCALAR_ORDER and isinstance(v, tuple):     # `int16_groups`
            pairs, offset = v
            self.pairs = pairs if t == 0 else builder.add(self.pairs, pairs)
            self.offset = offset if t == 0 else builder.add(self.offset, offset)
            return
        if self.order == SCALAR_ORDER:
            self.whole = v if t == 0 else builder.add(self.whole, v)
            return
        if self.biased:
            f = builder.fsub(builder.bitcast(v, self.vec), ir.Constant(
                self.vec, [BIAS_F] * self.vec.count))
        else:
            f = builder.sitofp(v, self.vec)
        builder.store(fmuladd(builder, f, scale, builder.load(self.accs[t])), self.accs[t])

    def end_block(self, scale, m_w, s_x):  # type: ignore[no-untyped-def]
        """The block's one-chain term, or its min term."""
        builder, chain = self.builder, self.chain
        if self.pairs is not None:
            ints = ir.VectorType(_I32, self.vec.count)
            self.whole = builder.add(pair_sums(builder, self.pairs),
                                     splat(builder, self.offset, ints))
            self.pairs = None
        if self.order == SCALAR_ORDER:
            builder.store(_fma(builder, builder.sitofp(self.whole, self.vec), scale,
                               builder.load(chain)), chain)
        elif self.mins:
            builder.store(_fma(builder, m_w, s_x, builder.load(chain)), chain)

    def total(self):  # type: ignore[no-untyped-def]
        builder = self.builder
        if self.order == SCALAR_ORDER:
            return builder.load(self.chain)
        total = _hsum8(builder, [builder.load(a) for a in self.accs])
        return builder.fadd(total, builder.load(self.chain)) if self.mins else total


def _fma(builder, a, b, c):  # type: ignore[no-untyped-def]
    """a * b + c per lane, one rounding (`llvm.fma`, never a multiply and an add), on
    vectors of 16 floats or 8."""
    return llvm_call(builder, f"llvm.fma.v{a.type.count}f32", a.type, [a, b, c])


def _literals(*values):  # type: ignore[no-untyped-def]
    return all(isinstance(v, types.IntegerLiteral) for v in values)


# rows of x `row_dots` takes at once: each loaded block of codes serves both (4 spilled the
# lanes' accumulators: docs/BENCHMARKS.md, "Two rows of x a pass"). Without 512-bit registers
# (an AVX2 host: 16 of 256 bits) one row's 8 accumulators of 16 lanes already fill them, and
# a second spills both: one row a pass there (a 16-row Q4_1 3072x576 416-478 -> 346-379 us;
# docs/BENCHMARKS.md, "The AVX2 host")
X_ROWS = 2 if "avx512f" in isa.host_features() else 1


def pass_lanes(path: int) -> int:
    """Weight rows `interleaved_row` takes a pass: 16 with 512-bit registers, else 8 (one
    row's 8 accumulators of 16 lanes fill all of AVX2's 16 registers and spill; 8 rows as in
    `bench/avx2_rows.py`'s interleaved form leave room)."""
    return LANES if path == AVX512 else 8


@intrinsic
def row_dots(typingctx, isa_, kind, order, rows, codes, nb, dw, mw, x, xo, xc, co, xd, xs, so,
             out, oo, k, n16):  # type: ignore[no-untyped-def]
    """`rows` (a literal, 1 or 2) rows of x against a chunk's nb decoded blocks (d_w at
    dw[16 b + i], Q4_1/Q5_1's m_w at mw[16 b + i]). Row r of them: quants at
    x.flat[xo + r k] (32 a block), offset terms at xc.flat[co + r k/4 + 8 b + t], scales
    at xd.flat[so + r nb + b] (Q8_1's sums likewise in xs); out.flat[oo + r n16 ..][:16]
    = its 16 outputs in `order`'s float order, lane i for weight row i."""
    if not (_literals(isa_, kind, order, rows) and isinstance(x, types.Array)
            and x.dtype == types.int8):
        return None
    path, form, how = isa_.literal_value, kind.literal_value, order.literal_value
    count, mins = rows.literal_value, kind.literal_value in (4, 5)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        nb_, xo_, co_, so_, oo_, k_, n16_ = (context.cast(builder, args[i], sig.args[i],
                                                          types.intp)
                                             for i in (5, 9, 11, 14, 16, 17, 18))
        k4_ = builder.lshr(k_, ir.Constant(_I64, 2))
        sums = [_Sums(builder, how, mins, path) for _ in range(count)]

        def load(i, idx, ty, align=4):  # type: ignore[no-untyped-def]
            return builder.load(array_ptr(context, builder, sig, args, i, idx, ty), align=align)

        def of_row(base, step, r):  # type: ignore[no-untyped-def]
            return builder.add(base, builder.mul(step, ir.Constant(_I64, r)))

        later = builder.mul(nb_, ir.Constant(_I64, 8 * LANES))     # `split_signs`' w
        with cgutils.for_range(builder, nb_) as loop:
            b = loop.index
            at = builder.mul(b, ir.Constant(_I64, LANES))
            idx = [builder.mul(_group(builder, b, t), ir.Constant(_I64, LANES))
                   for t in range(8)]
            codes_ = [load(4, i, _B64) for i in idx]
            if split_signs(path, form):
                codes_ = [(a, load(4, builder.add(i, later), _B64))
                          for a, i in zip(codes_, idx)]
            d_w, m_w = load(6, at, _F16), (load(7, at, _F16) if mins else None)
            for r, row_sums in enumerate(sums):
                sb = builder.add(of_row(so_, nb_, r), b)
                xo_r, co_r = of_row(xo_, k_, r), of_row(co_, k4_, r)
                lanes = _block_lanes(
                    builder, path, form, codes_,
                    lambda k4, xo_r=xo_r: load(8, builder.add(
                        xo_r, builder.mul(k4, ir.Constant(_I64, 4))), _I32, 1),
                    lambda k4, co_r=co_r: load(10, builder.add(co_r, k4), _I32), b, how)
                row_sums.add(lanes, builder.fmul(d_w, splat(builder, load(12, sb, _F32), _F16)),
                             m_w, splat(builder, load(13, sb, _F32), _F16) if mins else None)
        for r, row_sums in enumerate(sums):
            builder.store(row_sums.total(), array_ptr(context, builder, sig, args, 15,
                                                      of_row(oo_, n16_, r), _F16), align=4)
        return context.get_dummy_value()
    return types.none(isa_, kind, order, rows, codes, nb, dw, mw, x, xo, xc, co, xd, xs, so,
                      out, oo, k, n16), codegen


def _group(builder, b, t):  # type: ignore[no-untyped-def]
    """Group t's index among a row's groups of 4 weights: 8 b + t."""
    return builder.add(builder.mul(b, ir.Constant(_I64, 8)), ir.Constant(_I64, t))


# float32 1.5 * 2^23 and its bits: for |i| < 2^22, the bits BIAS + i are the float
# 1.5 * 2^23 + i exactly, so (as float) - 1.5 * 2^23 is float(i) exactly.
BIAS, BIAS_F = 0x4B400000, 12582912.0


def biased(path: int, order: int) -> bool:
    """Whether a block's lanes leave `vpdpbusd` carrying `BIAS` (started from it, or from
    offset terms that hold it) and become floats by one subtraction instead of a
    `vcvtdq2ps` (0-17 % faster on AVX-512 here, docs/BENCHMARKS.md); the same floats. Only
    vec_dot's 8 lanes: the repacked order adds the lanes as integers first."""
    return path == AVX512 and order == LANES_ORDER


def _block_lanes(builder, path, form, codes, x_word, offset_word, b, order):  # type: ignore[no-untyped-def]
    """Block b's 8 integer lanes of all 16 rows from its codes (8 vectors <64 x i8>, group t
    of every row; `_group_lanes`)."""
    return [_group_lanes(builder, path, form, w, t, x_word, offset_word, b, order)
            for t, w in enumerate(codes)]


def int16_groups(path: int, form: int, order: int) -> bool:
    """Whether a block's groups reach `_Sums` as `vpmaddubsw`'s int16 pairs and their offset
    terms, to be summed before one widening: the repacked order (one sum a block) on AVX2,
    Q4_0's codes (each pair within 2 * 15 * 128, 8 groups 30720: exact; a repacked Q4_0
    +15 % at one row, +24-27 % at 16, docs/BENCHMARKS.md)."""
    return path == AVX2 and order == SCALAR_ORDER and form == 40


def _group_lanes(builder, path, form, w, t, x_word, offset_word, b, order):  # type: ignore[no-untyped-def]
    """Lane vector t of block b from group t's codes w (<64 x i8>, or <32 x i8> for 8
    rows): their 4 codes against x's 4 quants (`x_word(8 b + t)`, an i32) broadcast, less
    the offset term (`offset_word(8 b + t)`) where the codes carry one; or, where
    `int16_groups`, the products' int16 pairs and the offset term."""
    absolute = None
    if isinstance(w, tuple):        # (|w|, w): `split_signs`
        absolute, w = w
    count = w.type.count // 4
    ints = ir.VectorType(_I32, count)
    k4 = _group(builder, b, t)
    xv = builder.bitcast(splat(builder, x_word(k4), ints), w.type)
    if signed_codes(path, form):
        return _dot_signed(builder, path, w, xv, absolute)
    if int16_groups(path, form, order):
        return byte_pairs(builder, w, xv), offset_word(k4)
    # the offset terms carry the bias where it is taken (`_offsets`)
    init = splat(builder, offset_word(k4), ints) if form in OFFSET else \
        ir.Constant(ints, [BIAS if biased(path, order) else 0] * count)
    return dot4(builder, path, init, w, xv)


GROUP_BLOCKS = 8      # `fused_row` converts 8 blocks' scales, mins and fifth bits at once


def lane_words(builder, words):  # type: ignore[no-untyped-def]
    """16 i32 values, one a row, as <16 x i32> (row l in lane l)."""
    v = ir.Constant(_L16, ir.Undefined)
    for lane, w in enumerate(words):
        v = builder.insert_element(v, w, ir.Constant(_I32, lane))
    return v


def eight_at_once(builder, nb):  # type: ignore[no-untyped-def]
    """Whether rows of nb blocks convert 8 blocks at a time: 8 blocks or more, and F16C."""
    if not HARDWARE_HALF:
        return cgutils.false_bit
    return builder.icmp_signed(">=", nb, ir.Constant(_I64, GROUP_BLOCKS))


def block_groups(builder, nb):  # type: ignore[no-untyped-def]
    """A row's groups of GROUP_BLOCKS blocks, the last maybe partial: ceil(nb / 8)."""
    return builder.udiv(builder.add(nb, ir.Constant(_I64, GROUP_BLOCKS - 1)),
                        ir.Constant(_I64, GROUP_BLOCKS))


def group_start(builder, g, nb):  # type: ignore[no-untyped-def]
    """Where the 8 blocks converted for the group from g start: g, or nb - 8 for a row's
    last group (it overlaps the one before; nb >= 8)."""
    last = builder.sub(nb, ir.Constant(_I64, GROUP_BLOCKS))
    return builder.select(builder.icmp_signed("<", g, last), g, last)


def eight_halves(builder, rows):  # type: ignore[no-untyped-def]
    """16 rows' next 8 float16 values (<4 x i32> a row) -> 8 vectors <16 x float>, value j of
    every row in vector j: the rows transposed as `transpose_words` does the quant bytes,
    then each 32-bit word's two values split and converted (F16C)."""
    words = transpose_words(builder, rows)
    out = []
    for j in range(GROUP_BLOCKS):
        v = builder.lshr(words[j // 2], ir.Constant(_L16, [16 * (j % 2)] * 16))
        halves = builder.bitcast(builder.trunc(v, _W16), ir.VectorType(ir.HalfType(), 16))
        out.append(builder.fpext(halves, _F16))
    return out


class _SidePlanes:
    """`fused_row`'s scales d_w, mins m_w and fifth bits of its 16 rows (row l's at
    plane.flat[ho + l nb + b]), 8 blocks at a time into stack arrays: each row's 8 halves
    (or 8 words of bits) loaded as one vector, then transposed to one vector a block (row l
    in lane l). Built one value a lane, they cost 32 loads and inserts a Q4_1 block, a
    quarter of its time (docs/BENCHMARKS.md). Under 8 blocks a row, or without F16C, each
    block's values are still gathered one by one."""

    def __init__(self, context, builder, sig, args, form, ho, nb):  # type: ignore[no-untyped-def]
        self.context, self.builder, self.sig, self.args = context, builder, sig, args
        self.form, self.nb = form, nb
        self.has_min, self.has_bits = form in (4, 5), form in (5, 50)
        self.offs = [builder.add(ho, builder.mul(nb, ir.Constant(_I64, lane)))
                     for lane in range(LANES)]
        size = ir.Constant(_I64, GROUP_BLOCKS)
        self.scales = cgutils.alloca_once(builder, _F16, size=size)
        self.min_vs = cgutils.alloca_once(builder, _F16, size=size) if self.has_min else None
        self.bit_vs = cgutils.alloca_once(builder, _L16, size=size) if self.has_bits else None
        self.halves = [(8, self.scales)] + ([(9, self.min_vs)] if self.has_min else [])

    def _ptr(self, i, idx, ty):  # type: ignore[no-untyped-def]
        return array_ptr(self.context, self.builder, self.sig, self.args, i, idx, ty)

    def convert(self, g):  # type: ignore[no-untyped-def]
        """Fill the stack arrays for the group of blocks from g; returns g0, the block held
        at index 0 (the last group of a row overlaps the one before: g0 = nb - 8)."""
        builder = self.builder
        wide = eight_at_once(builder, self.nb)
        g0 = builder.select(wide, group_start(builder, g, self.nb), g)
        with builder.if_else(wide) as (transposed, single):
            with transposed:
                self._transposed(g0)
            with single:
                self._one_by_one(g)
        return g0

    def _transposed(self, g0):  # type: ignore[no-untyped-def]
        builder = self.builder
        for i, dst in self.halves:
            for j, v in enumerate(eight_halves(builder, [builder.load(self._ptr(
                    i, builder.add(o, g0), _L4), align=2) for o in self.offs])):
                builder.store(v, self._slot(dst, j), align=4)
        if self.has_bits:
            rows = [builder.load(self._ptr(6, builder.add(o, g0), _L8), align=4)
                    for o in self.offs]
            for j, v in enumerate(transpose_rows(builder, rows)):
                builder.store(v, self._slot(self.bit_vs, j), align=4)

    def count(self, g):  # type: ignore[no-untyped-def]
        """The blocks of the group from g: min(8, nb - g)."""
        builder, eight = self.builder, ir.Constant(_I64, GROUP_BLOCKS)
        left = builder.sub(self.nb, g)
        return builder.select(builder.icmp_signed("<", left, eight), left, eight)

    def _one_by_one(self, g):  # type: ignore[no-untyped-def]
        builder = self.builder
        count = self.count(g)

        def load(i, idx, ty, align):  # type: ignore[no-untyped-def]
            return builder.load(self._ptr(i, idx, ty), align=align)
        with cgutils.for_range(builder, count) as loop:
            j = loop.index
            hs = [builder.add(o, builder.add(g, j)) for o in self.offs]
            for i, dst in self.halves:
                v = half_vector(builder, [load(i, h, _I16, 2) for h in hs],
                                lambda bits: load(10, builder.zext(bits, _I64), _F32, 4))
                builder.store(v, self._slot(dst, j), align=4)
            if self.has_bits:
                builder.store(lane_words(builder, [load(6, h, _I32, 4) for h in hs]),
                              self._slot(self.bit_vs, j), align=4)

    def _slot(self, base, j):  # type: ignore[no-untyped-def]
        if isinstance(j, int):
            j = ir.Constant(_I64, j)
        return self.builder.gep(base, [j])

    def scale(self, j):  # type: ignore[no-untyped-def]
        return self.builder.load(self._slot(self.scales, j), align=4)

    def mins(self, j):  # type: ignore[no-untyped-def]
        return self.builder.load(self._slot(self.min_vs, j), align=4)

    def bits(self, j):  # type: ignore[no-untyped-def]
        return self.builder.load(self._slot(self.bit_vs, j), align=4) if self.has_bits else None


@intrinsic
def fused_row(typingctx, isa_, kind, order, q, qo, rb, qh, ho, d, mn, lut, nb, x, xc, xd, xs, out, oo, po):  # type: ignore[no-untyped-def]
    """`row_dots` for x's one row straight from the planes, each block of the 16 weight rows
    decoded in registers (`_decoded`): rows l < 16 at q.flat[qo + l rb] (rb bytes each), their
    scales, mins and fifth bits at d.flat / mn.flat / qh.flat[ho + l nb]; the rows at
    q.flat[po + l rb] are prefetched as the blocks go. A decode step's GEMV."""
    if not (_literals(isa_, kind, order) and isinstance(x, types.Array)
            and x.dtype == types.int8):
        return None
    path, form, how = isa_.literal_value, kind.literal_value, order.literal_value
    mins = form in (4, 5)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        qo_, rb_, ho_, nb_, oo_, po_ = (context.cast(builder, args[i], sig.args[i], types.intp)
                                        for i in (4, 5, 7, 11, 17, 18))
        step = ir.Constant(_I64, 32 if form == 8 else 16)        # quant bytes a block
        # blocks between two prefetches of a row's next line: half a line's worth, so each
        # line is asked for twice (once a line: 20-22 GB/s streaming SmolLM2's 3072x576
        # matrices; twice: 25-26; docs/BENCHMARKS.md)
        per_line = 32 // step.constant
        sums = _Sums(builder, how, mins, path)
        side = _SidePlanes(context, builder, sig, args, form, ho_, nb_)

        def load(i, idx, ty, align=4):  # type: ignore[no-untyped-def]
            return builder.load(array_ptr(context, builder, sig, args, i, idx, ty), align=align)

        def rows(start, stride):  # type: ignore[no-untyped-def]
            return [builder.add(start, builder.mul(stride, ir.Constant(_I64, lane)))
                    for lane in range(LANES)]

        with cgutils.for_range(builder, block_groups(builder, nb_)) as outer:
            g = builder.mul(outer.index, ir.Constant(_I64, GROUP_BLOCKS))
            g0 = side.convert(g)
            with cgutils.for_range(builder, side.count(g)) as loop:
                b = builder.add(g, loop.index)
                j = builder.sub(b, g0)
                at = builder.add(qo_, builder.mul(b, step))
                # the next chunk's rows turn by turn, at this block's offset
                first = builder.mul(builder.urem(b, ir.Constant(_I64, per_line)),
                                    ir.Constant(_I64, LANES // per_line))
                ahead = builder.add(builder.add(po_, builder.mul(b, step)),
                                    builder.mul(first, rb_))
                for pf in rows(ahead, rb_)[:LANES // per_line]:
                    prefetch_line(builder, array_ptr(context, builder, sig, args, 3, pf, _I8))
                codes = _decoded(context, builder, sig, args, path, form, rows(at, rb_), None,
                                 (3, 6), side.bits(j))
                scale = builder.fmul(side.scale(j), splat(builder, load(14, b, _F32), _F16))
                lanes = _block_lanes(
                    builder, path, form, codes,
                    lambda k4: load(12, builder.mul(k4, ir.Constant(_I64, 4)), _I32, 1),
                    lambda k4: load(13, k4, _I32), b, how)
                sums.add(lanes, scale, side.mins(j) if mins else None,
                         splat(builder, load(15, b, _F32), _F16) if mins else None)
        builder.store(sums.total(), array_ptr(context, builder, sig, args, 16, oo_, _F16),
                      align=4)
        return context.get_dummy_value()
    return types.none(isa_, kind, order, q, qo, rb, qh, ho, d, mn, lut, nb, x, xc, xd, xs, out,
                      oo, po), codegen


def _interleaved_groups(builder, path, form, load, lanes):  # type: ignore[no-untyped-def]
    """A block's 8 groups of `lanes` interleaved rows as codes (`_codes`), as
    (t, codes of group t), word by word: `load(v, ty)` reads word v of the rows (Q8_0: 8
    words, each a group; the others 4, low nibbles group v and high ones group v + 4), or
    their fifth bits for v = None. A generator, so that a caller can carry each group to its
    sum before the next word is read: emitted all at once, the 8 groups' registers spill on
    AVX2."""
    vec = ir.VectorType(_I8, 4 * lanes)
    bits = load(None, ir.VectorType(_I32, lanes)) if form in (5, 50) else None
    for v in range(8 if form == 8 else 4):
        word = load(v, vec)
        if form == 8:
            pairs = [(v, word)]
        else:
            pairs = [(v, builder.and_(word, ir.Constant(vec, [15] * 4 * lanes))),
                     (v + 4, builder.lshr(word, ir.Constant(vec, [4] * 4 * lanes)))]
        for t, g in pairs:
            if bits is not None:
                g = builder.or_(g, _fifth_of_group(builder, bits, t))
            yield t, _codes(builder, path, form, g)


@intrinsic
def interleaved_row(typingctx, isa_, kind, order, q, qo, qh, ho, d, mn, lut, nb, x, xc, xd, xs,
                    out, oo, po):  # type: ignore[no-untyped-def]
    """`fused_row` on a chunk of 16 rows stored interleaved (`qmatmul.interleave`): word v of
    block b of row l at q.flat[qo + 64 (W b + v) + 4 l] (W = 8 words a block for Q8_0, else
    4), its scale, min and fifth bits at d.flat / mn.flat / qh.flat[ho + 16 b + l]; every
    load one vector, nothing transposed. `pass_lanes` rows a pass over the blocks; the next
    chunk's quants from q.flat[po] are prefetched as the first pass goes."""
    if not (_literals(isa_, kind, order) and isinstance(x, types.Array)
            and x.dtype == types.int8):
        return None
    path, form, how = isa_.literal_value, kind.literal_value, order.literal_value
    mins, lanes = form in (4, 5), pass_lanes(isa_.literal_value)
    words = 8 if form == 8 else 4

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        qo_, ho_, nb_, oo_, po_ = (context.cast(builder, args[i], sig.args[i], types.intp)
                                   for i in (4, 6, 10, 16, 17))
        halves, floats = ir.VectorType(_I16, lanes), ir.VectorType(_F32, lanes)

        def load(i, idx, ty, align=4):  # type: ignore[no-untyped-def]
            return builder.load(array_ptr(context, builder, sig, args, i, idx, ty), align=align)

        def at(base, *terms):  # type: ignore[no-untyped-def]
            for scale, value in terms:
                base = builder.add(base, builder.mul(value, ir.Constant(_I64, scale)))
            return base
        for h in range(LANES // lanes):
            sums = _Sums(builder, how, mins, path, lanes)
            with cgutils.for_range(builder, nb_) as loop:
                b = loop.index
                first = at(qo_, (64 * words, b))
                if h == 0:
                    for line in range(words):
                        prefetch_line(builder, array_ptr(context, builder, sig, args, 3, at(
                            po_, (64 * words, b), (64, ir.Constant(_I64, line))), _I8))
                side = at(ho_, (LANES, b), (lanes, ir.Constant(_I64, h)))
                table = lambda bits: load(9, builder.zext(bits, _I64), _F32)  # noqa: E731
                scale = builder.fmul(half_lanes(builder, load(7, side, halves, 2), table),
                                     splat(builder, load(13, b, _F32), floats))
                groups = _interleaved_groups(builder, path, form, lambda v, ty: load(
                    5, side, ty) if v is None else load(3, at(first, (64, ir.Constant(
                        _I64, v)), (4 * lanes, ir.Constant(_I64, h))), ty), lanes)
                for t, codes in groups:
                    sums.add_lane(t, _group_lanes(
                        builder, path, form, codes, t,
                        lambda k4: load(11, builder.mul(k4, ir.Constant(_I64, 4)), _I32, 1),
                        lambda k4: load(12, k4, _I32), b, how), scale)
                sums.end_block(scale, half_lanes(builder, load(8, side, halves, 2), table)
                               if mins else None,
                               splat(builder, load(14, b, _F32), floats) if mins else None)
            builder.store(sums.total(), array_ptr(context, builder, sig, args, 15, at(
                oo_, (lanes, ir.Constant(_I64, h))), floats), align=4)
        return context.get_dummy_value()
    return types.none(isa_, kind, order, q, qo, qh, ho, d, mn, lut, nb, x, xc, xd, xs, out, oo,
                      po), codegen


@intrinsic
def decode_interleaved(typingctx, isa_, kind, q, qo, qh, ho, nb, codes):  # type: ignore[no-untyped-def]
    """`decode_blocks` for a chunk of 16 rows stored interleaved (`interleaved_row`'s
    offsets): each group of every block one load, nothing transposed."""
    if not (isinstance(isa_, types.IntegerLiteral) and isinstance(kind, types.IntegerLiteral)
            and isinstance(codes, types.Array) and codes.dtype == types.int32):
        return None
    path, form = isa_.literal_value, kind.literal_value
    words = 8 if form == 8 else 4

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        qo_, ho_, nb_ = (context.cast(builder, args[i], sig.args[i], types.intp)
                         for i in (3, 5, 6))
        with cgutils.for_range(builder, nb_) as loop:
            b = loop.index
            first = builder.add(qo_, builder.mul(b, ir.Constant(_I64, 64 * words)))
            side = builder.add(ho_, builder.mul(b, ir.Constant(_I64, LANES)))

            def load(v, ty):  # type: ignore[no-untyped-def]
                idx = side if v is None else builder.add(first, ir.Constant(_I64, 64 * v))
                return builder.load(array_ptr(context, builder, sig, args, 4 if v is None
                                              else 2, idx, ty), align=4)
            for t, v in _interleaved_groups(builder, path, form, load, LANES):
                idx = builder.mul(_group(builder, b, t), ir.Constant(_I64, LANES))
                _stored_codes(context, builder, sig, args, path, form, 7, idx, nb_, v)
        return context.get_dummy_value()
    return types.none(isa_, kind, q, qo, qh, ho, nb, codes), codegen


@intrinsic
def widen_halves(typingctx, plane, offs, nb, lut, out):  # type: ignore[no-untyped-def]
    """16 rows' nb float16 values (row l's at plane.flat[offs[l] + b]) as float32, block by
    block: value b of row l at out[16 b + l] (`eight_halves` 8 blocks at a time, the last 8
    overlapping the ones before; under 8 blocks or without F16C `half_vector` a block)."""
    if not (isinstance(plane, types.Array) and plane.dtype == types.uint16):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        nb_ = context.cast(builder, args[2], sig.args[2], types.intp)
        bases = _bases(context, builder, sig, args, (1,))[0]

        def load(i, idx, ty, align):  # type: ignore[no-untyped-def]
            return builder.load(array_ptr(context, builder, sig, args, i, idx, ty), align=align)

        def store(b, v):  # type: ignore[no-untyped-def]
            builder.store(v, array_ptr(context, builder, sig, args, 4, builder.mul(
                b, ir.Constant(_I64, LANES)), _F16), align=4)
        eight = ir.Constant(_I64, GROUP_BLOCKS)
        wide = eight_at_once(builder, nb_)
        with builder.if_else(wide) as (transposed, single):
            with transposed:      # 8 blocks at a time, the last 8 overlapping the ones before
                with cgutils.for_range(builder, block_groups(builder, nb_)) as loop:
                    g0 = group_start(builder, builder.mul(loop.index, eight), nb_)
                    vs = eight_halves(builder, [load(0, builder.add(o, g0), _L4, 2)
                                                for o in bases])
                    for j, v in enumerate(vs):
                        store(builder.add(g0, ir.Constant(_I64, j)), v)
            with single:
                with cgutils.for_range(builder, nb_) as loop:
                    b = loop.index
                    store(b, half_vector(builder, [load(0, builder.add(o, b), _I16, 2)
                                                   for o in bases],
                                         lambda bits: load(3, builder.zext(bits, _I64), _F32, 4)))
        return context.get_dummy_value()
    return types.none(plane, offs, nb, lut, out), codegen


def half_vector(builder, bits, from_table):  # type: ignore[no-untyped-def]
    """16 float16 bit patterns (i16 values) as <16 x float> (`half_lanes` of them)."""
    v = ir.Constant(_W16, ir.Undefined)
    for lane, value in enumerate(bits):
        v = builder.insert_element(v, value, ir.Constant(_I32, lane))
    return half_lanes(builder, v, from_table)


def half_lanes(builder, v, from_table):  # type: ignore[no-untyped-def]
    """A vector of float16 bit patterns (<n x i16>) as <n x float>: one conversion where the
    CPU has F16C, else each looked up through `from_table`."""
    n = v.type.count
    if HARDWARE_HALF:
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), n)),
                             ir.VectorType(_F32, n))
    out = ir.Constant(ir.VectorType(_F32, n), ir.Undefined)
    for lane in range(n):
        bits = builder.extract_element(v, ir.Constant(_I32, lane))
        out = builder.insert_element(out, from_table(bits), ir.Constant(_I32, lane))
    return out


@kernel(inline=True)
def _prefetch_sides(d, mn, qh, lo, hi):  # type: ignore[no-untyped-def]
    """Hint elements lo..hi of the scale plane, and of the min and fifth-bit planes where
    the type has them (empty otherwise), into L2."""
    prefetch_span(d, lo, hi, 32)
    if mn.shape[0]:
        prefetch_span(mn, lo, hi, 32)
    if qh.shape[0]:
        prefetch_span(qh, lo, hi, 16)


@functools.cache
def body(path: int, kind: int, order: int, q_dtype: str, x_rows: int, interleaved: bool
         ) -> Callback:
    """The work of one chunk of 16 weight rows (decode every block once, then every row of
    x, `x_rows` a pass; the same floats at 1 or 2) for a SIMD path, qdot kind, float order
    and layout (rows as stored, or `interleaved`), compiled once as a C callback. No
    defaults: a cache keyed with and without one would compile the same body twice."""
    has_bits, has_min = kind in (5, 50), kind in (4, 5)
    copies = 1 + split_signs(path, kind)       # the decoded codes' copies (|w| beside w)

    def chunk(q_p, n, rb, qh_p, d_p, mn_p, lut_p, x_p, m, k, xc_p, xd_p, xs_p, out_p, n16,
              c, codes_p, dw_p, mw_p):  # type: ignore[no-untyped-def]
        realign_stack()     # AVX2 spills the accumulators: on aligned slots
        nb = k // 32
        q, qh = carray(q_p, (n * rb,)), carray(qh_p, (n * nb if has_bits else 0,))
        d, mn = carray(d_p, (n * nb,)), carray(mn_p, (n * nb if has_min else 0,))
        lut, x = carray(lut_p, (1 << 16,)), carray(x_p, (m * k,))
        xc, xd, xs = carray(xc_p, (m * k // 4,)), carray(xd_p, (m * nb,)), carray(xs_p, (m * nb,))
        out = carray(out_p, (m * n16,))
        codes = carray(codes_p, (nb * 8 * LANES * copies,))   # the chunk's decoded rows
        dw, mw = carray(dw_p, (nb * LANES,)), carray(mw_p, (nb * LANES if has_min else 0,))
        i0 = LANES * c
        if interleaved:           # rows a multiple of 16: whole chunks
            for i in range(LANES * nb):
                dw[i] = lut[d[i0 * nb + i]]
                if has_min:
                    mw[i] = lut[mn[i0 * nb + i]]
            decode_interleaved(path, kind, q, i0 * rb, qh, i0 * nb, nb, codes)
        else:
            qoff, hoff = stack_i64(16), stack_i64(16)
            for lane in range(LANES):
                r = min(i0 + lane, n - 1)
                qoff[lane], hoff[lane] = r * rb, r * nb
            widen_halves(d, hoff, nb, lut, dw)
            if has_min:
                widen_halves(mn, hoff, nb, lut, mw)
            decode_blocks(path, kind, q, qoff, rb // nb, qh, hoff, nb, codes)
        # the next chunk's rows (contiguous in each plane) into L2 while this one computes:
        # its quants a share before each row of x, the rest at once
        lo, hi = min(i0 + LANES, n), min(i0 + 2 * LANES, n)
        _prefetch_sides(d, mn, qh, lo * nb, hi * nb)
        share = -(-(hi - lo) * rb // (64 * m)) * 64
        for mm in range(0, m - m % x_rows, x_rows):
            start = lo * rb + mm * share
            prefetch_span(q, start, min(start + x_rows * share, hi * rb), 64)
            row_dots(path, kind, order, x_rows, codes, nb, dw, mw, x, mm * k, xc,
                     mm * (k // 4), xd, xs, mm * nb, out, mm * n16 + i0, k, n16)
        for mm in range(m - m % x_rows, m):
            start = lo * rb + mm * share
            prefetch_span(q, start, min(start + share, hi * rb), 64)
            row_dots(path, kind, order, 1, codes, nb, dw, mw, x, mm * k, xc, mm * (k // 4),
                     xd, xs, mm * nb, out, mm * n16 + i0, k, n16)
    f32, i64 = types.CPointer(types.float32), types.int64
    q_t = types.CPointer(types.int8 if q_dtype == "|i1" else types.uint8)
    return callback(q_t, i64, i64, types.CPointer(types.uint32), types.CPointer(types.uint16),
                    types.CPointer(types.uint16), f32, types.CPointer(types.int8), i64, i64,
                    types.CPointer(types.int32), f32, f32, f32, i64, i64,
                    types.CPointer(types.int32), f32, f32, exact=True)(chunk)


@functools.cache
def one_row_body(path: int, kind: int, order: int, q_dtype: str, interleaved: bool
                 ) -> Callback:
    """One chunk of 16 weight rows against x's one row (`fused_row`, or `interleaved_row`
    for rows stored `interleaved`), compiled once per SIMD path, qdot kind, float order and
    layout as a C callback."""
    has_bits, has_min = kind in (5, 50), kind in (4, 5)

    def chunk(q_p, n, rb, qh_p, d_p, mn_p, lut_p, x_p, k, xc_p, xd_p, xs_p, out_p, c):  # type: ignore[no-untyped-def]
        nb = k // 32
        q, qh = carray(q_p, (n * rb,)), carray(qh_p, (n * nb if has_bits else 0,))
        d, mn = carray(d_p, (n * nb,)), carray(mn_p, (n * nb if has_min else 0,))
        lut, x = carray(lut_p, (1 << 16,)), carray(x_p, (k,))
        xc, xd, xs = carray(xc_p, (k // 4,)), carray(xd_p, (nb,)), carray(xs_p, (nb,))
        out = carray(out_p, (LANES * c + LANES,))
        r0 = min(LANES * c, n - LANES)     # the last chunk overlaps the one before (the
        # rows they share get the same floats from both)
        p0 = min(r0 + LANES, n - LANES)
        if interleaved:
            interleaved_row(path, kind, order, q, r0 * rb, qh, r0 * nb, d, mn, lut, nb, x, xc,
                            xd, xs, out, r0, p0 * rb)
        else:
            fused_row(path, kind, order, q, r0 * rb, rb, qh, r0 * nb, d, mn, lut, nb, x, xc,
                      xd, xs, out, r0, p0 * rb)
    f32, i64 = types.CPointer(types.float32), types.int64
    q_t = types.CPointer(types.int8 if q_dtype == "|i1" else types.uint8)
    return callback(q_t, i64, i64, types.CPointer(types.uint32), types.CPointer(types.uint16),
                    types.CPointer(types.uint16), f32, types.CPointer(types.int8), i64,
                    types.CPointer(types.int32), f32, f32, f32, i64, exact=True)(chunk)


@kernel(parallel=True, exact=True)
def _one_row(fn, qs, qh, d, mn, lut, xq, xc, xd, xs, out, threads, quantize, x, xdsum, shift,
             bias):  # type: ignore[no-untyped-def]
    """out = the body at `fn` (`one_row_body`) on every chunk of 16 weight rows, in parallel.
    With `quantize` (`activations.q8_0_blocks`' address, else 0) x's float row is first
    quantized into xq/xd/xs/xdsum, and its offset terms (xc, where it has columns) computed,
    on this thread: one call from Python for a decode step's linear."""
    if quantize != 0:
        activations.quantize_at(quantize, x, lut, xq, xd, xs, xdsum)
        if xc.shape[1] != 0:
            _offsets(xq, shift, bias, xc)
    prev = limit_threads(threads)
    n = qs.shape[0]
    for c in prange((n + LANES - 1) // LANES):
        call_address(fn, (data_pointer(qs), n, qs.shape[1], data_pointer(qh), data_pointer(d),
                          data_pointer(mn), data_pointer(lut), data_pointer(xq), xq.shape[1],
                          data_pointer(xc), data_pointer(xd), data_pointer(xs),
                          data_pointer(out), c))
    restore_threads(prev)


@kernel(exact=True)
def _offsets(xq, shift, bias, out):  # type: ignore[no-untyped-def]
    """out[m, g] = bias - (x's quants 4g .. 4g+3 summed) << shift: the offset's term of a
    lane, with the kernel's `BIAS` where it takes one (`biased`)."""
    for m in range(xq.shape[0]):
        for g in range(out.shape[1]):
            total = np.int32(0)
            for t in range(4):
                total += np.int32(xq[m, 4 * g + t])
            out[m, g] = np.int32(bias) - (total << shift)


@kernel(parallel=True, exact=True)
def _wide(fn, qs, qh, d, mn, lut, xq, xc, xd, xs, out, threads, copies):  # type: ignore[no-untyped-def]
    """out = the body at `fn` on every chunk of 16 weight rows, in parallel (fixed chunks:
    the result does not depend on the thread count). A thread takes a contiguous run of
    chunks and one scratch for their decoded rows, allocated once, not once a chunk (two
    copies where the body keeps |w| beside w, `split_signs`)."""
    prev = limit_threads(threads)
    n, nb = qs.shape[0], xq.shape[1] // 32
    chunks = (n + LANES - 1) // LANES
    parts = min(chunks, threads if 0 < threads < prev else prev)
    for p in prange(parts):
        codes = line_aligned(nb * 8 * LANES * copies, np.int32)
        dw, mw = line_aligned(nb * LANES, np.float32), line_aligned(nb * LANES, np.float32)
        for c in range(chunks * p // parts, chunks * (p + 1) // parts):
            call_address(fn, (data_pointer(qs), n, qs.shape[1], data_pointer(qh),
                              data_pointer(d), data_pointer(mn), data_pointer(lut),
                              data_pointer(xq), xq.shape[0], xq.shape[1], data_pointer(xc),
                              data_pointer(xd), data_pointer(xs), data_pointer(out),
                              out.shape[1], c, data_pointer(codes), data_pointer(dw),
                              data_pointer(mw)))
    restore_threads(prev)


_NO_I32 = np.zeros((0, 0), np.int32)
_NO_F32 = np.zeros((0, 0), np.float32)


def _offset_terms(code: int, kind: int, rows: int, k: int) -> np.ndarray:
    """Scratch for x's offset terms (`_offsets`) where `kind`'s codes carry an offset."""
    if kind in OFFSET and not signed_codes(code, kind):
        return np.empty((rows, k // 4), np.int32)
    return _NO_I32


def one_row(w: QuantMatrix, planes: tuple[np.ndarray, ...], x: np.ndarray, kind: int,
            order: int, path: str | None = None) -> np.ndarray:
    """`matmul` of x's one float32 row `[1, K]`, quantized inside the kernel's call (as
    `qmatmul_int.matmul_float`): a decode step's linear, W of 16 rows or more."""
    return run_one_row(one_row_plan(w, planes, kind, order, path), x)


def one_row_plan(w: QuantMatrix, planes: tuple[np.ndarray, ...], kind: int, order: int,
                 path: str | None = None) -> tuple:
    """What `run_one_row` needs for W, kept in its memo (looked up at every decode step's
    linear, it must cost little): the body's address, the planes, the thread limit, the
    offset terms' shift and bias, the scratch's key, the rows."""
    code = isa.code(path) if path else isa.selected_code()
    key = ("one_row", code, kind, order)
    plan = w.memo.get(key)
    if plan is None:
        fn = one_row_body(code, kind, order, planes[0].dtype.str, w.interleaved).address
        threads = 1 if w.rows * w.cols <= SERIAL_MAX_WORK else 0
        plan = w.memo[key] = (fn, byte_codes(planes), threads,
                              _LOG2.get(OFFSET.get(kind, 0), 0),
                              BIAS if biased(code, order) else 0, (code, kind, w.cols), w.rows)
    return plan


def run_one_row(plan: tuple, x: np.ndarray) -> np.ndarray:
    """x's one float32 row `[1, K]` through the weight of `plan` (`one_row_plan`)."""
    fn, planes, threads, shift, bias, (code, kind, k), rows = plan
    xq, xd, xs, xdsum, xc = kept(("one_row", code, kind, k), lambda: (
        np.zeros((1, k), np.int8), *np.zeros((3, 1, k // 32), np.float32),
        _offset_terms(code, kind, 1, k)))
    out = np.empty((1, rows), np.float32)
    _one_row(fn, *planes, HALF_LUT, xq, xc, xd, xs, out, threads,
             activations.q8_0_blocks.address, np.ascontiguousarray(x, np.float32), xdsum, shift,
             bias)
    return out


def matmul(w: QuantMatrix, planes: tuple[np.ndarray, ...], x: activations.Q8Rows, kind: int,
           order: int, path: str | None = None, x_rows: int = X_ROWS) -> np.ndarray:
    """x's Q8 blocks `[M, K]` -> `[M, N]` for W's planes (qs, qh, d, mn as
    `qmatmul_int._plan` gives them) and qdot `kind`, in `order`: LANES_ORDER (vec_dot's,
    tinyBLAS's) or SCALAR_ORDER (the repacked kernels'). `path` forces a SIMD path; `x_rows`
    another count of rows a pass (tests)."""
    code = isa.code(path) if path else isa.selected_code()
    q_dtype = planes[0].dtype.str        # the bodies read the codes as their own type
    fn = body(code, kind, order, q_dtype, x_rows, w.interleaved).address
    qs, qh, d, mn = byte_codes(planes)
    m, k = x.qs.shape
    xc = _offset_terms(code, kind, m, k)
    bias = BIAS if biased(code, order) else 0
    if xc.size:
        _offsets(x.qs, _LOG2[OFFSET[kind]], bias, xc)
    threads = 1 if w.rows * w.cols * m <= SERIAL_MAX_WORK else 0
    if m == 1 and w.rows >= LANES:
        out = np.empty((1, w.rows), np.float32)
        _one_row(one_row_body(code, kind, order, q_dtype, w.interleaved).address, qs, qh,
                 d, mn, HALF_LUT, x.qs, xc, x.d, x.s, out, threads, 0, _NO_F32, _NO_F32, 0, 0)
        return out
    n16 = -(-w.rows // LANES) * LANES
    out = np.empty((m, n16), np.float32)
    _wide(fn, qs, qh, d, mn, HALF_LUT, x.qs, xc, x.d, x.s, out, threads,
          2 if split_signs(code, kind) else 1)
    return out if n16 == w.rows else np.ascontiguousarray(out[:, :w.rows])
