"""Scalar helpers the attention kernels inline: float16 <-> float32 on raw bits, exp2 and tanh.

numba has no float16 type on the CPU, so a float16 KV cache is stored as uint16 bits. The
conversions here are branch-free (selects only), so loops over a row vectorize; they match
numpy's `astype` bit for bit (round to nearest even, subnormals, overflow to inf; a NaN keeps
its sign and the top bits of its payload, as numpy's portable conversion does). Reading the
cache (`read_half`) uses the CPU's own conversion where it has one (F16C: 5x faster than the
bit conversion, itself 2x faster than a 65,536-entry table); that agrees with numpy on every
value except signaling NaNs, which it quiets. Writing it (`write_half`) does too, NaNs
written as numpy writes them.

The cache-dtype dispatch (`from_f32`, `stage_rows`, `row_source`) is done with numba
overloads, resolved when a kernel compiles, so each kernel is written once and compiled per
cache dtype: a float32 cache is read in place, a float16 one through a small float32 tile.
Kernels take caches flattened to 1-D and address rows by offset: slicing a row out of an array
inside a loop costs numba a reference-count update (an atomic, in a call) per slice.
"""

from __future__ import annotations

import numpy as np
from numba.core import types
from numba.extending import overload

from vllm_actors.kernels.cpu.intrinsics import (
    HARDWARE_HALF,
    bits_to_f32,
    f32_to_bits,
    hardware_half_bits,
    hardware_half_to_f32,
)
from vllm_actors.kernels.cpu.jit import JIT_OPTIONS, kernel

_TWO_M14 = np.float32(2.0 ** -14)
_U = np.uint32


@kernel
def half_to_f32(h):
    """float16 bits (any unsigned integer holding them) -> float32."""
    u = _U(h) & _U(0xFFFF)
    sign = _U((u & _U(0x8000)) << _U(16))
    body = _U((u & _U(0x7FFF)) << _U(13))                     # exponent and mantissa, moved
    exp = _U(body & _U(0x0F800000))
    normal = _U(body + _U(112 << 23))                           # rebias 15 -> 127
    special = _U(normal + _U(112 << 23))                        # inf / nan: exponent 255
    # subnormal: 2^-14 * (1 + m/1024) - 2^-14 = m * 2^-24, exact
    sub = f32_to_bits(bits_to_f32(_U(body + _U(113 << 23))) - _TWO_M14)
    bits = normal
    bits = special if exp == _U(0x0F800000) else bits
    bits = sub if exp == _U(0) else bits
    return bits_to_f32(_U(bits | sign))


@kernel
def f32_to_half(x):
    """float32 -> float16 bits (uint16), rounding to nearest even."""
    b = f32_to_bits(np.float32(x))
    sign = _U((b >> _U(16)) & _U(0x8000))
    a = _U(b & _U(0x7FFFFFFF))
    # normal range: drop 13 mantissa bits, round to nearest even; a carry may reach inf
    n = _U(_U(a - _U(112 << 23)) >> _U(13))
    rem = _U(a & _U(0x1FFF))
    up = (rem > _U(0x1000)) | ((rem == _U(0x1000)) & ((n & _U(1)) == _U(1)))
    normal = _U(n + _U(up))
    # subnormal range (|x| < 2^-14): the value in units of 2^-24, rounded to nearest even
    e = np.int32(a >> _U(23))
    shift = min(max(np.int32(126) - e, np.int32(1)), np.int32(31))   # 14..24 where used
    mant = _U((a & _U(0x7FFFFF)) | _U(0x800000))
    q = _U(mant >> _U(shift))
    r = _U(mant - _U(q << _U(shift)))
    half = _U(_U(1) << _U(shift - 1))
    sub_up = (r > half) | ((r == half) & ((q & _U(1)) == _U(1)))
    sub = _U(q + _U(sub_up))
    sub = sub if e >= np.int32(102) else _U(0)                   # below 2^-25: zero
    out = normal
    out = sub if a < _U(0x38800000) else out
    out = _U(0x7C00) if a >= _U(0x47800000) else out              # overflow -> inf
    nan = _U(_U(0x7C00) | _U((a & _U(0x7FFFFF)) >> _U(13)))   # numpy's: keep the payload's
    nan = _U(0x7C01) if nan == _U(0x7C00) else nan                # top bits, stay a NaN
    out = nan if a > _U(0x7F800000) else out
    return np.uint16(out | sign)


def from_f32(x, like):
    """float32 x as the element type of `like` (kernels only)."""
    raise NotImplementedError


def stage_rows(cache, table, shift, hk, kvh, t0, n, buf, offs):
    """Make rows t0..t0+n-1 of head kvh readable at offs[i] in `row_source(cache, buf)`
    (kernels only)."""
    raise NotImplementedError


def row_source(cache, buf):
    """The float32 array `stage_rows` offsets point into (kernels only)."""
    raise NotImplementedError


def _is_half(ty) -> bool:
    dtype = getattr(ty, "dtype", ty)
    return isinstance(dtype, types.Integer) and dtype.bitwidth == 16 and not dtype.signed


if HARDWARE_HALF:
    @kernel
    def read_half(h):
        """float16 bits -> float32 as kernels read the cache: in hardware."""
        return hardware_half_to_f32(h)

    @kernel(inline=True)
    def write_half(x):
        """float32 -> float16 bits as kernels write the cache: F16C's rounding (a KV write
        loop vectorizes; the bit conversion took 0.9 ns a value), NaNs as `f32_to_half`
        writes them (F16C quiets a signaling one)."""
        b = f32_to_bits(np.float32(x))
        a = _U(b & _U(0x7FFFFFFF))
        nan = _U(_U(0x7C00) | _U((a & _U(0x7FFFFF)) >> _U(13)))   # the payload's top bits
        nan = _U(_U(0x7C01) if nan == _U(0x7C00) else nan) | _U((b >> _U(16)) & _U(0x8000))
        return np.uint16(nan) if a > _U(0x7F800000) else hardware_half_bits(np.float32(x))
else:
    read_half = half_to_f32
    write_half = f32_to_half


@overload(from_f32, jit_options=JIT_OPTIONS)
def _from_f32(x, like):
    if _is_half(like):
        return lambda x, like: write_half(x)
    if isinstance(like, types.Float):
        return lambda x, like: np.float32(x)
    return None


@kernel
def row_offsets(table, shift, hk, dh, kvh, t0, n, offs):
    """offs[i] = flat offset of row t0 + i, head kvh, in a [blocks, 2^shift, hk, dh] cache."""
    mask = (1 << shift) - 1
    for i in range(n):
        t = t0 + i
        offs[i] = np.uint64((((table[t >> shift] << shift) + (t & mask)) * hk + kvh) * dh)


@kernel
def convert_rows(cache, table, shift, hk, kvh, t0, n, buf, offs):
    """buf[i * dh:(i + 1) * dh] = float32 of row t0 + i (head kvh) of the flat float16 cache;
    offs[i] = i * dh."""
    dh = buf.shape[0] // offs.shape[0]
    row_offsets(table, shift, hk, dh, kvh, t0, n, offs)
    for i in range(n):
        src = offs[i]
        dst = np.uint64(i * dh)
        for d in range(dh):
            e = np.uint64(d)
            buf[dst + e] = read_half(cache[src + e])
        offs[i] = dst


@overload(stage_rows, jit_options=JIT_OPTIONS)
def _stage_rows(cache, table, shift, hk, kvh, t0, n, buf, offs):
    """float16 cache: convert the tile's rows into buf; float32: only the row offsets (the
    rows are read in place). A quantized cache (a tuple) is `attention_kv`'s overload."""
    if isinstance(cache, types.BaseTuple):
        return None          # a quantized cache: attention_kv's overload
    if _is_half(cache):
        return lambda cache, table, shift, hk, kvh, t0, n, buf, offs: convert_rows(
            cache, table, shift, hk, kvh, t0, n, buf, offs)
    return lambda cache, table, shift, hk, kvh, t0, n, buf, offs: row_offsets(
        table, shift, hk, buf.shape[0] // offs.shape[0], kvh, t0, n, offs)


@overload(row_source, jit_options=JIT_OPTIONS)
def _row_source(cache, buf):
    if _is_half(cache) or isinstance(cache, types.BaseTuple):   # a tuple: attention_kv
        return lambda cache, buf: buf
    return lambda cache, buf: cache


# exp2(f) on [-1/2, 1/2]: Taylor coefficients of e^(f ln 2), degree 6 (relative error < 2e-7).
_LN2 = 0.6931471805599453
_C = [np.float32(_LN2 ** k / float(np.prod(np.arange(1, k + 1)))) for k in range(7)]
_C0, _C1, _C2, _C3, _C4, _C5, _C6 = _C


@kernel
def exp2(x):
    """2^x for float32 x <= 127, branch-free; 0 below -126 (so exp2(-inf) == 0)."""
    y = max(x, np.float32(-126.0))
    n = np.floor(y + np.float32(0.5))
    f = y - n
    p = _C6
    p = p * f + _C5
    p = p * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + _C0
    scale = bits_to_f32(_U(_U(np.int32(n) + np.int32(127)) << _U(23)))
    return p * scale if x >= np.float32(-126.0) else np.float32(0.0)


# tanh(a) / a on [0, TANH_SMALL] as a polynomial in a^2 (least squares, degree 5: relative
# error ~1e-7, float32 rounding); above it tanh(a) = 1 - 2 / (e^(2a) + 1) through exp2.
TANH_SMALL = np.float32(0.625)
_T = [np.float32(c) for c in (1.0, -0.33333277702331543, 0.13331417739391327,
                              -0.053739793598651886, 0.020642109215259552,
                              -0.005709814373403788)]
_T0, _T1, _T2, _T3, _T4, _T5 = _T
_TWO_LOG2E = np.float32(2.0 / _LN2)


@kernel
def tanh(x):
    """tanh of float32 x, branch-free (relative error ~3e-7; +-1 from |x| ~ 9 on)."""
    a = abs(x)
    t = a * a
    p = _T5
    p = p * t + _T4
    p = p * t + _T3
    p = p * t + _T2
    p = p * t + _T1
    p = p * t + _T0
    e = exp2(min(a * _TWO_LOG2E, np.float32(126.0)))
    big = np.float32(1.0) - np.float32(2.0) / (e + np.float32(1.0))
    y = a * p if a < TANH_SMALL else big
    return y if x >= np.float32(0.0) else -y


@kernel(inline=True)
def sink_scale(sinks, head, m, l):
    """1 / the softmax denominator with head `head`'s sink logit (base 2) as one more column
    of no value (gpt-oss), or 1 / l without sinks; the scale for the unnormalized acc."""
    if sinks.shape[0] == 0:
        return np.float32(1.0) / l
    top = max(m, sinks[head])
    correction = exp2(m - top)
    return correction / (l * correction + exp2(sinks[head] - top))
