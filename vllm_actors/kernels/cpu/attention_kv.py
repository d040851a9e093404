"""Quantized KV cache rows in the compiled attention: decode a tile's rows into the per-thread
float32 tile, and encode new rows (the formats: `kernels/kv_quant.py`, whose numpy code is the
reference these match).

The attention kernels take a quantized cache as a tuple `(data, lut, layout)`: the flat rows
(uint8, or uint16 for bfloat16), the decode table (fp8: value of each byte times the tensor
scale; turboquant: high-width then low-width codebook) and `KVFormat.layout`. numba compiles
the kernels once more for that tuple type (`attention_math.stage_rows` dispatches on it); the
format kind is a runtime branch per row, outside the loops over the head dim.
"""

from __future__ import annotations

import math

import numpy as np
from numba.core import types
from numba.extending import overload

from vllm_actors.kernels.cpu.attention_math import (
    JIT_OPTIONS,
    f32_to_half,
    read_half,
    row_offsets,
    stage_rows,
)
from vllm_actors.kernels.cpu.intrinsics import bits_to_f32, f32_to_bits, prefetch
from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.kv_quant import BFLOAT16, FP8

_U64 = np.uint64
_U32 = np.uint32


@kernel
def tq_decode_row(data, src, lut, layout, buf, dst, dh):
    """One turboquant row at data[src:] into buf[dst:dst + dh] (still rotated)."""
    n_high = layout[2]
    high = layout[3]
    low = layout[4]
    cb = _U64(layout[5])
    scale = read_half(np.uint16(_U32(data[src + cb])
                                | (_U32(data[src + cb + _U64(1)]) << _U32(8))))
    if high == 4:           # nibbles: byte j // 2, low nibble first
        for j in range(n_high):
            b = _U32(data[src + _U64(j >> 1)])
            code = (b >> _U32((j & 1) << 2)) & _U32(15)
            buf[dst + _U64(j)] = lut[code] * scale
    else:
        mask = _U32((1 << high) - 1)
        for j in range(n_high):
            bit = j * high
            at = src + _U64(bit >> 3)
            w = _U32(data[at]) | (_U32(data[at + _U64(1)]) << _U32(8))
            buf[dst + _U64(j)] = lut[(w >> _U32(bit & 7)) & mask] * scale
    base = 1 << high
    first = n_high * high
    mask = _U32((1 << low) - 1)
    for j in range(dh - n_high):
        bit = first + j * low
        at = src + _U64(bit >> 3)
        w = _U32(data[at]) | (_U32(data[at + _U64(1)]) << _U32(8))
        buf[dst + _U64(n_high + j)] = lut[base + ((w >> _U32(bit & 7)) & mask)] * scale


_TWO_8 = np.float32(256.0)


@kernel(inline=True)
def e4m3_to_f32(b):
    """fp8 e4m3fn bits (in a uint32) -> float32, as kv_quant.FP8_E4M3. Placed in a float16's
    sign, exponent and mantissa fields (s eeee mmm -> s 0eeee mmm0000000) the bits are the
    value times 2^-8, subnormals included, so the CPU's float16 conversion does the work (it
    vectorizes; the arithmetic way did not); 0x7F / 0xFF are NaN."""
    em = b & _U32(0x7F)
    bits = (em << _U32(7)) if em != _U32(0x7F) else _U32(0x7E00)     # NaN stays NaN
    return read_half(np.uint16(((b & _U32(0x80)) << _U32(8)) | bits)) * _TWO_8


@kernel
def decode_rows(cache, table, shift, hk, kvh, t0, n, buf, offs):
    """buf[i * dh:(i + 1) * dh] = float32 of row t0 + i (head kvh) of a quantized cache
    (see the module docstring); offs[i] = i * dh."""
    data = cache[0]
    lut = cache[1]
    layout = cache[2]
    kind = layout[0]
    dh = buf.shape[0] // offs.shape[0]
    row_offsets(table, shift, hk, layout[1], kvh, t0, n, offs)
    for i in range(n):
        src = offs[i]
        dst = _U64(i * dh)
        if kind == BFLOAT16:
            for d in range(dh):
                e = _U64(d)
                buf[dst + e] = bits_to_f32(_U32(data[src + e]) << _U32(16))
        elif kind == FP8 and layout[3] == 3:      # e4m3: through float16, in registers
            scale = lut[0x38]                     # the value of 1.0's code, times the scale
            for d in range(dh):
                e = _U64(d)
                buf[dst + e] = e4m3_to_f32(_U32(data[src + e])) * scale
        elif kind == FP8:                         # e5m2: the top byte of a float16
            scale = lut[0x3C]
            for d in range(dh):
                e = _U64(d)
                buf[dst + e] = read_half(np.uint16(_U32(data[src + e]) << _U32(8))) * scale
        else:
            tq_decode_row(data, src, lut, layout, buf, dst, dh)
        offs[i] = dst


@overload(stage_rows, jit_options=JIT_OPTIONS)
def _stage_quantized(cache, table, shift, hk, kvh, t0, n, buf, offs):
    if isinstance(cache, types.BaseTuple):
        return lambda cache, table, shift, hk, kvh, t0, n, buf, offs: decode_rows(
            cache, table, shift, hk, kvh, t0, n, buf, offs)
    return None


@kernel
def prefetch_quantized(cache, table, shift, hk, kvh0, kvh1, t0, n):
    """The cache lines of rows t0..t0+n-1, heads kvh0..kvh1-1 of a quantized cache."""
    data = cache[0]
    rl = cache[2][1]
    mask = (1 << shift) - 1
    step = max(1, 64 // data.itemsize)
    span = (kvh1 - kvh0) * rl
    for t in range(t0, t0 + n):
        base = (((table[t >> shift] << shift) + (t & mask)) * hk + kvh0) * rl
        for e in range(0, span, step):
            prefetch(data, base + e)


# -- writes -------------------------------------------------------------------------------
@kernel
def _bf16_bits(x):
    b = _U64(f32_to_bits(np.float32(x)))
    if x != x:
        return np.uint16((b >> _U64(16)) | _U64(0x40))
    return np.uint16((b + _U64(0x7FFF) + ((b >> _U64(16)) & _U64(1))) >> _U64(16))


@kernel
def _fp8_code(x, table):
    """Nearest code of x in the ascending non-negative values `table` (float64), ties to the
    even code, saturated; the sign in bit 7; NaN -> 0x7F (as kv_quant._fp8_encode)."""
    if x != x:
        return np.uint8(0x7F)
    finite = table.shape[0] - 1
    a = min(abs(np.float64(x)), table[finite])
    lo = 0
    hi = finite + 1              # first index with table[idx] >= a, by bisection
    while lo < hi:
        mid = (lo + hi) >> 1
        if table[mid] < a:
            lo = mid + 1
        else:
            hi = mid
    hi = min(max(lo, 1), finite)
    lo = hi - 1
    d_lo = a - table[lo]
    d_hi = table[hi] - a
    code = hi if (d_hi < d_lo) or (d_hi == d_lo and hi % 2 == 0) else lo
    if f32_to_bits(np.float32(x)) >> _U32(31):
        code |= 0x80
    return np.uint8(code)


@kernel
def encode_rows(x, slots, data, row_len, kind, inv_scale, table, mids_high, mids_low,
                books, layout):
    """x float32 [T, Hk, dh] (turboquant: already rotated) into the flat rows `data` at each
    token's slot (slot < 0: skipped). fp8: x * inv_scale coded against `table`; turboquant:
    `mids_*` (float32 midpoints of each codebook), `books` (float64 high then low codebook)."""
    hk = x.shape[1]
    dh = x.shape[2]
    for t in range(slots.shape[0]):
        if slots[t] < 0:
            continue
        for h in range(hk):
            base = (slots[t] * hk + h) * row_len
            if kind == BFLOAT16:
                for d in range(dh):
                    data[base + d] = _bf16_bits(x[t, h, d])
            elif kind == FP8:
                for d in range(dh):
                    data[base + d] = _fp8_code(np.float32(x[t, h, d] * inv_scale), table)
            else:
                _tq_encode_row(x, t, h, data, base, mids_high, mids_low, books, layout)


@kernel
def _tq_encode_row(x, t, h, data, base, mids_high, mids_low, books, layout):
    dh = x.shape[2]
    n_high = layout[2]
    high = layout[3]
    low = layout[4]
    cb = layout[5]
    norm = 0.0
    for d in range(dh):
        norm += np.float64(x[t, h, d]) * np.float64(x[t, h, d])
    factor = math.sqrt(dh) / max(math.sqrt(norm), 1e-30)
    for b in range(cb):
        data[base + b] = 0
    fit = 0.0
    energy = 0.0
    bit = 0
    for d in range(dh):
        v = np.float64(x[t, h, d]) * factor
        if d < n_high:
            mids, width, off = mids_high, high, 0
        else:
            mids, width, off = mids_low, low, 1 << high
        code = 0                       # searchsorted(mids, v), side left
        while code < mids.shape[0] and mids[code] < v:
            code += 1
        c = books[off + code]
        fit += np.float64(x[t, h, d]) * c
        energy += c * c
        for k in range(width):
            if (code >> k) & 1:
                at = base + ((bit + k) >> 3)
                data[at] = data[at] | np.uint8(1 << ((bit + k) & 7))
        bit += width
    scale = fit / energy if energy > 0 else 0.0
    half = f32_to_half(np.float32(scale))
    data[base + cb] = np.uint8(half & np.uint16(0xFF))
    data[base + cb + 1] = np.uint8(half >> np.uint16(8))
