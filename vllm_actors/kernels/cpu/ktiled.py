"""The K-quant matmuls of many rows of x (Q4_K, Q5_K, Q6_K on Q8_K blocks) in the float orders
of llama.cpp's kernels for them: its tiled matmul (`ggml-cpu/tiled`, weights it does not
repack, 8+ rows: `qmatmul_int_k.TILED`) and its repacked Q4_K GEMM and GEMV (`q4_K_8x8`:
`qmatmul_int_k.REPACKED_GEMM_Q4_K`, `REPACKED_Q4_K`). Per superblock, 16 weight rows are
decoded once into bytes, interleaved 4 codes per row, so that one `vpdpbusd` multiplies 4
codes of all 16 rows by 4 of x's int8 quants (broadcast): the 16 rows are the lanes, no
horizontal sum is ever taken, and the decoded rows serve every row of x from L1. With s the
sub-blocks (32 weights for Q4_K/Q5_K, 16 for Q6_K) and b x's sums over them, the integers

    total = sum_s sc_s (w_s . q_s - 32 b_s [Q6_K])       mins = sum_s mn_s b_s [Q4_K, Q5_K]

are exact, and the float epilogue is ggml's (`_flush`): per superblock r = fnmadd(dmin_w,
mins, total * d_w), acc = fma(r, d_x, acc) (TILED); per pair of sub-blocks (GEMM) or per
superblock (GEMV) acc = fma(total, d_w d_x, acc), am = fma(mins, dmin_w d_x, am), the result
acc - am. Bit for bit the floats of `qmatmul_int_k`'s pair kernels (verified against
llama.cpp) and of a direct computation (`tests/kernels/test_ktiled.py`). The 4-byte dot
products are `vpdpbusd` with VNNI, `vpmaddubsw` + `vpmaddwd` on AVX2 (a run of groups
summed in int16 first, `ByteDots`), widening multiplies elsewhere: the same integers on
every path. Parallel over fixed chunks of 16 weight rows, so the result does not depend on
the thread count.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import carray, prange, types
from numba.extending import intrinsic

from vllm_actors.kernels.cpu import activations, isa
from vllm_actors.kernels.cpu.intrinsics import (call_address, data_pointer, prefetch,
                                                realign_stack, stack_f32, stack_i32, stack_i64,
                                                transpose_rows)
from vllm_actors.kernels.cpu.jit import Callback, callback, kernel
from vllm_actors.kernels.cpu.ktotals import Planes, blocks
from vllm_actors.kernels.cpu.qdot import AVX2, AVX512
from vllm_actors.kernels.cpu.qmatmul import SERIAL_MAX_WORK, QuantMatrix
from vllm_actors.kernels.cpu.qmatmul_layout import aligned_empty
from vllm_actors.kernels.cpu.qmatmul_prims import (HALF_LUT, byte_view, limit_threads,
                                                   prefetch_span, restore_threads)
from vllm_actors.kernels.cpu.qmatmul_simd import splat, vector_ptr

LANES = 16                  # weight rows per chunk: one 512-bit vector of int32 sums
TILED, GEMM, GEMV = 0, 1, 2  # float orders: ggml's tiled matmul, its repacked Q4_K GEMM, GEMV
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_B64 = ir.VectorType(_I8, 64)
_B32 = ir.VectorType(_I8, 32)
_L16 = ir.VectorType(_I32, 16)
_L8 = ir.VectorType(_I32, 8)
_F16 = ir.VectorType(ir.FloatType(), 16)
_W16 = ir.VectorType(_I16, 16)
_NO_BITS = np.zeros((0, 0), np.uint8)
_NO_U16 = np.zeros((0, 0), np.uint16)
NO_SUMS = np.zeros((0, 0), np.int16)    # `sums_of_32`'s out where a body reads sums of 16


def llvm_call(builder, name, ret, args):  # type: ignore[no-untyped-def]
    """A call of the LLVM intrinsic `name` (declared once per module)."""
    fn = builder.module.globals.get(name) or ir.Function(
        builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def vector_part(builder, v, size, h):  # type: ignore[no-untyped-def]
    """Elements [size h, size (h + 1)) of vector v (v itself where it has no more): the
    256-bit halves the AVX2 intrinsics take."""
    if v.type.count == size:
        return v
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, size),
                                                    list(range(size * h, size * h + size))))


def joined(builder, parts):  # type: ignore[no-untyped-def]
    """Two vectors of one type end to end (one: itself)."""
    if len(parts) == 1:
        return parts[0]
    n = 2 * parts[0].type.count
    return builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(_I32, n),
                                                                  list(range(n))))


def dot4(builder, path, acc, w, x):  # type: ignore[no-untyped-def]
    """acc + lane i of (sum over t < 4 of w[4i+t] x[4i+t]), w unsigned bytes <= 63, x int8,
    exact on every path (`vpmaddubsw`'s int16 pairs stay within 2 * 63 * 128). 16 lanes (8
    on the AVX2 and portable paths too: lanes = w's bytes / 4)."""
    lanes = w.type.count // 4
    if path == AVX512:
        return llvm_call(builder, "llvm.x86.avx512.vpdpbusd.512", _L16,
                     [acc, builder.bitcast(w, _L16), builder.bitcast(x, _L16)])
    if path == AVX2:
        return builder.add(acc, pair_sums(builder, byte_pairs(builder, w, x)))
    wide = ir.VectorType(_I32, 4 * lanes)
    p = builder.mul(builder.zext(w, wide), builder.sext(x, wide))
    for t in range(4):
        acc = builder.add(acc, builder.shuffle_vector(
            p, p, ir.Constant(ir.VectorType(_I32, lanes), list(range(t, 4 * lanes, 4)))))
    return acc


def byte_pairs(builder, w, x):  # type: ignore[no-untyped-def]
    """AVX2's `vpmaddubsw` on w (unsigned bytes) and x (int8), 32 or 64 bytes: each pair of
    products summed into an int16, saturating (callers keep the sums within range)."""
    return joined(builder, [llvm_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [
        vector_part(builder, w, 32, h), vector_part(builder, x, 32, h)])
        for h in range(w.type.count // 32)])


def pair_sums(builder, v):  # type: ignore[no-untyped-def]
    """AVX2's `vpmaddwd` by ones: the int16 pairs of v (16 or 32 of them) added into int32
    lanes."""
    return joined(builder, [llvm_call(builder, "llvm.x86.avx2.pmadd.wd", _L8, [
        vector_part(builder, v, 16, h), ir.Constant(_W16, [1] * 16)])
        for h in range(v.type.count // 16)])


# groups of 4 codes whose `vpmaddubsw` pair sums (each within 2 * 128 * the largest code)
# an int16 holds added up exactly: Q4_K's codes <= 15, Q5_K's <= 31, Q6_K's <= 63
INT16_RUN = {form: 32767 // (256 * largest) for form, largest in ((4, 15), (5, 31), (6, 63))}


class ByteDots:
    """A sum of `dot4`s of 16 rows (int32 lanes). AVX2 keeps up to `run` products as
    `vpmaddubsw`'s int16 pairs and widens them once (`pair_sums`), where `dot4` widened
    each: a multiply less a group (`INT16_RUN` says how many fit exactly; 4 rows of x on a
    Q4_K, 15-20 % faster, docs/BENCHMARKS.md)."""

    def __init__(self, builder, path, run):  # type: ignore[no-untyped-def]
        self.builder, self.path, self.run = builder, path, run
        self.acc = ir.Constant(_L16, [0] * 16)
        self.pending, self.count = None, 0

    def add(self, w, x):  # type: ignore[no-untyped-def]
        """The dot products of w's and x's groups of 4 bytes (`dot4`'s operands) onto the sum."""
        builder = self.builder
        if self.path != AVX2:
            self.acc = dot4(builder, self.path, self.acc, w, x)
            return
        pairs = byte_pairs(builder, w, x)
        self.pending = pairs if self.pending is None else builder.add(self.pending, pairs)
        self.count += 1
        if self.count == self.run:
            self._widen()

    def _widen(self):  # type: ignore[no-untyped-def]
        if self.pending is not None:
            self.acc = self.builder.add(self.acc, pair_sums(self.builder, self.pending))
        self.pending, self.count = None, 0

    def total(self):  # type: ignore[no-untyped-def]
        """The sum so far, int32 lanes."""
        self._widen()
        return self.acc


def madd_pairs(builder, path, a, b):  # type: ignore[no-untyped-def]
    """Lane i of a and b (<16 x i32>) as two int16 each: a_lo b_lo + a_hi b_hi, exact in
    int32 (`vpmaddwd`): a sub-block pair's min terms (mins <= 63, x's sums of 32 within
    +-4096) in one instruction where two `vpmulld` (two uops each) and an add were."""
    w32 = ir.VectorType(_I16, 32)
    a, b = builder.bitcast(a, w32), builder.bitcast(b, w32)
    if path == AVX512:
        return llvm_call(builder, "llvm.x86.avx512.pmaddw.d.512", _L16, [a, b])
    if path == AVX2:
        return joined(builder, [llvm_call(builder, "llvm.x86.avx2.pmadd.wd", _L8, [
            vector_part(builder, a, 16, h), vector_part(builder, b, 16, h)]) for h in range(2)])
    wide = ir.VectorType(_I32, 32)
    p = builder.mul(builder.sext(a, wide), builder.sext(b, wide))
    return builder.add(*(builder.shuffle_vector(p, p, ir.Constant(_L16, list(range(t, 32, 2))))
                         for t in range(2)))


def array_ptr(context, builder, sig, args, i, idx, vecty):  # type: ignore[no-untyped-def]
    """Element idx of the intrinsic's array argument i, as a pointer to `vecty`."""
    return vector_ptr(context, builder, sig.args[i], args[i], types.intp, idx, vecty)


def _index(context, builder, sig, args, i):  # type: ignore[no-untyped-def]
    return context.cast(builder, args[i], sig.args[i], types.intp)


def arguments(context, builder, sig, args, ints):  # type: ignore[no-untyped-def]
    """An intrinsic's integer arguments at positions `ints` as intp values, and
    `load(i, idx, ty, align=1)`: element idx of its array argument i read as a `ty`."""
    def load(i, idx, ty, align=1):  # type: ignore[no-untyped-def]
        return builder.load(array_ptr(context, builder, sig, args, i, idx, ty), align=align)
    return [_index(context, builder, sig, args, i) for i in ints], load


def fma16(builder, a, b, c):  # type: ignore[no-untyped-def]
    """a * b + c per lane, one rounding (`llvm.fma`: never a multiply and an add)."""
    return llvm_call(builder, "llvm.fma.v16f32", _F16, [a, b, c])


def transpose_words(builder, rows):  # type: ignore[no-untyped-def]
    """16 rows' 16 bytes (<4 x i32> each) -> 4 vectors <16 x i32>, word g of every row in
    row order: rows 4L + j gathered into lane L of vector j, then a 4 x 4 transpose of words
    inside each 128-bit lane (the unpacks of 32- then 64-bit elements)."""
    def cat(a, b):  # type: ignore[no-untyped-def]
        n = a.type.count
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 2 * n),
                                                        list(range(2 * n))))
    z = [cat(cat(rows[j], rows[4 + j]), cat(rows[8 + j], rows[12 + j])) for j in range(4)]

    def unpack(a, b, picks):  # type: ignore[no-untyped-def]
        return builder.shuffle_vector(a, b, ir.Constant(_L16, [
            4 * lane + p for lane in range(4) for p in picks]))
    lo32, hi32 = (0, 16, 1, 17), (2, 18, 3, 19)
    lo64, hi64 = (0, 1, 16, 17), (2, 3, 18, 19)
    t0, t1 = unpack(z[0], z[1], lo32), unpack(z[0], z[1], hi32)
    t2, t3 = unpack(z[2], z[3], lo32), unpack(z[2], z[3], hi32)
    return [unpack(t0, t2, lo64), unpack(t0, t2, hi64), unpack(t1, t3, lo64),
            unpack(t1, t3, hi64)]


@intrinsic
def decode_rows(typingctx, form, q, h, qoff, hoff, codes):  # type: ignore[no-untyped-def]
    """16 weight rows' superblocks (row l's quants at q.flat[qoff[l]], high bits at
    h.flat[hoff[l]]; layouts `ktotals.blocks`) into codes: the 4 codes of group g (weights
    4g .. 4g+3, as bytes) of row l at codes[16 g + l] (int32)."""
    if not (isinstance(form, types.IntegerLiteral) and form.literal_value in (4, 5, 6)
            and isinstance(codes, types.Array) and codes.dtype == types.int32):
        return None
    kind = form.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        if kind == 4:
            _decode_q4_k(context, builder, sig, args)
            return context.get_dummy_value()
        planes = Planes(context, builder, sig, args, 1, 2, 1)   # no scales are read
        per_row = []
        for lane in range(LANES):
            at = ir.Constant(_I64, lane)
            qo, ho = (builder.load(array_ptr(context, builder, sig, args, i, at, _I64))
                      for i in (3, 4))
            per_row.append(blocks(builder, planes, kind, 4, qo, ho, ir.Constant(_I64, 0)))
        for j, (_, _, _, off) in enumerate(per_row[0]):
            words = transpose_rows(builder, [builder.bitcast(row[j][0], _L8) for row in per_row])
            for t, v in enumerate(words):
                at = ir.Constant(_I64, LANES * (off // 4 + t))
                builder.store(v, array_ptr(context, builder, sig, args, 5, at, _L16), align=4)
        return context.get_dummy_value()
    return types.none(form, q, h, qoff, hoff, codes), codegen


def _decode_q4_k(context, builder, sig, args):  # type: ignore[no-untyped-def]
    """`decode_rows` for Q4_K: each 16 stored bytes of the 16 rows transposed first
    (`transpose_words`), then split into nibbles on all rows at once. Bytes 32 p + 16 h + 4 g
    .. + 3 hold weights 64 p + 16 h + 4 g .. (low nibbles) and 32 more (high nibbles)."""
    offs = [builder.load(array_ptr(context, builder, sig, args, 3, ir.Constant(_I64, lane),
                                   _I64)) for lane in range(LANES)]
    for p in range(4):
        for h in range(2):
            rows = [builder.load(array_ptr(context, builder, sig, args, 1, builder.add(
                o, ir.Constant(_I64, 32 * p + 16 * h)), ir.VectorType(_I32, 4)), align=1)
                for o in offs]
            for g, v in enumerate(transpose_words(builder, rows)):
                _store_nibbles(context, builder, sig, args, 5, builder.bitcast(v, _B64),
                               p, h, g)


def _store_nibbles(context, builder, sig, args, i, b, p, h, g):  # type: ignore[no-untyped-def]
    """16 rows' bytes 32 p + 16 h + 4 g .. + 3 (one vector, <64 x i8>) as the codes of
    weights 64 p + 16 h + 4 g .. (low nibbles) and the 32 after (high), into the intrinsic's
    codes argument i in `decode_rows`' order."""
    for nib in range(2):
        part = bit_field(builder, AVX512, b, 4 * nib, 15)     # the host's best
        at = ir.Constant(_I64, LANES * (16 * p + 8 * nib + 4 * h + g))
        builder.store(part, array_ptr(context, builder, sig, args, i, at, _B64), align=4)


@intrinsic
def decode_interleaved(typingctx, q, at, codes):  # type: ignore[no-untyped-def]
    """`decode_rows` for 16 interleaved Q4_K rows (`qmatmul_layout.interleave_q4_k`; their
    superblock at q.flat[at ..]): each 64 bytes already one word of every row, so only the
    nibbles are split."""
    if not (isinstance(codes, types.Array) and codes.dtype == types.int32):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        base = _index(context, builder, sig, args, 1)
        for v in range(32):
            b = builder.load(array_ptr(context, builder, sig, args, 0, builder.add(
                base, ir.Constant(_I64, 64 * v)), _B64), align=1)
            _store_nibbles(context, builder, sig, args, 2, b, v // 8, v // 4 % 2, v % 4)
        return context.get_dummy_value()
    return types.none(q, at, codes), codegen


# `vpmultishiftqb` (AVX-512 VBMI) moves bytes' bits on the shuffle port, where LLVM's 512-bit
# byte shifts take a port the dot products need
MULTISHIFT = "avx512vbmi" in isa.host_features()
# `vgf2p8affineqb` (GFNI; its 512-bit form with AVX-512) moves and masks each byte's bits in
# one instruction, where a bit field cost a shift and an AND
AFFINE = {"gfni", "avx512bw"} <= isa.host_features()


def byte_shift(builder, path, v, shift):  # type: ignore[no-untyped-def]
    """The bytes of v (<64 x i8>) shifted right by `shift` (left where negative), with other
    bits in the places shifted in: mask the result. `vpmultishiftqb` on the AVX-512 path
    where the CPU has it (each byte's 8 bits from 8 k + shift of its quadword, wrapping)."""
    if shift == 0:
        return v
    if path == AVX512 and MULTISHIFT:
        picks = [(8 * k + shift) % 64 for _ in range(8) for k in range(8)]
        return llvm_call(builder, "llvm.x86.avx512.pmultishift.qb.512", _B64,
                         [ir.Constant(_B64, picks), v])
    if shift > 0:
        return builder.lshr(v, ir.Constant(_B64, [shift] * 64))
    return builder.shl(v, ir.Constant(_B64, [-shift] * 64))


def bit_field(builder, path, v, shift, mask):  # type: ignore[no-untyped-def]
    """(byte >> shift) & mask for each byte of v (<64 x i8>; a left shift where `shift` is
    negative): one `vgf2p8affineqb` on the AVX-512 path where the CPU has GFNI (result bit
    i is bit i + shift where mask has bit i: row 7 - i of each quadword's bit matrix), else
    `byte_shift` and an AND."""
    if path == AVX512 and AFFINE and shift != 0:
        rows = [0] * 8
        for i in range(8):
            if mask >> i & 1 and 0 <= i + shift < 8:
                rows[7 - i] = 1 << (i + shift)
        return llvm_call(builder, "llvm.x86.vgf2p8affineqb.512", _B64,
                         [v, ir.Constant(_B64, rows * 8), ir.Constant(_I8, 0)])
    return builder.and_(byte_shift(builder, path, v, shift), ir.Constant(_B64, [mask] * 64))


def q6_codes(builder, path, low, high, j):  # type: ignore[no-untyped-def]
    """The 6-bit codes (bytes) of quarter j of a Q6_K half superblock, from the vectors of its
    low bits (word 8 (j % 2) + t of the half; nibble j // 2) and high bits (word t; bits
    2 j): weights 32 j + 4 t .. of the half, as ggml's `dequantize_row_q6_K` reads them."""
    return builder.or_(bit_field(builder, path, low, 4 * (j // 2), 15),
                       bit_field(builder, path, high, 2 * j - 4, 0x30))


@intrinsic
def decode_interleaved_q6_k(typingctx, ql, qh, at, codes):  # type: ignore[no-untyped-def]
    """`decode_rows` for 16 interleaved Q6_K rows (`qmatmul_layout.interleave_words`; their
    superblock's low bits at ql.flat[at ..], high bits at qh.flat[at / 2 ..]): each 64 bytes
    already one word of every row. Group g = 8 c + t (weights 32 c + 4 t ..) from low word
    16 (c // 4) + 8 (c % 2) + t and high word 8 (c // 4) + t."""
    if not (isinstance(codes, types.Array) and codes.dtype == types.int32):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        base = _index(context, builder, sig, args, 2)
        half = builder.lshr(base, ir.Constant(_I64, 1))

        def vector(i, start, word):  # type: ignore[no-untyped-def]
            return builder.load(array_ptr(context, builder, sig, args, i, builder.add(
                start, ir.Constant(_I64, 64 * word)), _B64), align=1)
        for t in range(8):
            high = [vector(1, half, 8 * hh + t) for hh in range(2)]
            for c in range(8):
                hh, j = divmod(c, 4)
                v = q6_codes(builder, AVX512, vector(0, base, 16 * hh + 8 * (j % 2) + t),
                             high[hh], j)     # the host's best shifts: no dot products here
                at = ir.Constant(_I64, LANES * (8 * c + t))
                builder.store(v, array_ptr(context, builder, sig, args, 3, at, _B64), align=4)
        return context.get_dummy_value()
    return types.none(ql, qh, at, codes), codegen


def lane_bytes(builder, words, count, signed):  # type: ignore[no-untyped-def]
    """`count` one-byte values of 16 interleaved rows (`qmatmul_layout.interleave_words`:
    bytes 4 v .. 4 v + 3 of row l in lane l of words[v], <16 x i32>) as vectors <16 x i32>,
    value s of every row in vector s, sign- or zero-extended."""
    out = []
    for sub in range(count):
        w, b = words[sub // 4], sub % 4
        if signed:
            v = builder.ashr(builder.shl(w, ir.Constant(_L16, [24 - 8 * b] * 16)),
                             ir.Constant(_L16, [24] * 16))
        else:
            v = builder.and_(builder.lshr(w, ir.Constant(_L16, [8 * b] * 16)),
                             ir.Constant(_L16, [255] * 16))
        out.append(v)
    return out


@intrinsic
def widen_interleaved(typingctx, sc, at, count, out):  # type: ignore[no-untyped-def]
    """`widen_rows` of 16 interleaved rows' `count` (a literal, 8 or 16) one-byte values
    (sc.flat[at ..], word v of row l at byte 64 v + 4 l; signed or not as sc's dtype):
    value s of row l at out[16 s + l]."""
    if not (isinstance(count, types.IntegerLiteral) and count.literal_value in (8, 16)
            and isinstance(sc, types.Array) and sc.dtype.bitwidth == 8):
        return None
    n = count.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        base = _index(context, builder, sig, args, 1)
        words = [builder.load(array_ptr(context, builder, sig, args, 0, builder.add(
            base, ir.Constant(_I64, 64 * v)), _L16), align=1) for v in range(n // 4)]
        for sub, value in enumerate(lane_bytes(builder, words, n, sig.args[0].dtype.signed)):
            at = ir.Constant(_I64, LANES * sub)
            builder.store(value, array_ptr(context, builder, sig, args, 3, at, _L16), align=4)
        return context.get_dummy_value()
    return types.none(sc, at, count, out), codegen


@intrinsic
def widen_rows(typingctx, src, offs, count, out):  # type: ignore[no-untyped-def]
    """16 rows' `count` (a literal, 8 or 16) one-byte values (row l's at src.flat[offs[l]],
    signed or not as src's dtype) as int32, transposed: value s of row l at out[16 s + l]."""
    if not (isinstance(count, types.IntegerLiteral) and count.literal_value in (8, 16)
            and isinstance(src, types.Array) and src.dtype.bitwidth == 8):
        return None
    n = count.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        extend = builder.sext if sig.args[0].dtype.signed else builder.zext
        halves = [[], []]
        for lane in range(LANES):
            o = builder.load(array_ptr(context, builder, sig, args, 1, ir.Constant(_I64, lane),
                                       _I64))
            for h in range(n // 8):
                at = builder.add(o, ir.Constant(_I64, 8 * h))
                p = array_ptr(context, builder, sig, args, 0, at, ir.VectorType(_I8, 8))
                halves[h].append(extend(builder.load(p, align=1), _L8))
        for h in range(n // 8):
            for t, v in enumerate(transpose_rows(builder, halves[h])):
                at = ir.Constant(_I64, LANES * (8 * h + t))
                builder.store(v, array_ptr(context, builder, sig, args, 3, at, _L16), align=4)
        return context.get_dummy_value()
    return types.none(src, offs, count, out), codegen


def _flush(builder, order, total, mins, dw, dm, dx, acc, am):  # type: ignore[no-untyped-def]
    """A superblock's (TILED, GEMV) or a pair of sub-blocks' (GEMM) float epilogue onto the
    accumulators (16 lanes each): TILED acc = fma(fnmadd(dmin_w, mins, total * d_w), d_x,
    acc); GEMM, GEMV acc = fma(total, d_w d_x, acc), am = fma(mins, dmin_w d_x, am)."""
    t = builder.sitofp(total, _F16)
    if order != TILED:
        n = builder.sitofp(mins, _F16)
        return (fma16(builder, t, builder.fmul(dw, dx), acc),
                fma16(builder, n, builder.fmul(dm, dx), am))
    r = builder.fmul(t, dw)
    if mins is not None:
        r = fma16(builder, builder.fsub(ir.Constant(_F16, [-0.0] * 16), dm),
                   builder.sitofp(mins, _F16), r)
    return fma16(builder, r, dx, acc), am


def _sub_block(builder, path, kind, load, s, groups, xos, bos):  # type: ignore[no-untyped-def]
    """Sub-block s's integer dot of the 16 weight rows (`tile_row`'s codes, argument 4) with
    each row of x whose quants start at xos[r] (argument 9): one vector <16 x i32> a row of
    x, each vector of codes loaded once for all of them; Q6_K's offset taken off as 32 times
    x's sum of 16 (argument 11, from bos[r])."""
    def at(n):  # type: ignore[no-untyped-def]
        return ir.Constant(_I64, n)
    dots = [ByteDots(builder, path, INT16_RUN[kind]) for _ in xos]
    for g in range(groups):
        kg = s * groups + g
        w = load(4, at(LANES * kg), _B64)
        for r, xo in enumerate(xos):
            xv = builder.bitcast(splat(builder, load(9, builder.add(xo, at(4 * kg)), _I32, 1),
                                       _L16), _B64)
            dots[r].add(w, xv)
    a = [d.total() for d in dots]
    if kind == 6:
        for r, bo in enumerate(bos):
            xs = splat(builder, builder.sext(load(11, builder.add(bo, at(s)), _I16, 2), _I32),
                       _L16)
            a[r] = builder.sub(a[r], builder.shl(xs, ir.Constant(_L16, [5] * 16)))
    return a


def _rows_of_x(context, builder, sig, args, count, load, kind):  # type: ignore[no-untyped-def]
    """`tile_row`'s rows of x: where each one's quants and sums (of 16 for Q6_K, else of
    32) start, its d_x (in every lane), and pointers to its 16 outputs in out and am."""
    xo_, bo_, do_, oo_, k_, n16_ = (_index(context, builder, sig, args, i)
                                    for i in (10, 12, 14, 17, 18, 19))

    def of_row(base, step):  # type: ignore[no-untyped-def]
        return [builder.add(base, builder.mul(step, ir.Constant(_I64, r)))
                for r in range(count)]
    sums = builder.lshr(k_, ir.Constant(_I64, 4 if kind == 6 else 5))
    xos, bos = of_row(xo_, k_), of_row(bo_, sums)
    dxs = [splat(builder, load(13, d, ir.FloatType()), _F16)
           for d in of_row(do_, builder.lshr(k_, ir.Constant(_I64, 8)))]
    oos = of_row(oo_, n16_)
    return (xos, bos, dxs, *([array_ptr(context, builder, sig, args, i, o, _F16) for o in oos]
                             for i in (15, 16)))


X_ROWS = 2         # rows of x `tile_row` takes at once in the TILED order: each loaded vector
# of codes serves both (the GEMM order's per-pair epilogues gained nothing: docs/BENCHMARKS.md,
# "Two rows of x a pass")


@intrinsic
def tile_row(typingctx, isa_, form, order, rows, codes, sc, mn, dw, dm, x, xo, xb, bo, xd, do,
             out, am, oo, k, n16):  # type: ignore[no-untyped-def]
    """`rows` (a literal, 1 or X_ROWS) rows of x against the superblock of 16 decoded weight
    rows (`decode_rows`; their scales at sc[16 s + i], mins as int16 pairs at mn[16 p + i]
    (`_min_pairs`), d_w and dmin_w at dw[i], dm[i]). Row r of them: quants at
    x.flat[xo + r k], sums (int16) at xb.flat[bo + r k/16] for Q6_K (of 16) and at
    xb.flat[bo + r k/32] for the others (of 32: a pair of sub-blocks' one 32-bit word), d_x at
    xd.flat[do + r k/256]; the results onto out.flat[oo + r n16 ..][:16] (and
    am's, the repacked kernels' min sums), lane i for weight row i, in the float order
    `order` (a literal: TILED, GEMM or GEMV)."""
    if not (isinstance(isa_, types.IntegerLiteral) and isinstance(form, types.IntegerLiteral)
            and isinstance(order, types.IntegerLiteral) and form.literal_value in (4, 5, 6)
            and isinstance(rows, types.IntegerLiteral)
            and isinstance(x, types.Array) and x.dtype == types.int8
            and isinstance(xb, types.Array) and xb.dtype == types.int16):
        return None
    path, kind, how, count = (isa_.literal_value, form.literal_value, order.literal_value,
                              rows.literal_value)
    subs, groups = (16, 4) if kind == 6 else (8, 8)      # sub-blocks, groups of 4 in each
    flush_every = 2 if how == GEMM else subs            # sub-blocks per float epilogue

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        def load(i, idx, vecty, align=4):  # type: ignore[no-untyped-def]
            return builder.load(array_ptr(context, builder, sig, args, i, idx, vecty), align=align)

        def at(n):  # type: ignore[no-untyped-def]
            return ir.Constant(_I64, n)

        xos, bos, dxs, p_acc, p_am = _rows_of_x(context, builder, sig, args, count, load, kind)
        dw, dm = load(7, at(0), _F16), load(8, at(0), _F16)
        acc = [builder.load(p, align=4) for p in p_acc]
        am = [builder.load(p, align=4) for p in p_am]
        zero = ir.Constant(_L16, [0] * 16)
        total, mins = [zero] * count, [zero] * count
        for s in range(subs):
            a = _sub_block(builder, path, kind, load, s, groups, xos, bos)
            scale = load(5, at(LANES * s), _L16)
            pairs = load(6, at(LANES * (s // 2)), _L16) if kind != 6 and s % 2 else None
            for r in range(count):
                total[r] = builder.add(total[r], builder.mul(a[r], scale))
                if pairs is not None:   # sub-blocks s - 1 and s: one multiply-add of pairs
                    word = load(11, builder.add(bos[r], ir.Constant(_I64, s - 1)), _I32, 2)
                    mins[r] = builder.add(mins[r], madd_pairs(builder, path, pairs,
                                                              splat(builder, word, _L16)))
                if (s + 1) % flush_every == 0:
                    acc[r], am[r] = _flush(builder, how, total[r],
                                           mins[r] if kind != 6 else None, dw, dm, dxs[r],
                                           acc[r], am[r])
                    total[r], mins[r] = zero, zero
        for r in range(count):
            builder.store(acc[r], p_acc[r], align=4)
            if how != TILED:
                builder.store(am[r], p_am[r], align=4)
        return context.get_dummy_value()
    return types.none(isa_, form, order, rows, codes, sc, mn, dw, dm, x, xo, xb, bo, xd, do,
                      out, am, oo, k, n16), codegen


@kernel(inline=True)
def _prefetch_next(q, h, n, rb, hb, hq, nsb, i0, sb):  # type: ignore[no-untyped-def]
    """Hint the 16 rows' next superblock (the next chunk's first after a row's last) into
    L2 while this one computes: its 128 quant bytes and its high bits' bytes."""
    nxt, first = sb + 1, i0
    if nxt == nsb:
        nxt, first = 0, i0 + LANES
    if first >= n:
        return
    for lane in range(LANES):
        r = min(first + lane, n - 1)
        prefetch(q, r * rb + 128 * nxt)
        prefetch(q, r * rb + 128 * nxt + 64)
        if h.shape[0] != 0:      # Q5_K, Q6_K
            prefetch(h, r * hb + hq * nxt)


@intrinsic
def _min_pairs(typingctx, mins, pairs):  # type: ignore[no-untyped-def]
    """The 8 sub-blocks' mins of 16 rows (mins[16 s + l], at most 63) as int16 pairs:
    sub-blocks 2p and 2p + 1 of row l in the low and high half of pairs[16 p + l]
    (`madd_pairs`), a vector a pair (as a loop it stayed scalar: 4-row matmuls 15 % slower)."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        def at(i, n):  # type: ignore[no-untyped-def]
            return array_ptr(context, builder, sig, args, i, ir.Constant(_I64, n), _L16)
        for p in range(4):
            lo, hi = (builder.load(at(0, 32 * p + 16 * h), align=4) for h in range(2))
            builder.store(builder.or_(lo, builder.shl(hi, ir.Constant(_L16, [16] * 16))),
                          at(1, 16 * p), align=4)
        return context.get_dummy_value()
    return types.none(mins, pairs), codegen


@kernel(inline=True)
def _clear_strips(out, am, m, n16, i0):  # type: ignore[no-untyped-def]
    """Zero the chunk's 16 columns of out and am (am empty in the TILED order) for every
    row of x, before its first superblock: the columns stay in cache for the chunk, where a
    whole-array memset before the call went out to memory."""
    for mm in range(m):
        for lane in range(LANES):
            out[mm * n16 + i0 + lane] = 0.0
            if am.shape[0] != 0:
                am[mm * n16 + i0 + lane] = 0.0


@kernel(inline=True)
def _less_mins(out, am, m, n16, i0):  # type: ignore[no-untyped-def]
    """The repacked kernels' result for the chunk's columns: the sums less the min sums,
    once at the end (as ggml's 8x8 kernels), while the columns are still in cache (nothing
    in the TILED order, whose am is empty)."""
    if am.shape[0] == 0:
        return
    for mm in range(m):
        for lane in range(LANES):
            out[mm * n16 + i0 + lane] -= am[mm * n16 + i0 + lane]


@kernel(inline=True)
def _row_starts(form, interleaved, n, rb, hb, nsb, i0, sb, d, dmin, lut, qoff, hoff, soff, moff, dw, dm):  # type: ignore[no-untyped-def]
    """Where superblock sb of each of the 16 rows from i0 starts in the planes as stored (the
    last row repeated past n), and its d_w and dmin_w (`lut`: float16 -> float32), read
    from interleaved planes where they are."""
    hq, nsc = (64, 16) if form == 6 else (32, 8)    # high-bit bytes, scales per superblock
    for lane in range(LANES):
        r = min(i0 + lane, n - 1)
        qoff[lane], hoff[lane] = r * rb + 128 * sb, r * hb + hq * sb
        soff[lane], moff[lane] = nsc * (r * nsb + sb), 8 * (r * nsb + sb)
        at = i0 * nsb + LANES * sb + lane if interleaved else r * nsb + sb
        dw[lane] = lut[d[at]]
        if form != 6:
            dm[lane] = lut[dmin[at]]


@kernel(inline=True)
def _decode(form, interleaved, q, h, sc, mn, qo, so, qoff, hoff, soff, moff, codes, scales, mins):  # type: ignore[no-untyped-def]
    """A superblock of 16 weight rows into `codes`, `scales` and (Q4_K, Q5_K) `mins` (int32,
    16 rows each): as stored (row l's at qoff[l], hoff[l], soff[l], moff[l]), or interleaved
    (the chunk's superblock at q.flat[qo ..], high bits at h.flat[qo / 2 ..], scales and
    mins at sc.flat / mn.flat[so ..])."""
    if interleaved and form == 6:
        decode_interleaved_q6_k(q, h, qo, codes)
    elif interleaved:
        decode_interleaved(q, qo, codes)
    else:
        decode_rows(form, q, h, qoff, hoff, codes)
    if interleaved:
        widen_interleaved(sc, so, 16 if form == 6 else 8, scales)
        if form != 6:
            widen_interleaved(mn, so, 8, mins)
    else:
        widen_rows(sc, soff, 16 if form == 6 else 8, scales)
        if form != 6:
            widen_rows(mn, moff, 8, mins)


@functools.cache
def body(path: int, form: int, order: int, sc_dtype: str, interleaved: bool = False
         ) -> Callback:
    """The work of one chunk of 16 weight rows (all superblocks, all rows of x) for a SIMD
    path, form (4, 5, 6: Q4_K, Q5_K, Q6_K), float order and layout (rows as stored, or
    `interleaved` as `qmatmul.interleave` keeps a repacked Q4_K or a Q6_K), compiled once as
    a C callback."""
    hq = 64 if form == 6 else 32          # high-bit bytes per superblock
    nsc = 16 if form == 6 else 8          # scales per superblock
    together = X_ROWS if order == TILED else 1    # rows of x per `tile_row`

    def chunk(q_p, n, rb, h_p, hb, sc_p, mn_p, d_p, dm_p, lut_p, x_p, m, k, xb_p, xd_p,
              out_p, am_p, n16, c):  # type: ignore[no-untyped-def]
        nsb = k // 256
        q, h = carray(q_p, (n * rb,)), carray(h_p, (n * hb if form != 4 else 0,))
        sc = carray(sc_p, (n * nsc * nsb,))
        mn = carray(mn_p, (n * 8 * nsb if form != 6 else 0,))
        d, dmin = carray(d_p, (n * nsb,)), carray(dm_p, (n * nsb if form != 6 else 0,))
        lut, x = carray(lut_p, (1 << 16,)), carray(x_p, (m * k,))
        xb, xd = carray(xb_p, (m * k // (16 if form == 6 else 32),)), carray(xd_p, (m * nsb,))
        per = 16 if form == 6 else 8        # x's sums a superblock
        realign_stack()                     # the tile rows' vector spills on cache lines
        out, am = carray(out_p, (m * n16,)), carray(am_p, (m * n16 if order != TILED else 0,))
        codes, scales, mins = stack_i32(1024), stack_i32(256), stack_i32(128)   # 16 rows each
        dw, dm, pairs = stack_f32(16), stack_f32(16), stack_i32(64)
        qoff, hoff, soff, moff = stack_i64(16), stack_i64(16), stack_i64(16), stack_i64(16)
        i0 = LANES * c
        _clear_strips(out, am, m, n16, i0)
        for sb in range(nsb):
            if interleaved:         # the chunk's superblocks are one run: hint the next one
                nxt = i0 * rb + 2048 * (sb + 1)
                prefetch_span(q, nxt, min(nxt + 2048, q.shape[0]), 64)
                if form == 6:
                    prefetch_span(h, nxt // 2, min(nxt // 2 + 1024, h.shape[0]), 64)
            else:
                _prefetch_next(q, h, n, rb, hb, hq, nsb, i0, sb)
            _row_starts(form, interleaved, n, rb, hb, nsb, i0, sb, d, dmin, lut, qoff, hoff,
                        soff, moff, dw, dm)
            _decode(form, interleaved, q, h, sc, mn, i0 * rb + 2048 * sb,
                    nsc * (i0 * nsb + LANES * sb), qoff, hoff, soff, moff, codes, scales,
                    mins)
            if form != 6:
                _min_pairs(mins, pairs)
            for mm in range(0, m - m % together, together):
                tile_row(path, form, order, together, codes, scales, pairs, dw, dm, x,
                         mm * k + 256 * sb, xb, mm * per * nsb + per * sb, xd, mm * nsb + sb,
                         out, am if order != TILED else out, mm * n16 + i0, k, n16)
            for mm in range(m - m % together, m):
                tile_row(path, form, order, 1, codes, scales, pairs, dw, dm, x,
                         mm * k + 256 * sb, xb, mm * per * nsb + per * sb, xd, mm * nsb + sb,
                         out, am if order != TILED else out, mm * n16 + i0, k, n16)
        _less_mins(out, am, m, n16, i0)
    u8, i64, f32 = types.CPointer(types.uint8), types.int64, types.CPointer(types.float32)
    u16 = types.CPointer(types.uint16)
    sc_t = types.CPointer(numba.from_dtype(np.dtype(sc_dtype)))
    return callback(u8, i64, i64, u8, i64, sc_t, u8, u16, u16, f32, types.CPointer(types.int8),
                    i64, i64, types.CPointer(types.int16), f32, f32, f32, i64, i64,
                    exact=True)(chunk)


@kernel(inline=True)
def sums_of_32(xb, out):  # type: ignore[no-untyped-def]
    """The sums of x a body reads: where `out` has columns (int16 [M, K / 32]; a Q4_K or
    Q5_K body, `NO_SUMS` else), x's sums of 32 (each within +-4096) written there from its
    sums of 16 (`xb`, [M, K / 16]) and `out` returned, read as one 32-bit word a pair of
    sub-blocks against their mins; else `xb`. Written once a call: each chunk of weight rows
    had added and packed the same pairs again, in scalar code beside its vector work."""
    if out.shape[1] == 0:
        return xb
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = xb[i, 2 * j] + xb[i, 2 * j + 1]
    return out


@kernel(parallel=True, exact=True)
def _tiled(fn, q, h, sc, mn, d, dmin, lut, xq, xb, sums32, xd, out, am, threads):  # type: ignore[no-untyped-def]
    """out (and am) = the body at `fn` on every chunk of 16 weight rows; the body reads x's
    sums of 32 (`sums_of_32`, into sums32) where sums32 has columns, else its sums of 16."""
    sums = sums_of_32(xb, sums32)
    prev = limit_threads(threads)
    n = q.shape[0]
    for c in prange((n + LANES - 1) // LANES):
        call_address(fn, (data_pointer(q), n, q.shape[1], data_pointer(h), h.shape[1],
                          data_pointer(sc), data_pointer(mn), data_pointer(d),
                          data_pointer(dmin), data_pointer(lut), data_pointer(xq),
                          xq.shape[0], xq.shape[1], data_pointer(sums), data_pointer(xd),
                          data_pointer(out), data_pointer(am), out.shape[1], c))
    restore_threads(prev)


FORMS = {12: 4, 13: 5, 14: 6}       # GGML type (Q4_K, Q5_K, Q6_K) -> form


def matmul(w: QuantMatrix, x: activations.Q8KRows, order: int, path: str | None = None
           ) -> np.ndarray:
    """x's Q8_K blocks `[M, K]` -> `[M, N]` in the float order `order`: TILED (W Q4_K, Q5_K
    or Q6_K as llama.cpp keeps them), GEMM or GEMV (W Q4_K that llama.cpp repacks: its
    8x8 kernels, per pair of sub-blocks or per superblock). `path` forces
    a SIMD path (default `isa.selected()`)."""
    form = FORMS[int(w.qtype)]
    if form == 6:        # ql, qh, scales, d
        (q, h, sc, d), mn, dmin = w.planes, _NO_BITS, _NO_U16
    elif form == 5:      # qh, qs, sc, mn, d, dmin
        h, q, sc, mn, d, dmin = w.planes
    else:                # qs, sc, mn, d, dmin
        (q, sc, mn, d, dmin), h = w.planes, _NO_BITS
    code = isa.code(path) if path else isa.selected_code()
    fn = body(code, form, order, sc.dtype.str, w.interleaved).address
    m, k = x.qs.shape
    n16 = -(-w.rows // LANES) * LANES
    out = aligned_empty((m, n16), np.float32)   # each chunk clears and finishes its columns
    am = aligned_empty((m, n16) if order != TILED else (0, 0), np.float32)
    threads = 1 if w.rows * w.cols * m <= SERIAL_MAX_WORK else 0
    sums32 = NO_SUMS if form == 6 else np.empty((m, k // 32), np.int16)
    _tiled(fn, q, h, byte_view(sc), mn, d, dmin, HALF_LUT, x.qs, x.bsums, sums32, x.d, out, am,
           threads)
    return out if n16 == w.rows else np.ascontiguousarray(out[:, :w.rows])
