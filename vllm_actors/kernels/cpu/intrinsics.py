"""LLVM-level helpers numba does not offer on the CPU, as numba intrinsics (inlined into the
kernels that call them): bit casts, the hardware float16 -> float32 conversion, an atomic
counter for dynamic work distribution, a cache prefetch, small stack arrays, and the
in-register transpose of 16 rows. Shared by attention and the quantized matmuls
(`qmatmul_prims` adds the matmuls' own).

`HARDWARE_HALF`: whether the CPU numba compiles for converts float16 in hardware (x86 F16C,
present on every AVX2 CPU; aarch64 always). Without it LLVM would emit a call to a runtime
helper the JIT does not provide, so kernels fall back to the bit conversion of
`attention_math`. numba keys its on-disk cache by CPU name and features, so code compiled one
way is never loaded on a CPU that needs the other.
"""

from __future__ import annotations

import platform

import numba
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic
from numba.np.arrayobj import make_array, populate_array


def _hardware_half() -> bool:
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64"):
        return False
    features = numba.config.CPU_FEATURES
    if features is None:
        if numba.config.CPU_NAME not in (None, "host"):
            return False          # a named target CPU without a feature list: do not assume
        features = llvm.get_host_cpu_features().flatten()
    return "+f16c" in features.split(",")


HARDWARE_HALF = _hardware_half()


@intrinsic
def bits_to_f32(typingctx, x):
    """The float32 whose bits are the low 32 bits of the integer `x` (narrower integers are
    zero-extended)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        value = args[0]
        if x.bitwidth > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif x.bitwidth < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())
    return types.float32(x), codegen


@intrinsic
def f32_to_bits(typingctx, x):
    """The bits of the float32 `x` as uint32."""
    if isinstance(x, types.Float) and x.bitwidth == 32:
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(x), codegen
    return None


@intrinsic
def hardware_half_to_f32(typingctx, x):
    """float16 bits (uint16) -> float32 by LLVM's fpext (only where HARDWARE_HALF)."""
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(x), codegen
    return None


@intrinsic
def hardware_round_half(typingctx, x):
    """float32 x rounded to the nearest float16 (ties to even) and back, by LLVM's fptrunc
    and fpext (only where HARDWARE_HALF; a loop of them vectorizes)."""
    if isinstance(x, types.Float):
        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.fpext(builder.fptrunc(value, ir.HalfType()), ir.FloatType())
        return types.float32(x), codegen
    return None


@intrinsic
def hardware_half_bits(typingctx, x):
    """float32 x -> the bits (uint16) of the nearest float16 (ties to even), by LLVM's
    fptrunc (only where HARDWARE_HALF): F16C's one instruction where `activations._f16_bits`
    takes a dozen branches. NaNs keep their payload's top bits, as F16C's do."""
    if isinstance(x, types.Float) and x.bitwidth == 32:
        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.uint16(x), codegen
    return None


@intrinsic
def fetch_add(typingctx, counter, value):
    """Atomically add `value` to counter[0] (an int64 array) and return the old value."""
    if isinstance(counter, types.Array) and counter.dtype == types.int64 and \
            isinstance(value, types.Integer):
        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary,
                                           [context.get_constant(types.intp, 0)])
            val = context.cast(builder, args[1], sig.args[1], types.int64)
            return builder.atomic_rmw("add", ptr, val, "monotonic")
        return types.int64(counter, value), codegen
    return None


def prefetch_line(builder, ptr):  # type: ignore[no-untyped-def]
    """Emit a hint of the line at `ptr` into L2 (`prefetcht1`; `prefetch` says why L2)."""
    i32 = ir.IntType(32)
    byte_ptr = ir.IntType(8).as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32])
    # (read, locality 2 = L2 and outer levels, data); the name is mangled for the pointer
    # type: llvm.prefetch.p0 (opaque pointers) or .p0i8 (older LLVM)
    fn = builder.module.declare_intrinsic("llvm.prefetch", [byte_ptr], fnty)
    builder.call(fn, [builder.bitcast(ptr, byte_ptr), i32(0), i32(2), i32(1)])


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the cache line holding element `index` (a flat index) of the C-contiguous `arr`
    into L2 (`prefetcht1`). Into L1 (`prefetcht0`) every streamed line also held one of
    L1's few miss buffers: a SmolLM2 decode's weights streamed at half the bandwidth
    (docs/BENCHMARKS.md, "Decode overheads, prefetching into L2, ...")."""
    if isinstance(arr, types.Array) and isinstance(index, types.Integer):
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            idx = context.cast(builder, args[1], sig.args[1], types.intp)
            prefetch_line(builder, builder.gep(ary.data, [idx]))
            return context.get_dummy_value()
        return types.none(arr, index), codegen
    return None


@intrinsic
def data_pointer(typingctx, arr):
    """The data pointer of the C-contiguous `arr`, for passing it to a C callback
    (`call_address`). Arrays of any other layout are refused when the kernel is typed."""
    if isinstance(arr, types.Array) and arr.layout == "C":
        def codegen(context, builder, sig, args):
            return context.make_array(sig.args[0])(context, builder, args[0]).data
        return types.CPointer(arr.dtype)(arr), codegen
    return None


@intrinsic
def realign_stack(typingctx):
    """Make the calling function realign its stack to a cache line on entry (LLVM's
    `stackrealign`), so that its 64-byte vector spills are aligned whatever its caller's
    stack: without it their alignment, and a kernel's speed, followed the caller's
    (docs/BENCHMARKS.md, "Cache lines for the kernels' vectors")."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        set.add(builder.function.attributes, '"stackrealign"')   # a string attribute to LLVM
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def call_address(typingctx, address, args):
    """Call the C function at `address` (an integer: a `jit.Callback`'s) with the tuple
    `args`, returning nothing. An integer argument keeps the kernel's dispatch on its fast
    path and its on-disk cache free of the address."""
    if isinstance(address, types.Integer) and isinstance(args, types.BaseTuple):
        def codegen(context, builder, sig, llargs):
            argtys = list(sig.args[1])
            fnty = ir.FunctionType(ir.VoidType(), [context.get_value_type(t) for t in argtys])
            fn = builder.inttoptr(llargs[0], fnty.as_pointer())
            builder.call(fn, [builder.extract_value(llargs[1], i) for i in range(len(argtys))])
            return context.get_dummy_value()
        return types.none(address, args), codegen
    return None


def _stack_codegen(dtype, irtype, n):  # type: ignore[no-untyped-def]
    """The typing result of a stack array of `n` (a literal) elements of `dtype`."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value
    arrty = types.Array(dtype, 1, "C")

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        ptr = cgutils.alloca_once(builder, irtype, size=size)
        ary = make_array(arrty)(context, builder)
        itemsize = context.get_constant(types.intp, dtype.bitwidth // 8)
        populate_array(ary, data=ptr, shape=[context.get_constant(types.intp, size)],
                       strides=[itemsize], itemsize=itemsize, meminfo=None)
        return ary._getvalue()
    return arrty(n), codegen


@intrinsic
def stack_f32(typingctx, n):  # type: ignore[no-untyped-def]
    """A float32 array of `n` (a literal) elements on the calling function's stack.

    For a micro-kernel's accumulators: indexed with constants only (after unrolling), LLVM
    keeps them in vector registers, which numba arrays on the heap never are (LLVM cannot
    prove that those do not alias the arrays the kernel reads). The array must not outlive
    the function that made it (never return or store it)."""
    return _stack_codegen(types.float32, ir.FloatType(), n)


@intrinsic
def stack_i32(typingctx, n):  # type: ignore[no-untyped-def]
    """`stack_f32` for int32 (the integer kernels' exact accumulators)."""
    return _stack_codegen(types.int32, ir.IntType(32), n)


@intrinsic
def stack_i64(typingctx, n):  # type: ignore[no-untyped-def]
    """`stack_f32` for int64 (offsets a kernel hands an intrinsic)."""
    return _stack_codegen(types.int64, ir.IntType(64), n)


@intrinsic
def stack_f64(typingctx, n):  # type: ignore[no-untyped-def]
    """`stack_f32` for float64 (ggml's float64 sums)."""
    return _stack_codegen(types.float64, ir.DoubleType(), n)


@intrinsic
def fma_f32(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """a * b + c in float32 with one rounding (`llvm.fma.f32`): what a C compiler's
    contraction (-ffp-contract=fast, GCC's default) makes of ggml's `s += a * b`."""
    if not all(isinstance(t, types.Float) for t in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
        f32 = ir.FloatType()
        fn = builder.module.globals.get("llvm.fma.f32") or ir.Function(
            builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        return builder.call(fn, vals)
    return types.float32(a, b, c), codegen


_F16X = ir.VectorType(ir.FloatType(), 16)


def _vec16(context, builder, aryty, ary, idxty, idx):  # type: ignore[no-untyped-def]
    a = context.make_array(aryty)(context, builder, ary)
    i = context.cast(builder, idx, idxty, types.intp)
    return builder.bitcast(builder.gep(a.data, [i]), _F16X.as_pointer())


def _is_f32_or_half(ty) -> bool:  # type: ignore[no-untyped-def]
    """A float32 array, or one of float16 bits (uint16) where the CPU converts them."""
    return isinstance(ty, types.Array) and (ty.dtype == types.float32 or (
        HARDWARE_HALF and ty.dtype == types.uint16))


def _load16(context, builder, aryty, ary, idxty, idx):  # type: ignore[no-untyped-def]
    """16 lanes from a float32 array, or from one of float16 bits, widened exactly."""
    if aryty.dtype == types.float32:
        return builder.load(_vec16(context, builder, aryty, ary, idxty, idx), align=4)
    a = context.make_array(aryty)(context, builder, ary)
    i = context.cast(builder, idx, idxty, types.intp)
    ptr = builder.bitcast(builder.gep(a.data, [i]), ir.VectorType(ir.IntType(16), 16)
                          .as_pointer())
    half = builder.bitcast(builder.load(ptr, align=2), ir.VectorType(ir.HalfType(), 16))
    return builder.fpext(half, _F16X)


def _splat16(context, builder, value, ty):  # type: ignore[no-untyped-def]
    value = context.cast(builder, value, ty, types.float32)
    y = builder.insert_element(ir.Constant(_F16X, ir.Undefined), value, ir.IntType(32)(0))
    return builder.shuffle_vector(y, ir.Constant(_F16X, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))


def _fma16(builder, a, b, c):  # type: ignore[no-untyped-def]
    fn = builder.module.globals.get("llvm.fma.v16f32") or ir.Function(
        builder.module, ir.FunctionType(_F16X, [_F16X] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


@intrinsic
def fma16(typingctx, acc, ai, a, xi, b, bi):  # type: ignore[no-untyped-def]
    """acc[ai:ai+16] = fma(a[xi:xi+16], b, acc[ai:ai+16]) lane by lane, one rounding each
    (16 independent chains, as ggml's 16-lane loops); `b` a float32 array (b[bi:bi+16]) or
    a scalar (splat). acc and b float32, `a` float32 or float16 bits; flat indices."""
    scalar = isinstance(b, types.Float)
    if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and _is_f32_or_half(a)
            and (scalar or (isinstance(b, types.Array) and b.dtype == types.float32))):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        pa = _vec16(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        x = _load16(context, builder, sig.args[2], args[2], sig.args[3], args[3])
        if scalar:
            y = _splat16(context, builder, args[4], sig.args[4])
        else:
            y = builder.load(_vec16(context, builder, sig.args[4], args[4], sig.args[5],
                                    args[5]), align=4)
        builder.store(_fma16(builder, x, y, builder.load(pa, align=4)), pa, align=4)
        return context.get_dummy_value()
    return types.none(acc, ai, a, xi, b, bi), codegen


@intrinsic
def widen16(typingctx, out, oi, a, ai):  # type: ignore[no-untyped-def]
    """out[oi:oi+16] = a[ai:ai+16] as float32 (`a` float32, or float16 bits converted
    exactly): one vector load and store, where a loop of converts did not vectorize (the
    arrays' types do not tell LLVM they cannot overlap)."""
    if not (isinstance(out, types.Array) and out.dtype == types.float32 and _is_f32_or_half(a)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        x = _load16(context, builder, sig.args[2], args[2], sig.args[3], args[3])
        builder.store(x, _vec16(context, builder, sig.args[0], args[0], sig.args[1], args[1]),
                      align=4)
        return context.get_dummy_value()
    return types.none(out, oi, a, ai), codegen


@intrinsic
def muladd16(typingctx, acc, ai, w, wi, x):  # type: ignore[no-untyped-def]
    """acc[ai:ai+16] += w[wi:wi+16] * x, the product rounded to float32 and then the sum
    (ggml's uncontracted `sumf += x[i]*y[i]`, 16 outputs side by side); acc float32, w
    float32 or float16 bits, x a scalar; flat indices."""
    if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and _is_f32_or_half(w)
            and isinstance(x, types.Float)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        pa = _vec16(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        product = builder.fmul(_load16(context, builder, sig.args[2], args[2], sig.args[3],
                                       args[3]), _splat16(context, builder, args[4], sig.args[4]))
        builder.store(builder.fadd(builder.load(pa, align=4), product), pa, align=4)
        return context.get_dummy_value()
    return types.none(acc, ai, w, wi, x), codegen


@intrinsic
def muladd16_f64(typingctx, acc, ai, w, wi, x):  # type: ignore[no-untyped-def]
    """`muladd16` with float64 sums: acc[ai:ai+16] (float64) += float64(w[wi:wi+16] * x), the
    product rounded to float32 first (`ggml_vec_dot_f16`'s leftovers)."""
    if not (isinstance(acc, types.Array) and acc.dtype == types.float64 and _is_f32_or_half(w)
            and isinstance(x, types.Float)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        f64x = ir.VectorType(ir.DoubleType(), 16)
        a = context.make_array(sig.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], sig.args[1], types.intp)
        pa = builder.bitcast(builder.gep(a.data, [i]), f64x.as_pointer())
        product = builder.fmul(_load16(context, builder, sig.args[2], args[2], sig.args[3],
                                       args[3]), _splat16(context, builder, args[4], sig.args[4]))
        builder.store(builder.fadd(builder.load(pa, align=8), builder.fpext(product, f64x)),
                      pa, align=8)
        return context.get_dummy_value()
    return types.none(acc, ai, w, wi, x), codegen


def _halves(builder, v, width):  # type: ignore[no-untyped-def]
    """(high, low) halves of the vector v, each `width` lanes."""
    i32 = ir.IntType(32)
    undef = ir.Constant(v.type, ir.Undefined)
    return tuple(builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(i32, width),
                                                              list(range(s, s + width))))
                 for s in (width, 0))


@intrinsic
def reduce64(typingctx, acc, ai):  # type: ignore[no-untyped-def]
    """`ggml_vec_dot_f16`'s end on its 64 float32 accumulators acc[ai:ai+64] (4 registers of
    16): (r0 + r2) + (r1 + r3), then `_mm512_reduce_add_ps` (halves, quarters, then pairs),
    as vector adds and shuffles in that order."""
    if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        base = _vec16(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        r = [builder.load(builder.gep(base, [ir.IntType(32)(k)]), align=4) for k in range(4)]
        v = builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))
        for width in (8, 4, 2):
            high, low = _halves(builder, v, width)
            v = builder.fadd(high, low)
        i32 = ir.IntType(32)
        return builder.fadd(builder.extract_element(v, i32(0)),
                            builder.extract_element(v, i32(1)))
    return types.float32(acc, ai), codegen


_I32X16, _I32X8 = ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.IntType(32), 8)


@intrinsic
def reduce16x16(typingctx, acc, ai, out, oi):  # type: ignore[no-untyped-def]
    """out[oi + k] = `_mm512_reduce_add_ps` of acc[ai + 16 k : ai + 16 k + 16] for k < 16
    (float32 arrays, flat indices): the 16 reductions at once, each level of the reduction
    (halves, quarters, pairs, then the last two) one vector add over two vectors' halves
    gathered by a shuffle, so sixteen dots end in 15 adds and 30 shuffles."""
    if not all(isinstance(t, types.Array) and t.dtype == types.float32 for t in (acc, out)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        base = _vec16(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        vs = [builder.load(builder.gep(base, [ir.IntType(32)(k)]), align=4) for k in range(16)]
        for width in (8, 4, 2, 1):      # lanes each vector's sums span, halved each level
            lows = [t for t in range(32) if (t // width) % 2 == 0]
            highs = [t for t in range(32) if (t // width) % 2 == 1]
            vs = [builder.fadd(builder.shuffle_vector(a, b, ir.Constant(_I32X16, highs)),
                               builder.shuffle_vector(a, b, ir.Constant(_I32X16, lows)))
                  for a, b in zip(vs[0::2], vs[1::2])]
        builder.store(vs[0], _vec16(context, builder, sig.args[2], args[2], sig.args[3],
                                    args[3]), align=4)
        return context.get_dummy_value()
    return types.none(acc, ai, out, oi), codegen


def transpose_rows(builder, rows):  # type: ignore[no-untyped-def]
    """16 vectors <8 x i32> (row r's words) -> 8 vectors <16 x i32> (word t of every row):
    rows paired into <8 x i64>, then an 8 x 8 transpose of those pairs in three butterfly
    stages of two-source shuffles."""
    i64x8 = ir.VectorType(ir.IntType(64), 8)
    zip_ = ir.Constant(_I32X16, [v for t in range(8) for v in (t, 8 + t)])
    vs = [builder.bitcast(builder.shuffle_vector(rows[2 * i], rows[2 * i + 1], zip_), i64x8)
          for i in range(8)]
    for d in (1, 2, 4):
        low = ir.Constant(_I32X8, [t if t & d == 0 else 8 + t - d for t in range(8)])
        high = ir.Constant(_I32X8, [t + d if t & d == 0 else 8 + t for t in range(8)])
        for i in range(8):
            if i & d == 0:
                a, b = vs[i], vs[i + d]
                vs[i] = builder.shuffle_vector(a, b, low)
                vs[i + d] = builder.shuffle_vector(a, b, high)
    return [builder.bitcast(v, _I32X16) for v in vs]


@intrinsic
def square_sums16(typingctx, acc, ai, x, xi, stride):  # type: ignore[no-untyped-def]
    """acc[ai + r] += float64(x[xi + r stride + t] ** 2) for t = 0 .. 7 in turn, for the 16
    rows r (acc float64, x float32, flat indices): each row's sum in the order ggml's
    RMSNorm adds, the 16 rows as vector lanes (8 values of each row loaded, squared in
    float32, transposed by `transpose_rows`), two chains of 8 rows."""
    if not (isinstance(acc, types.Array) and acc.dtype == types.float64
            and isinstance(x, types.Array) and x.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        f32x8, f64x8 = ir.VectorType(ir.FloatType(), 8), ir.VectorType(ir.DoubleType(), 8)
        xa = context.make_array(sig.args[2])(context, builder, args[2])
        base = context.cast(builder, args[3], sig.args[3], types.intp)
        step = context.cast(builder, args[4], sig.args[4], types.intp)
        rows = []
        for r in range(16):
            at = builder.add(base, builder.mul(step, ir.IntType(64)(r)))
            v = builder.load(builder.bitcast(builder.gep(xa.data, [at]), f32x8.as_pointer()),
                             align=4)
            rows.append(builder.bitcast(builder.fmul(v, v), _I32X8))
        aa = context.make_array(sig.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = builder.bitcast(builder.gep(aa.data, [i]), f64x8.as_pointer())
        halves = [builder.load(builder.gep(ptr, [ir.IntType(32)(h)]), align=8) for h in (0, 1)]
        for col in transpose_rows(builder, rows):           # value t of the 16 rows
            sq = builder.bitcast(col, _F16X)
            for h in (0, 1):
                pick = ir.Constant(_I32X8, list(range(8 * h, 8 * h + 8)))
                halves[h] = builder.fadd(halves[h],
                                         builder.fpext(builder.shuffle_vector(sq, sq, pick), f64x8))
        for h in (0, 1):
            builder.store(halves[h], builder.gep(ptr, [ir.IntType(32)(h)]), align=8)
        return context.get_dummy_value()
    return types.none(acc, ai, x, xi, stride), codegen


@intrinsic
def key_tile(typingctx, kflat, koff, j0, d0, dst, stride):  # type: ignore[no-untyped-def]
    """dst[stride (d0 + t) + l] = kflat[koff[j0 + l] + d0 + t] as float32, for l, t < 16: 16
    keys' float16 values (key l's row at koff[j0 + l]) converted 16 at a time and transposed
    (`transpose_rows` on each half): dimension d0 + t of the 16 keys in one vector."""
    if not (isinstance(kflat, types.Array) and kflat.dtype == types.uint16
            and isinstance(koff, types.Array) and koff.dtype == types.int64
            and isinstance(dst, types.Array) and dst.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        j, d = (context.cast(builder, args[i], sig.args[i], types.intp) for i in (2, 3))
        offs = context.make_array(sig.args[1])(context, builder, args[1])
        rows = []
        for lane in range(16):
            at = builder.load(builder.gep(offs.data, [builder.add(j, ir.IntType(64)(lane))]))
            v = _load16(context, builder, sig.args[0], args[0], types.intp, builder.add(at, d))
            rows.append(builder.bitcast(v, _I32X16))
        cols = []
        for half in range(2):
            pick = ir.Constant(_I32X8, list(range(8 * half, 8 * half + 8)))
            cols += transpose_rows(builder, [builder.shuffle_vector(r, r, pick) for r in rows])
        step = context.cast(builder, args[5], sig.args[5], types.intp)
        base = builder.mul(d, step)
        for t, col in enumerate(cols):
            out = _vec16(context, builder, sig.args[4], args[4], types.intp,
                         builder.add(base, builder.mul(step, ir.IntType(64)(t))))
            builder.store(builder.bitcast(col, _F16X), out, align=4)
        return context.get_dummy_value()
    return types.none(kflat, koff, j0, d0, dst, stride), codegen
