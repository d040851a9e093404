"""Numba intrinsics that hold the K-quant integer kernels' lanes in registers
(`qmatmul_int_k`: Q4_K, Q5_K, Q6_K on x's Q8_K blocks). numba stack arrays indexed in a loop
stay in memory, a store and a reload around every multiply-add; here the 8-lane int32
accumulators are LLVM values for a whole superblock.

The kernels work on two weight rows and up to 4 rows of x at once: 8 pairs, c = 2m + r.
- `superblock_lanes`: every pair's 8 integer lanes over a superblock, stored apart (ggml's
  vec_dot scales them per lane); `q6_offsets` takes Q6_K's -32 offset off them.
- `pair_totals`: the same reduced to one integer per pair by a transposing add tree (lane c =
  pair c), for llama.cpp's repacked Q4_K GEMV; `lane_totals` the same tree over lanes a
  kernel kept in memory (its tiled matmul on Q6_K below `ktiled`'s row count).
- `Planes` and `blocks`: a weight row's 32-weight blocks as byte vectors (`ktiled` decodes
  with them too).
- `min_terms`: every pair's mins against x's sub-block sums per superblock, as 8-lane
  vectors.
- `pair_flush`: the float epilogue of all 8 pairs as 8-lane fused multiply-adds. Each lane
  computes what ggml computes for its pair, so the floats are ggml's bit for bit.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from vllm_actors.kernels.cpu.qdot import scaled_lanes
from vllm_actors.kernels.cpu.qmatmul_simd import vector_ptr

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_B32 = ir.VectorType(_I8, 32)
_L8 = ir.VectorType(_I32, 8)
_F8 = ir.VectorType(ir.FloatType(), 8)
# pair_flush's modes: the repacked Q4_K (acc and mins apart), the tiled Q6_K
FLUSH_REPACKED, FLUSH_TILED_NO_MINS = 0, 2


_at = vector_ptr


def _add(builder, a, n):  # type: ignore[no-untyped-def]
    return builder.add(a, ir.Constant(a.type, n))


def _pairwise(builder, a, b):  # type: ignore[no-untyped-def]
    """(a0+a1, a2+a3, a4+a5, a6+a7, b0+b1, ..., b6+b7) of two <8 x i32>."""
    even = builder.shuffle_vector(a, b, ir.Constant(_L8, [0, 2, 4, 6, 8, 10, 12, 14]))
    odd = builder.shuffle_vector(a, b, ir.Constant(_L8, [1, 3, 5, 7, 9, 11, 13, 15]))
    return builder.add(even, odd)


def _tree(builder, vs):  # type: ignore[no-untyped-def]
    """8 vectors (zeros past the last pair) -> one whose lane c is the total of vector c."""
    while len(vs) > 1:
        vs = [_pairwise(builder, vs[i], vs[i + 1]) for i in range(0, len(vs), 2)]
    return vs[0]


def _padded(vs):  # type: ignore[no-untyped-def]
    return vs + [ir.Constant(_L8, [0] * 8)] * (8 - len(vs))


def _ints(context, builder, sig, args, idx):  # type: ignore[no-untyped-def]
    return [context.cast(builder, args[i], sig.args[i], types.intp) for i in idx]


@intrinsic
def lane_totals(typingctx, iacc, tot, group):  # type: ignore[no-untyped-def]
    """tot[c] = the sum of iacc[8c : 8c+8] for c < 2 `group` (a literal, 1 to 4; tot[c] = 0
    beyond), then iacc[0 : 16 group] = 0: integer lanes a kernel accumulated in memory."""
    if not (isinstance(group, types.IntegerLiteral) and 1 <= group.literal_value <= 4
            and isinstance(iacc, types.Array) and iacc.dtype == types.int32
            and isinstance(tot, types.Array) and tot.dtype == types.int32):
        return None
    n = 2 * group.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        vs = []
        for c in range(n):
            p = _at(context, builder, sig.args[0], args[0], types.intp, _I64(8 * c), _L8)
            vs.append(builder.load(p, align=4))
            builder.store(ir.Constant(_L8, [0] * 8), p, align=4)
        p = _at(context, builder, sig.args[1], args[1], types.intp, _I64(0), _L8)
        builder.store(_tree(builder, _padded(vs)), p, align=4)
        return context.get_dummy_value()
    return types.none(iacc, tot, group), codegen


def _load32(context, builder, sig, args, i, idx):  # type: ignore[no-untyped-def]
    return builder.load(_at(context, builder, sig.args[i], args[i], types.intp, idx, _B32),
                        align=1)


def _bits(builder, v, shift, mask):  # type: ignore[no-untyped-def]
    """(v >> shift) & mask on every byte."""
    return builder.and_(builder.lshr(v, ir.Constant(_B32, [shift] * 32)),
                        ir.Constant(_B32, [mask] * 32))


class Planes:
    """How `blocks` reads a weight row: 32 bytes of its quants (`q`) or high bits (`h`) at a
    flat index, and a scale as i32 (`scale`; Q6_K's scales are signed), from the intrinsic's
    arguments at positions `qi`, `hi` and `si`."""

    def __init__(self, context, builder, sig, args, qi, hi, si):  # type: ignore[no-untyped-def]
        self.context, self.builder, self.sig, self.args = context, builder, sig, args
        self.qi, self.hi, self.si = qi, hi, si

    def q(self, idx):  # type: ignore[no-untyped-def]
        return _load32(self.context, self.builder, self.sig, self.args, self.qi, idx)

    def h(self, idx):  # type: ignore[no-untyped-def]
        return _load32(self.context, self.builder, self.sig, self.args, self.hi, idx)

    def scale(self, idx):  # type: ignore[no-untyped-def]
        ty = self.sig.args[self.si]
        a = self.context.make_array(ty)(self.context, self.builder, self.args[self.si])
        v = self.builder.load(self.builder.gep(a.data, [idx]))
        return (self.builder.sext if ty.dtype.signed else self.builder.zext)(v, _I32)


def blocks(builder, planes, form, npairs, qo, ho, so):  # type: ignore[no-untyped-def]
    """One weight row's blocks of 32 as (weights <32 x i8>, scale of the first 16, of the
    last 16, offset into x's row): `npairs` pairs of Q4_K/Q5_K sub-blocks (the low then the
    high nibbles of 32 bytes; Q5_K's fifth bits 2p and 2p + 1 of its 32 qh bytes), or a
    whole Q6_K superblock (two halves of 64 ql and 32 qh bytes; quarter t the nibbles t // 2
    of ql's 32 bytes t % 2, bits 2t and 2t + 1 of qh, scales 2t and 2t + 1 of the half's 8),
    read through `planes` (a `Planes`)."""
    out = []
    if form == 6:
        for half in range(2):
            high = planes.h(_add(builder, ho, 32 * half))
            for t in range(4):
                low = planes.q(_add(builder, qo, 64 * half + 32 * (t % 2)))
                w = builder.or_(_bits(builder, low, 4 * (t // 2), 15),
                                builder.shl(_bits(builder, high, 2 * t, 3),
                                            ir.Constant(_B32, [4] * 32)))
                j = 8 * half + 2 * t
                out.append((w, planes.scale(_add(builder, so, j)),
                            planes.scale(_add(builder, so, j + 1)), 128 * half + 32 * t))
        return out
    high = planes.h(ho) if form == 5 else None
    for p in range(npairs):
        packed = planes.q(_add(builder, qo, 32 * p))
        for nib in range(2):
            w = _bits(builder, packed, 4 * nib, 15)
            if form == 5:
                w = builder.or_(w, builder.shl(_bits(builder, high, 2 * p + nib, 1),
                                               ir.Constant(_B32, [4] * 32)))
            sc = planes.scale(_add(builder, so, 2 * p + nib))
            out.append((w, sc, sc, 64 * p + 32 * nib))
    return out


def _accumulate(context, builder, sig, args, path, form, rows, npairs):  # type: ignore[no-untyped-def]
    """The 8 integer lanes of every (x row m, weight row r) pair, c = 2m + r, in registers."""
    qo0, qo1, ho0, ho1, so0, so1, xo, k = _ints(context, builder, sig, args,
                                                (5, 6, 8, 9, 11, 12, 14, 15))
    planes = Planes(context, builder, sig, args, 4, 7, 10)
    accs = [ir.Constant(_L8, [0] * 8)] * (2 * rows)
    for r, (qo, ho, so) in enumerate(((qo0, ho0, so0), (qo1, ho1, so1))):
        for w, sa, sb, off in blocks(builder, planes, form, npairs, qo, ho, so):
            for m in range(rows):
                at = builder.add(xo, builder.mul(k, ir.Constant(k.type, m)))
                xv = _load32(context, builder, sig, args, 13, _add(builder, at, off))
                accs[2 * m + r] = scaled_lanes(builder, path, w, xv, accs[2 * m + r], sa, sb)
    return accs


def _typed(isa, form, group, npairs, out):  # type: ignore[no-untyped-def]
    return (all(isinstance(t, types.IntegerLiteral) for t in (isa, form, group, npairs))
            and form.literal_value in (4, 5, 6) and 1 <= group.literal_value <= 4
            and (form.literal_value == 4 or npairs.literal_value == 4)
            and isinstance(out, types.Array) and out.dtype == types.int32)


@intrinsic
def pair_totals(typingctx, isa, form, group, npairs, q, qo0, qo1, h, ho0, ho1, sc, so0, so1, x, xo, k, out):  # type: ignore[no-untyped-def]
    """out[2m + r] = the exact integer dot of weight row r (0, 1) with x row m (< `group`)
    over `npairs` pairs of 32-weight blocks (Q4_K: any count; Q5_K, Q6_K (`form` 5, 6): 4, a
    whole superblock), each block's products times its scales. Row r's quants from
    q[qo_r], high bits from h[ho_r], scales from sc[so_r] (flat indices into C-ordered
    planes; layouts in `_blocks`); x's row m from x[xo + m k]. All but the arrays and
    offsets are literals; `isa` picks the instructions (`qdot.scaled_lanes`): every path
    gives the same sums."""
    if not _typed(isa, form, group, npairs, out):
        return None
    path, kind, rows, count = (t.literal_value for t in (isa, form, group, npairs))

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        accs = _accumulate(context, builder, sig, args, path, kind, rows, count)
        p = _at(context, builder, sig.args[16], args[16], types.intp, _I64(0), _L8)
        builder.store(_tree(builder, _padded(accs)), p, align=4)
        return context.get_dummy_value()
    return types.none(isa, form, group, npairs, q, qo0, qo1, h, ho0, ho1, sc, so0, so1, x, xo,
                      k, out), codegen


@intrinsic
def superblock_lanes(typingctx, isa, form, group, npairs, q, qo0, qo1, h, ho0, ho1, sc, so0, so1, x, xo, k, out):  # type: ignore[no-untyped-def]
    """As `pair_totals`, but the 8 integer lanes of pair c are stored at out[8c : 8c+8]
    (ggml's vec_dot keeps them apart until its float epilogue)."""
    if not _typed(isa, form, group, npairs, out):
        return None
    path, kind, rows, count = (t.literal_value for t in (isa, form, group, npairs))

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        for c, acc in enumerate(_accumulate(context, builder, sig, args, path, kind, rows,
                                            count)):
            p = _at(context, builder, sig.args[16], args[16], types.intp, _I64(8 * c), _L8)
            builder.store(acc, p, align=4)
        return context.get_dummy_value()
    return types.none(isa, form, group, npairs, q, qo0, qo1, h, ho0, ho1, sc, so0, so1, x, xo,
                      k, out), codegen


@intrinsic
def min_terms(typingctx, group, mn, mo0, mo1, xb, bo, kb, out, oi):  # type: ignore[no-untyped-def]
    """The mins of one superblock: out[oi + c] = sum over its 8 sub-blocks s of mn[mo_r + s]
    * (xb[bo + m kb + 2s] + xb[... + 2s + 1]) for pair c = 2m + r (xb x's sums of 16; `group`
    a literal)."""
    if not (isinstance(group, types.IntegerLiteral) and 1 <= group.literal_value <= 4
            and isinstance(out, types.Array) and out.dtype == types.int32
            and isinstance(xb, types.Array) and xb.dtype == types.int16):
        return None
    rows = group.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        mo0_, mo1_, bo_, kb_, oi_ = _ints(context, builder, sig, args, (2, 3, 5, 6, 8))
        mins = [builder.zext(builder.load(_at(context, builder, sig.args[1], args[1],
                                              types.intp, mo, ir.VectorType(_I8, 8)), align=1),
                             _L8) for mo in (mo0_, mo1_)]
        vs = []
        for m in range(rows):
            at = builder.add(bo_, builder.mul(kb_, ir.Constant(kb_.type, m)))
            b16 = builder.sext(builder.load(_at(context, builder, sig.args[4], args[4],
                                                types.intp, at, ir.VectorType(_I16, 16)),
                                            align=2), ir.VectorType(_I32, 16))
            sums = builder.add(
                builder.shuffle_vector(b16, b16, ir.Constant(_L8, list(range(0, 16, 2)))),
                builder.shuffle_vector(b16, b16, ir.Constant(_L8, list(range(1, 16, 2)))))
            vs += [builder.mul(mins[0], sums), builder.mul(mins[1], sums)]
        p = _at(context, builder, sig.args[7], args[7], types.intp, oi_, _L8)
        builder.store(_tree(builder, _padded(vs)), p, align=4)
        return context.get_dummy_value()
    return types.none(group, mn, mo0, mo1, xb, bo, kb, out, oi), codegen


def _fma8(builder, a, b, c):  # type: ignore[no-untyped-def]
    """a * b + c per lane with one rounding (`llvm.fma`, never split into a multiply and an
    add: ggml's floats depend on it)."""
    name = "llvm.fma.v8f32"
    fn = builder.module.globals.get(name) or ir.Function(
        builder.module, ir.FunctionType(_F8, [_F8] * 3), name)
    return builder.call(fn, [a, b, c])


@intrinsic
def pair_flush(typingctx, mode, acc, am, tot, mins, mi, fw):  # type: ignore[no-untyped-def]
    """The float epilogue of 8 pairs (lane c: pair c), t = float(tot[0:8]), n =
    float(mins[mi:mi+8]), fw's factors (`qmatmul_int_k._pair_scales`):
    FLUSH_REPACKED: acc = fma(t, fw[0:8], acc), am = fma(n, fw[8:16], am);
    FLUSH_TILED_NO_MINS: acc = fma(t * fw[0:8], fw[8:16], acc)."""
    if not (isinstance(mode, types.IntegerLiteral) and isinstance(tot, types.Array)
            and tot.dtype == types.int32 and isinstance(fw, types.Array)
            and fw.dtype == types.float32):
        return None
    how = mode.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        def ptr(i, idx, vecty):  # type: ignore[no-untyped-def]
            return _at(context, builder, sig.args[i], args[i], types.intp, idx, vecty)

        mi_ = _ints(context, builder, sig, args, (5,))[0]
        t = builder.sitofp(builder.load(ptr(3, _I64(0), _L8), align=4), _F8)
        n = builder.sitofp(builder.load(ptr(4, mi_, _L8), align=4), _F8)
        f = [builder.load(ptr(6, _I64(8 * i), _F8), align=4) for i in range(2)]
        pa = ptr(1, _I64(0), _F8)
        acc_ = builder.load(pa, align=4)
        if how == FLUSH_REPACKED:
            builder.store(_fma8(builder, t, f[0], acc_), pa, align=4)
            pm = ptr(2, _I64(0), _F8)
            builder.store(_fma8(builder, n, f[1], builder.load(pm, align=4)), pm, align=4)
        else:
            builder.store(_fma8(builder, builder.fmul(t, f[0]), f[1], acc_), pa, align=4)
        return context.get_dummy_value()
    return types.none(mode, acc, am, tot, mins, mi, fw), codegen


@intrinsic
def q6_offsets(typingctx, group, sc, so0, so1, xb, bo, kb, iacc):  # type: ignore[no-untyped-def]
    """Q6_K's -32 offset off the integer lanes of every pair c = 2m + r, as ggml's AVX2 dot
    takes it: lane t of iacc[8c : 8c+8] -= 32 (s_2t b_2t + s_2t+1 b_2t+1), s the 16 scales
    of weight row r's superblock at sc[so_r] (int8), b x row m's 16 sums at xb[bo + m kb]."""
    if not (isinstance(group, types.IntegerLiteral) and 1 <= group.literal_value <= 4
            and isinstance(iacc, types.Array) and iacc.dtype == types.int32
            and isinstance(xb, types.Array) and xb.dtype == types.int16):
        return None
    rows = group.literal_value
    w16 = ir.VectorType(_I32, 16)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        so0_, so1_, bo_, kb_ = _ints(context, builder, sig, args, (2, 3, 5, 6))

        def sixteen(i, at, ty):  # type: ignore[no-untyped-def]
            v = builder.load(_at(context, builder, sig.args[i], args[i], types.intp, at,
                                 ir.VectorType(ty, 16)), align=1)
            return builder.sext(v, w16)

        scales = [sixteen(1, so, _I8) for so in (so0_, so1_)]
        even = ir.Constant(_L8, list(range(0, 16, 2)))
        odd = ir.Constant(_L8, list(range(1, 16, 2)))
        for m in range(rows):
            sums = sixteen(4, builder.add(bo_, builder.mul(kb_, ir.Constant(kb_.type, m))), _I16)
            for r in range(2):
                prod = builder.mul(scales[r], sums)
                pairs = builder.add(builder.shuffle_vector(prod, prod, even),
                                    builder.shuffle_vector(prod, prod, odd))
                p = _at(context, builder, sig.args[7], args[7], types.intp, _I64(8 * (2 * m + r)),
                        _L8)
                off = builder.shl(pairs, ir.Constant(_L8, [5] * 8))
                builder.store(builder.sub(builder.load(p, align=4), off), p, align=4)
        return context.get_dummy_value()
    return types.none(group, sc, so0, so1, xb, bo, kb, iacc), codegen
