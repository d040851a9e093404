"""Primitives shared by the quantized matmul kernels (`qmatmul_*.py`).

numba exposes no stack arrays, prefetch or half-precision floats, so LLVM intrinsics supply
them (`stack_f32`, `prefetch` and the F16C probe `HARDWARE_HALF` live in `intrinsics.py`,
shared with attention, and are re-exported here for the kernels):

- `stack_f32(n)`: a float32 scratch array of literal size `n` allocated on the stack. The
  GEMV kernels keep one 8-lane partial sum per weight row in it; with constant indices LLVM
  promotes it to vector registers (a heap array would be re-read and re-written per block,
  and a scalar per-block sum costs a horizontal add per block: measured 25 % slower).
- `prefetch(a, i)`: software prefetch of element `i` of a C-contiguous array into L2. A row
  group of a short-row matrix (K = 576: 576 bytes per Q8_0 row) ends before the hardware
  prefetcher has locked on; prefetching the rows `dist` ahead took Q8_0 49152x576 from 0.18
  to 0.08 ns/weight on one core (the in-cache rate), and into L2 rather than L1 from 1.7 to
  0.95 ms at two threads (the bandwidth).
- `half_to_float(bits)`: float16 bits -> float32 with the CPU's conversion instruction (F16C
  on x86, native on aarch64), else with integer arithmetic (`half_to_float_soft`).

Block scales (one float16 per 32 or 256 weights) are converted through `HALF_LUT`, a
65,536-entry float32 table passed to the kernels as an argument: a load per block measured
faster than the conversion instruction (Q8_0: 0.062 vs 0.078 ns/weight).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from vllm_actors.kernels.cpu.intrinsics import HARDWARE_HALF, bits_to_f32, prefetch, stack_f32
from vllm_actors.kernels.cpu.jit import kernel

__all__ = ["HALF_LUT", "bf16_to_float", "block_sums", "half_to_float", "kept",
           "limit_threads", "restore_threads",
           "prefetch", "prefetch_span", "shl32", "shr32", "stack_f32"]

HALF_LUT = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
HALF_LUT.setflags(write=False)


T = TypeVar("T")


def kept(key: Hashable, make: Callable[[], T]) -> T:
    """This Python thread's scratch for `key` (made by `make` at the first call), reused by
    every later call: a decode step's GEMVs spent more on allocating their scratch than
    some spend computing. Each kernel call rewrites what it reads."""
    cache = getattr(_KEPT, "cache", None)
    if cache is None:
        cache = _KEPT.cache = {}
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
    return value


_KEPT = threading.local()

# Rows of x summed in runs of this many weights (`block_sums`): the offset and min terms of
# the quantized types become one multiply per (sub-)block.
SUM_RUN = 16
LANES = 8          # partial sums per weight row in the GEMV kernels (one AVX2 vector)


@kernel
def half_to_float_soft(bits: int) -> float:
    """float16 bits -> float32 with integer arithmetic: exact for every input (subnormals,
    infinities, NaN payloads) and never touching a float32 denormal."""
    h = np.uint32(bits) & np.uint32(0xFFFF)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    mag = h & np.uint32(0x7FFF)
    if mag >= np.uint32(0x7C00):     # inf / nan: float32 exponent all ones, payload kept
        return bits_to_f32(sign | np.uint32(0x7F800000) | ((mag & np.uint32(0x3FF)) << 13))
    if mag >= np.uint32(0x0400):     # normal: rebias the exponent by 127 - 15
        return bits_to_f32(sign | ((mag << np.uint32(13)) + np.uint32(0x38000000)))
    value = np.float32(mag) * np.float32(2.0 ** -24)     # zero / subnormal: m * 2^-24
    return -value if sign else value


@intrinsic
def half_to_float(typingctx, bits):  # type: ignore[no-untyped-def]
    """float16 bits in the low 16 bits of an integer -> float32."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if not HARDWARE_HALF:
            return context.compile_internal(
                builder, half_to_float_soft.py_func, signature, args)
        value = args[0]
        if bits.bitwidth > 16:
            value = builder.trunc(value, ir.IntType(16))
        elif bits.bitwidth < 16:
            value = builder.zext(value, ir.IntType(16))
        return builder.fpext(builder.bitcast(value, ir.HalfType()), ir.FloatType())
    return sig, codegen


@intrinsic
def bf16_to_float(typingctx, bits):  # type: ignore[no-untyped-def]
    """bfloat16 bits in the low 16 bits of an integer -> float32 (exact: a shift)."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i32 = ir.IntType(32)
        value = args[0]
        if bits.bitwidth > 16:
            value = builder.trunc(value, ir.IntType(16))
        value = builder.shl(builder.zext(value, i32), ir.Constant(i32, 16))
        return builder.bitcast(value, ir.FloatType())
    return sig, codegen


def _to_i32(builder, value, ty):  # type: ignore[no-untyped-def]
    i32 = ir.IntType(32)
    if ty.bitwidth > 32:
        return builder.trunc(value, i32)
    if ty.bitwidth < 32:
        return (builder.sext if ty.signed else builder.zext)(value, i32)
    return value


@intrinsic
def shr32(typingctx, value, amount):  # type: ignore[no-untyped-def]
    """`value >> amount` as a 32-bit logical shift (amount < 32), typed int32. numba widens
    every integer operation to 64 bits; LLVM narrows constant shifts back but not variable
    ones, which then run on 64-bit lanes (Q5_0: 2.4x slower)."""
    if not isinstance(value, types.Integer) or not isinstance(amount, types.Integer):
        return None
    sig = types.int32(value, amount)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.lshr(_to_i32(builder, args[0], value), _to_i32(builder, args[1], amount))
    return sig, codegen


@intrinsic
def shl32(typingctx, value, amount):  # type: ignore[no-untyped-def]
    """`value << amount` in 32 bits (amount < 32), typed int32 (see `shr32`)."""
    if not isinstance(value, types.Integer) or not isinstance(amount, types.Integer):
        return None
    sig = types.int32(value, amount)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.shl(_to_i32(builder, args[0], value), _to_i32(builder, args[1], amount))
    return sig, codegen


# numba's threading layer registers its C functions with LLVM when its threads start.
numba.get_num_threads()


@intrinsic
def limit_threads(typingctx, count):  # type: ignore[no-untyped-def]
    """Lower numba's thread count for the parallel loops this thread starts next to `count`
    (when 0 < count < current); returns the count it replaced, for `restore_threads`. Small
    GEMVs run on one thread: waking numba's threads costs ~14 us here, and the Python-level
    `numba.set_num_threads` pair 5 us. Calls the threading layer by symbol name, as numba's own
    parallel loops do, so kernels stay cacheable (`numba.set_num_threads` in jitted code makes
    them uncacheable)."""
    if not isinstance(count, types.Integer):
        return None
    sig = types.intp(count)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        intp = context.get_value_type(types.intp)
        i32 = ir.IntType(32)
        get = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(intp, []), "get_num_threads")
        put = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i32]), "set_num_threads")
        previous = builder.call(get, [])
        wanted = context.cast(builder, args[0], count, types.intp)
        lower = builder.and_(builder.icmp_signed(">", wanted, ir.Constant(intp, 0)),
                             builder.icmp_signed("<", wanted, previous))
        with builder.if_then(lower):
            builder.call(put, [builder.trunc(wanted, i32)])
        return previous
    return sig, codegen


@intrinsic
def restore_threads(typingctx, count):  # type: ignore[no-untyped-def]
    """Set numba's thread count for this thread back to `count` (from `limit_threads`)."""
    if not isinstance(count, types.Integer):
        return None
    sig = types.none(count)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i32 = ir.IntType(32)
        put = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i32]), "set_num_threads")
        builder.call(put, [context.cast(builder, args[0], count, types.int32)])
        return context.get_dummy_value()
    return sig, codegen


@kernel
def block_sums(x: np.ndarray, out: np.ndarray) -> None:
    """out[m, s] = sum of x[m, SUM_RUN*s : SUM_RUN*(s+1)] (float32 [M, K // SUM_RUN])."""
    run = x.shape[1] // max(1, out.shape[1])   # SUM_RUN, opaque to LLVM: a vectorized sum
    for m in range(x.shape[0]):                 # (a constant got unrolled and gathered)
        for s in range(out.shape[1]):
            acc = np.float32(0)
            for j in range(run):
                acc += x[m, run * s + j]
            out[m, s] = acc


@kernel(inline=True)
def prefetch_span(plane, lo, hi, step):  # type: ignore[no-untyped-def]
    """Hint plane.flat[lo:hi] into L2, one element in `step` (a 64-byte line's worth)."""
    for i in range(lo, hi, step):
        prefetch(plane, i)


@kernel(inline=True)
def line_aligned(n, dtype):  # type: ignore[no-untyped-def]
    """An uninitialized array of n elements of `dtype` starting on a cache line: a kernel's
    scratch that it reads as 64-byte vectors (numba's own arrays start 32 bytes into a line
    as often as not, and each such load then touches two lines)."""
    buf = np.empty(n + 64, dtype)
    skip = ((-buf.ctypes.data) % 64) // buf.itemsize
    return buf[skip:skip + n]


def byte_view(a: np.ndarray) -> np.ndarray:
    """a as uint8 where it is int8 (a view): for the parallel kernels that only pass a plane
    on as a pointer to a body compiled for its real type, so that one compile of such a
    kernel serves int8 planes (Q8_0's and IQ4_NL's codes, Q6_K's scales) and uint8 ones
    alike (docs/BENCHMARKS.md, "Cold start: fewer compiles of the same code")."""
    return a.view(np.uint8) if a.dtype == np.int8 else a


def byte_codes(planes: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """The planes with the codes (the first) as `byte_view` gives them."""
    return (byte_view(planes[0]), *planes[1:])
