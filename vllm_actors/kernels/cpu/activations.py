"""`--gguf-activations quantized` on the compiled backend: the activation formats of
`kernels.activation_quant` as numba kernels, bit for bit the numpy reference (and so
llama.cpp's x86 quantizers), and the min term Q4_1/Q5_1 add.

`simulate(x, fmt)` returns (x~, min_delta) as `activation_quant.simulate` does; the float
matmul kernels then multiply x~ (see that module for why this is the semantics, up to float
summation order). The quantizers are compiled without fast math: `arcp` would turn
amax / 127 into amax * (1 / 127), and they must round exactly as ggml does. Float16 rounding
is done on the bits (`_f16_bits`), so it needs no F16C.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba import carray, prange, types

from vllm_actors.kernels.cpu.intrinsics import (HARDWARE_HALF, bits_to_f32, call_address,
                                                data_pointer, f32_to_bits, hardware_round_half,
                                                stack_i32)
from vllm_actors.kernels.cpu.jit import callback
from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT

_EXACT = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False)


@numba.njit(inline="always", **_EXACT)
def _f16_bits(f):  # type: ignore[no-untyped-def]
    """float32 -> the bits of the nearest float16 (ties to even; overflow to inf)."""
    b = f32_to_bits(np.float32(f))
    sign = (b >> 16) & 0x8000
    e = np.int32((b >> 23) & 0xFF)
    m = b & 0x7FFFFF
    if e == 0xFF:
        return np.uint16(sign | 0x7C00 | (0x200 if m else 0))
    exp = e - 112                       # e - 127 + 15
    if exp >= 31:
        return np.uint16(sign | 0x7C00)
    if exp <= 0:
        if exp < -10:
            return np.uint16(sign)
        m = m | 0x800000
        shift = np.uint32(14 - exp)
        r = m >> shift
        rem = m & ((np.uint32(1) << shift) - 1)
        half = np.uint32(1) << (shift - 1)
        if rem > half or (rem == half and (r & 1)):
            r += 1
        return np.uint16(sign | r)
    r = (np.uint32(exp) << 10) | (m >> 13)
    rem = m & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (r & 1)):
        r += 1
    return np.uint16(sign | r)


# Inputs up to this many elements are quantized on the calling thread: waking numba's
# threads costs more than they save (a decode step quantizes hundreds of 576-wide rows).
SERIAL_MAX = 1 << 14
BLOCKS_PER_CALL = 64    # 32-value blocks per call of a quantizer's body in parallel


@numba.njit(inline="always", **_EXACT)
def _round_half(v, lut):  # type: ignore[no-untyped-def]
    """v rounded to float16 (ties to even) as float32: F16C's one conversion each way where
    the CPU has it, else the bits' rounding and the table."""
    if HARDWARE_HALF:
        return hardware_round_half(v)
    return lut[_f16_bits(v)]


@numba.njit(inline="always", **_EXACT)
def _magnitude(v):  # type: ignore[no-untyped-def]
    """|v|'s bits, which order as the magnitudes do (0 for NaN): integer max and min
    reductions over them vectorize where float ones, without fast math, do not."""
    m = np.int32(f32_to_bits(v) & np.uint32(0x7FFFFFFF))
    return m if m <= np.int32(0x7F800000) else np.int32(0)


@numba.njit(inline="always", **_EXACT)
def _max_magnitude(xr, n):  # type: ignore[no-untyped-def]
    """The largest `_magnitude` of xr's n values (a constant multiple of 8: the loop
    unrolls), 8 lanes at a time (a loop of one did not vectorize: a third of a Q8_0
    block's time)."""
    lanes = stack_i32(8)
    for lane in range(8):
        lanes[lane] = 0
    for j in range(0, n, 8):
        for lane in range(8):
            lanes[lane] = max(lanes[lane], _magnitude(xr[j + lane]))
    top = np.int32(0)
    for lane in range(8):
        top = max(top, lanes[lane])
    return top


@numba.njit(inline="always", **_EXACT)
def _q8_0_block(x, lut, qs, d, s, dsum, i, b):  # type: ignore[no-untyped-def]
    """Block b of row i: quants qs int8 `[M, K]`, the scale d (float16-rounded, as
    float32), Q8_1's stored sum s = f16(d32 * sum q) with ggml's wrapping sum, and d * (the
    sum of the stored quants)."""
    xr, qr = x[i, 32 * b:32 * b + 32], qs[i, 32 * b:32 * b + 32]   # contiguous views
    amax = bits_to_f32(_max_magnitude(xr, 32))
    d32 = amax / np.float32(127)
    inv = np.float32(127) / amax if amax != 0 else np.float32(0)
    total = np.int32(0)        # ggml's sum (wrapping), for s
    stored = np.int32(0)       # the sum of the stored quants
    for j in range(32):        # selects, not branches, and int32 sums: it vectorizes
        q = np.rint(xr[j] * inv)
        # inf, NaN: INT_MIN in the sum as cvtps_epi32 gives it, -128 stored (saturated)
        qi = np.int32(q if abs(q) < np.float32(2.0**31) else np.float32(-2.0**31))
        total = np.int32(total + qi)      # int32, wrapping as ggml's epi32 adds
        c = min(max(qi, np.int32(-128)), np.int32(127))
        stored = np.int32(stored + c)
        qr[j] = np.int8(c)
    d[i, b] = _round_half(d32, lut)
    s[i, b] = _round_half(d32 * np.float32(total), lut)
    dsum[i, b] = d[i, b] * np.float32(stored)


_F32P, _I64 = types.CPointer(types.float32), types.int64


@callback(_F32P, _I64, _I64, _F32P, types.CPointer(types.int8), _F32P, _F32P, _F32P, _I64,
          _I64, _I64, exact=True)
def q8_0_blocks(x_p, m, k, lut_p, qs_p, d_p, s_p, dsum_p, i, b0, b1):  # type: ignore[no-untyped-def]
    """Blocks b0..b1 of row i of x `[M, K]` (`_q8_0_block`), the arrays as pointers (also
    called inside `qmatmul_int.gemv`, which quantizes a decode step's rows itself)."""
    nb = k // 32
    x, lut, qs = carray(x_p, (m, k)), carray(lut_p, (1 << 16,)), carray(qs_p, (m, k))
    d, s, dsum = carray(d_p, (m, nb)), carray(s_p, (m, nb)), carray(dsum_p, (m, nb))
    for b in range(b0, b1):
        _q8_0_block(x, lut, qs, d, s, dsum, i, b)


@numba.njit(inline="always", **_EXACT)
def quantize_at(quantize, x, lut, qs, d, s, dsum):  # type: ignore[no-untyped-def]
    """x's float rows into Q8_0/Q8_1 blocks (qs, d, s, dsum) by the callback at the address
    `quantize` (`q8_0_blocks`), on the calling thread: how a parallel kernel quantizes a
    decode step's row itself without linking the quantizer's code."""
    nb = x.shape[1] // 32
    for i in range(x.shape[0]):
        call_address(quantize, (data_pointer(x), x.shape[0], x.shape[1], data_pointer(lut),
                                data_pointer(qs), data_pointer(d), data_pointer(s),
                                data_pointer(dsum), i, 0, nb))


@numba.njit(**_EXACT)
def _q8_0_serial(x, lut, qs, d, s, dsum):  # type: ignore[no-untyped-def]
    """Q8_0/Q8_1 blocks of x `[M, K]` on the calling thread. A kernel of its own, not the
    callback, which measured slower on this path, the one decode steps take
    (docs/BENCHMARKS.md, "Cold start")."""
    m, k = x.shape
    for i in range(m):
        for b in range(k // 32):
            _q8_0_block(x, lut, qs, d, s, dsum, i, b)


@numba.njit(parallel=True, **_EXACT)
def _q8_0(fn, x, lut, qs, d, s, dsum):  # type: ignore[no-untyped-def]
    """`_q8_0_serial` by the callback at `fn` (`q8_0_blocks`) on chunks of up to
    BLOCKS_PER_CALL blocks of a row, shared among the threads. Each block is quantized
    alone, so the split changes no value."""
    m, k = x.shape
    nb = k // 32
    per_row = (nb + BLOCKS_PER_CALL - 1) // BLOCKS_PER_CALL
    for c in prange(m * per_row):
        i, b0 = c // per_row, (c % per_row) * BLOCKS_PER_CALL
        call_address(fn, (data_pointer(x), m, k, data_pointer(lut), data_pointer(qs),
                          data_pointer(d), data_pointer(s), data_pointer(dsum), i, b0,
                          min(nb, b0 + BLOCKS_PER_CALL)))


@numba.njit(parallel=True, **_EXACT)
def _expand(qs, d, out):  # type: ignore[no-untyped-def]
    """out = d * qs per block (32 or 256 quants): the x~ the quants stand for."""
    m, k = qs.shape
    size = k // d.shape[1]
    for i in prange(m):
        for j in range(k):
            out[i, j] = d[i, j // size] * np.float32(qs[i, j])


@dataclass(frozen=True)
class Q8Rows:
    """x quantized to Q8_0/Q8_1 blocks (see `_q8_0`): what the integer kernels read."""

    qs: np.ndarray     # int8 [M, K]
    d: np.ndarray      # float32 [M, K / 32]
    s: np.ndarray      # Q8_1's stored sum, float32 [M, K / 32]
    dsum: np.ndarray   # d * sum of the stored quants, float32 [M, K / 32]


def quantize_q8(x: np.ndarray) -> Q8Rows:
    """x float32 `[M, K]` (K a multiple of 32) -> its Q8_0/Q8_1 blocks, bit for bit ggml's."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    rows = Q8Rows(np.empty((m, k), np.int8), *np.empty((3, m, k // 32), np.float32))
    if m * k <= SERIAL_MAX:
        _q8_0_serial(x, HALF_LUT, rows.qs, rows.d, rows.s, rows.dsum)
    else:
        _q8_0(q8_0_blocks.address, x, HALF_LUT, rows.qs, rows.d, rows.s, rows.dsum)
    return rows


@numba.njit(inline="always", **_EXACT)
def _q8_k_block(x, qs, d, bsums, i, b):  # type: ignore[no-untyped-def]
    """Q8_K block b (256 values) of row i as `activation_quant.quantize_q8_k`: quants qs
    int8 `[M, K]`, the float32 scale d `[M, K / 256]`, and bsums int16 `[M, K / 16]`, the
    sum of every 16 quants."""
    xr, qr = x[i, 256 * b:256 * b + 256], qs[i, 256 * b:256 * b + 256]   # contiguous views
    # the largest magnitude's bits (NaN skipped, as ggml's) and where it first stands, as
    # one integer max over magnitude << 8 | (255 - j): a loop that vectorizes, where a
    # search for the first place took 2.5 cycles a value
    best = np.int64(0)
    for j in range(256):
        best = max(best, (np.int64(_magnitude(xr[j])) << 8) | (255 - j))
    top, first = np.int32(best >> 8), 255 - (best & 255)
    amax = bits_to_f32(top)
    peak = xr[first]
    iscale = np.float32(-127) / peak if amax != 0 else np.float32(0)
    d[i, b] = np.float32(1) / iscale if amax != 0 else np.float32(0)
    for j in range(256):
        q = np.rint(iscale * xr[j])
        if not np.isfinite(q):                  # as the numpy reference
            q = np.float32(0)
        qr[j] = np.int8(min(q, np.float32(127)))
    for r in range(16):
        total = np.int16(0)
        for j in range(16 * r, 16 * r + 16):
            total += np.int16(qr[j])
        bsums[i, 16 * b + r] = total


@callback(_F32P, _I64, _I64, types.CPointer(types.int8), _F32P, types.CPointer(types.int16),
          _I64, _I64, _I64, exact=True)
def q8_k_blocks(x_p, m, k, qs_p, d_p, bsums_p, i, b0, b1):  # type: ignore[no-untyped-def]
    """Blocks b0..b1 of row i of x `[M, K]` (`_q8_k_block`), the arrays as pointers (also
    called inside `qmatmul_int_k.gemv`, as `q8_0_blocks`)."""
    x, qs = carray(x_p, (m, k)), carray(qs_p, (m, k))
    d, bsums = carray(d_p, (m, k // 256)), carray(bsums_p, (m, k // 16))
    for b in range(b0, b1):
        _q8_k_block(x, qs, d, bsums, i, b)


@numba.njit(**_EXACT)
def _q8_k_serial(x, qs, d, bsums):  # type: ignore[no-untyped-def]
    """Q8_K blocks of x `[M, K]` on the calling thread (a kernel of its own, as
    `_q8_0_serial`)."""
    m, k = x.shape
    for i in range(m):
        for b in range(k // 256):
            _q8_k_block(x, qs, d, bsums, i, b)


@numba.njit(parallel=True, **_EXACT)
def _q8_k(fn, x, qs, d, bsums):  # type: ignore[no-untyped-def]
    """`_q8_k_serial` by the callback at `fn` (`q8_k_blocks`) on chunks of up to
    BLOCKS_PER_CALL / 8 blocks of a row, shared among the threads, as `_q8_0`."""
    m, k = x.shape
    nb = k // 256
    step = BLOCKS_PER_CALL // 8
    per_row = (nb + step - 1) // step
    for c in prange(m * per_row):
        i, b0 = c // per_row, (c % per_row) * step
        call_address(fn, (data_pointer(x), m, k, data_pointer(qs), data_pointer(d),
                          data_pointer(bsums), i, b0, min(nb, b0 + step)))


@dataclass(frozen=True)
class Q8KRows:
    """x quantized to Q8_K blocks (see `_q8_k`): what the K-quants' integer kernels read."""

    qs: np.ndarray      # int8 [M, K]
    d: np.ndarray       # float32 [M, K / 256]
    bsums: np.ndarray   # int16 [M, K / 16]


def quantize_q8_k(x: np.ndarray) -> Q8KRows:
    """x float32 `[M, K]` (K a multiple of 256) -> its Q8_K blocks, bit for bit ggml's."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    rows = Q8KRows(np.empty((m, k), np.int8), np.empty((m, k // 256), np.float32),
                   np.empty((m, k // 16), np.int16))
    if m * k <= SERIAL_MAX:
        _q8_k_serial(x, rows.qs, rows.d, rows.bsums)
    else:
        _q8_k(q8_k_blocks.address, x, rows.qs, rows.d, rows.bsums)
    return rows


@numba.njit(parallel=True, **_EXACT)
def _round_16(x, lut, out, bf16):  # type: ignore[no-untyped-def]
    m, k = x.shape
    for i in prange(m):
        for j in range(k):
            if bf16:
                b = f32_to_bits(x[i, j])
                if (b & 0x7FFFFFFF) > 0x7F800000:
                    b = (b | 0x00400000) & 0xFFFF0000
                else:
                    b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
                out[i, j] = bits_to_f32(b)
            else:
                out[i, j] = lut[_f16_bits(x[i, j])]


def simulate(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(x~, min_delta) of `activation_quant.simulate`, x float32 `[M, K]` C-contiguous."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    if fmt in ("q8_0", "q8_1"):
        rows = quantize_q8(x)
        _expand(rows.qs, rows.d, out)
        if fmt == "q8_0":
            return out, None
        with np.errstate(invalid="ignore"):     # inf - inf of a huge block, as ggml's
            return out, rows.s - rows.dsum
    if fmt == "q8_k":
        blocks = quantize_q8_k(x)
        _expand(blocks.qs, blocks.d, out)
        return out, None
    if fmt in ("f16", "bf16"):
        _round_16(x, HALF_LUT, out, fmt == "bf16")
        return out, None
    raise ValueError(f"no activation format {fmt!r}")


@numba.njit(parallel=True, **_EXACT)
def _add_mins(mins, lut, delta, out):  # type: ignore[no-untyped-def]
    n, nb = mins.shape
    for r in prange(n):
        for i in range(delta.shape[0]):
            acc = np.float32(0)
            for b in range(nb):
                acc += lut[mins[r, b]] * delta[i, b]
            out[i, r] += acc


# From this many rows of x the min term converts the mins and multiplies on BLAS. Measured on
# 3072 x 18 mins, kernel vs BLAS: 512 rows 7.7 vs 2.8 ms, 16 rows 0.25 vs 0.44 ms (one row:
# 0.023 ms in the kernel)
BLAS_MIN_ROWS = 32


def add_mins(mins: np.ndarray, delta: np.ndarray, out: np.ndarray) -> None:
    """out[M, N] += delta[M, K / 32] @ min[N, K / 32].T, the mins a float16 plane (Q4_1/Q5_1's
    `m`): the part of their min term `simulate`'s x~ leaves out."""
    if len(delta) >= BLAS_MIN_ROWS:
        out += delta @ HALF_LUT[mins].T
    else:
        _add_mins(mins, HALF_LUT, delta, out)
