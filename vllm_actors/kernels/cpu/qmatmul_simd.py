"""8-lane float32 vector operations for the float semantics' block decoders (`qmatmul_codec`)
and the multi-row GEMV (`qmatmul_multi`), as numba
intrinsics in memory form: each reads and writes 8 consecutive elements of an array at a flat
element index (no bounds checks; arrays C-contiguous).

Why intrinsics: the multi-row kernels keep one 8-lane accumulator per (x row, weight row) and
the decoded block of W (`w`) in `stack_f32` arrays indexed by constants, which LLVM promotes
to vector registers. Written as numba loops, that only vectorizes while LLVM's unroll and
vectorizer heuristics happen to agree: with the per-row code in an inlined helper, the lane
loops were unrolled first and, after reassociation, left scalar (3-4x slower than the
one-row GEMV at M = 1). Here every operation is an explicit `<8 x float>` load, FMA or store,
so nothing depends on those heuristics, and the products need no unrolling at all. numba's
fast-math pass still flags the plain multiplies and adds (`jit.FASTMATH`), so LLVM may
reassociate `vrows`' sums: it makes them a chain of FMAs on the accumulator (keeping the
written order measured no faster, and spilled at 5 rows of x with two weight rows).

Decoders write w[wi:wi+8] from 8 quants: `vnib` (a nibble: Q4_0/Q4_1/Q4_K), `vq5` (a nibble
and a fifth bit: Q5_0/Q5_1), `vi8` (int8: Q8_0), `vbits` (a nibble and high bits from bytes
of their own: Q5_K, Q6_K). `vrows` multiplies up to R = 2 decoded rows of 32 weights into G
rows of x (G, R literals).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V8 = ir.VectorType(_F32, 8)
_I8X8 = ir.VectorType(ir.IntType(8), 8)
_I32X8 = ir.VectorType(_I32, 8)


def vector_ptr(context, builder, aryty, ary, idxty, idx, vecty):  # type: ignore[no-untyped-def]
    """Pointer to element `idx` of the array, as a pointer to `vecty`."""
    a = context.make_array(aryty)(context, builder, ary)
    i = context.cast(builder, idx, idxty, types.intp)
    return builder.bitcast(builder.gep(a.data, [i]), vecty.as_pointer())


def splat(builder, value, vecty):  # type: ignore[no-untyped-def]
    v = builder.insert_element(ir.Constant(vecty, ir.Undefined), value, _I32(0))
    mask = ir.Constant(ir.VectorType(_I32, vecty.count), [0] * vecty.count)
    return builder.shuffle_vector(v, ir.Constant(vecty, ir.Undefined), mask)


def fmuladd(builder, a, b, c):  # type: ignore[no-untyped-def]
    """a * b + c on vectors: one FMA where the CPU has them (llvm.fmuladd; llvm.fma would
    become per-lane library calls on a CPU without)."""
    name = f"llvm.fmuladd.v{a.type.count}f32"
    fn = builder.module.globals.get(name) or ir.Function(
        builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(fn, [a, b, c])


def _scalar(context, builder, sig, args, i):  # type: ignore[no-untyped-def]
    return context.cast(builder, args[i], sig.args[i], types.float32)


def _f32(t) -> bool:  # type: ignore[no-untyped-def]
    return isinstance(t, types.Array) and t.dtype == types.float32


def _bytes(t, dtype) -> bool:  # type: ignore[no-untyped-def]
    return isinstance(t, types.Array) and t.dtype == dtype


@intrinsic
def vzero(typingctx, arr, i):  # type: ignore[no-untyped-def]
    """arr[i:i+8] = 0."""
    if not _f32(arr) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        p = vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _V8)
        builder.store(ir.Constant(_V8, [0.0] * 8), p, align=4)
        return context.get_dummy_value()
    return types.none(arr, i), codegen


@intrinsic
def vsum(typingctx, arr, i):  # type: ignore[no-untyped-def]
    """sum(arr[i:i+8]) as float32 (pairwise: halves, quarters, pairs)."""
    if not _f32(arr) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        v = builder.load(vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                              _V8), align=4)
        for half in (4, 2, 1):
            parts = [builder.shuffle_vector(
                v, ir.Constant(v.type, ir.Undefined),
                ir.Constant(ir.VectorType(_I32, half), list(range(s, s + half))))
                for s in (0, half)]
            v = builder.fadd(parts[0], parts[1])
        return builder.extract_element(v, _I32(0))
    return types.float32(arr, i), codegen


@intrinsic
def vrows(typingctx, acc, w, x, xi, g, r):  # type: ignore[no-untyped-def]
    """For j < g, k < r: acc[8(r j + k):+8] += sum over c < 4 of w[32 k + 8 c:+8] *
    x.flat[xi + j K + 8 c:+8] (x `[M, K]`; g, r literals): a multiply, three FMAs and an add
    into the accumulator as written (LLVM may reassociate: see the module docstring)."""
    if not (_f32(acc) and _f32(w) and _f32(x) and isinstance(xi, types.Integer)
            and isinstance(g, types.IntegerLiteral) and isinstance(r, types.IntegerLiteral)):
        return None
    rows_x, rows_w = g.literal_value, r.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        xa = context.make_array(sig.args[2])(context, builder, args[2])
        k = builder.extract_value(xa.shape, 1)
        base = builder.gep(xa.data, [context.cast(builder, args[3], sig.args[3], types.intp)])
        pa = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data,
                             _V8.as_pointer())
        pw = builder.bitcast(context.make_array(sig.args[1])(context, builder, args[1]).data,
                             _V8.as_pointer())
        ws = [[builder.load(builder.gep(pw, [_I32(4 * kk + c)]), align=4) for c in range(4)]
              for kk in range(rows_w)]
        for j in range(rows_x):
            row = builder.bitcast(builder.gep(base, [builder.mul(k, ir.Constant(k.type, j))]),
                                  _V8.as_pointer())
            xs = [builder.load(builder.gep(row, [_I32(c)]), align=4) for c in range(4)]
            for kk in range(rows_w):
                t = builder.fmul(ws[kk][0], xs[0])
                for c in range(1, 4):
                    t = fmuladd(builder, ws[kk][c], xs[c], t)
                p = builder.gep(pa, [_I32(rows_w * j + kk)])
                builder.store(builder.fadd(builder.load(p, align=4), t), p, align=4)
        return context.get_dummy_value()
    return types.none(acc, w, x, xi, g, r), codegen


@intrinsic
def vnib(typingctx, w, wi, q, qi, shift, scale, bias):  # type: ignore[no-untyped-def]
    """w[wi:+8] = scale * ((q[qi:+8] >> shift) & 15) + bias (q uint8)."""
    if not (_f32(w) and _bytes(q, types.uint8)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        pq = vector_ptr(context, builder, sig.args[2], args[2], sig.args[3], args[3], _I8X8)
        v = builder.zext(builder.load(pq, align=1), _I32X8)
        sh = context.cast(builder, args[4], sig.args[4], types.int32)
        v = builder.and_(builder.lshr(v, splat(builder, sh, _I32X8)),
                         ir.Constant(_I32X8, [15] * 8))
        f = builder.sitofp(v, _V8)
        s = splat(builder, _scalar(context, builder, sig, args, 5), _V8)
        b = splat(builder, _scalar(context, builder, sig, args, 6), _V8)
        pw = vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _V8)
        builder.store(fmuladd(builder, f, s, b), pw, align=4)
        return context.get_dummy_value()
    return types.none(w, wi, q, qi, shift, scale, bias), codegen


@intrinsic
def vq5(typingctx, w, wi, q, qi, shift, bits, first, scale, bias):  # type: ignore[no-untyped-def]
    """w[wi:+8] = scale * (((q[qi:+8] >> shift) & 15) | ((bits >> (first + i)) & 1) << 4) +
    bias for lane i (q uint8, `bits` Q5_0/Q5_1's 32 fifth bits of the block)."""
    if not (_f32(w) and _bytes(q, types.uint8) and isinstance(bits, types.Integer)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        pq = vector_ptr(context, builder, sig.args[2], args[2], sig.args[3], args[3], _I8X8)
        v = builder.zext(builder.load(pq, align=1), _I32X8)
        sh = context.cast(builder, args[4], sig.args[4], types.int32)
        v = builder.and_(builder.lshr(v, splat(builder, sh, _I32X8)),
                         ir.Constant(_I32X8, [15] * 8))
        first = splat(builder, context.cast(builder, args[6], sig.args[6], types.int32),
                       _I32X8)
        hb = splat(builder, context.cast(builder, args[5], sig.args[5], types.uint32), _I32X8)
        hb = builder.lshr(hb, builder.add(first, ir.Constant(_I32X8, list(range(8)))))
        hb = builder.shl(builder.and_(hb, ir.Constant(_I32X8, [1] * 8)),
                         ir.Constant(_I32X8, [4] * 8))
        f = builder.sitofp(builder.or_(v, hb), _V8)
        s = splat(builder, _scalar(context, builder, sig, args, 7), _V8)
        b = splat(builder, _scalar(context, builder, sig, args, 8), _V8)
        pw = vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _V8)
        builder.store(fmuladd(builder, f, s, b), pw, align=4)
        return context.get_dummy_value()
    return types.none(w, wi, q, qi, shift, bits, first, scale, bias), codegen


@intrinsic
def vi8(typingctx, w, wi, q, qi, scale):  # type: ignore[no-untyped-def]
    """w[wi:+8] = scale * q[qi:+8] (q int8)."""
    if not (_f32(w) and _bytes(q, types.int8)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        pq = vector_ptr(context, builder, sig.args[2], args[2], sig.args[3], args[3], _I8X8)
        f = builder.sitofp(builder.load(pq, align=1), _V8)
        s = splat(builder, _scalar(context, builder, sig, args, 4), _V8)
        pw = vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _V8)
        builder.store(builder.fmul(f, s), pw, align=4)
        return context.get_dummy_value()
    return types.none(w, wi, q, qi, scale), codegen


@intrinsic
def vbits(typingctx, w, wi, lo, li, ls, hi, hj, hs, mask, scale, bias):  # type: ignore[no-untyped-def]
    """w[wi:+8] = scale * q + bias, q = ((lo[li:+8] >> ls) & 15) | ((hi[hj:+8] >> hs) & mask)
    << 4 (lo, hi uint8): a nibble and its high bits from bytes of their own, Q5_K's (mask 1)
    and Q6_K's (mask 3, bias -32 scale: one rounding of scale (q - 32), as its product)."""
    if not (_f32(w) and _bytes(lo, types.uint8) and _bytes(hi, types.uint8)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        def lanes(i):  # type: ignore[no-untyped-def]
            return splat(builder, context.cast(builder, args[i], sig.args[i], types.int32),
                         _I32X8)

        def load(i):  # type: ignore[no-untyped-def]
            p = vector_ptr(context, builder, sig.args[i], args[i], sig.args[i + 1],
                           args[i + 1], _I8X8)
            return builder.zext(builder.load(p, align=1), _I32X8)
        low = builder.and_(builder.lshr(load(2), lanes(4)), ir.Constant(_I32X8, [15] * 8))
        high = builder.and_(builder.lshr(load(5), lanes(7)), lanes(8))
        q = builder.or_(low, builder.shl(high, ir.Constant(_I32X8, [4] * 8)))
        s = splat(builder, _scalar(context, builder, sig, args, 9), _V8)
        b = splat(builder, _scalar(context, builder, sig, args, 10), _V8)
        pw = vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _V8)
        builder.store(fmuladd(builder, builder.sitofp(q, _V8), s, b), pw, align=4)
        return context.get_dummy_value()
    return types.none(w, wi, lo, li, ls, hi, hj, hs, mask, scale, bias), codegen
