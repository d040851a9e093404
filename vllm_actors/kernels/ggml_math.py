"""ggml's vectorized exp, SiLU and GELU, element by element, for the quantized GGUF semantics.

llama.cpp's x86 build computes exp (softmax) and SiLU (SwiGLU) with `ggml_v_expf`, a polynomial
whose AVX-512 and AVX2 versions round differently; elements past the last full vector take
libm's `expf`. These functions give those floats bit for bit, each fused multiply-add where
ggml has one (`fma_f32`). The width (16: AVX-512F + DQ, 8: AVX2 + FMA) follows the host, as
a llama.cpp built on it would (`ggml_width`). GELU (GeGLU's tanh form) is ggml's table: the
float16 GELU of every float16 input, computed as ggml's `ggml_gelu_f32` with GCC's fused
1 + a x^2 (the table equals the one in llama.cpp's library, all 65,536 entries).
"""

from __future__ import annotations

import functools
import math
import os

import numba
import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.activations import _f16_bits
from vllm_actors.kernels.cpu.elementwise import PARALLEL_ROWS
from vllm_actors.kernels.cpu.intrinsics import (HARDWARE_HALF, bits_to_f32, f32_to_bits,
                                                fma_f32, hardware_half_bits)
from vllm_actors.kernels.cpu.isa import host_features
from vllm_actors.kernels.cpu.jit import kernel

# a float32's float16 bits, ties to even: F16C's one instruction where the host has it
_half_index = hardware_half_bits if HARDWARE_HALF else _f16_bits

_R, _LOG2E, _LN2_HI, _LN2_LO, _C5, _C4, _C3, _C2, _C1 = (np.float32(float.fromhex(h)) for h in (
    "0x1.8p23", "0x1.715476p+0", "0x1.62e4p-1", "0x1.7f7d1cp-20",     # ggml's constants
    "0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1"))


WIDTH_ENV = "VLLM_ACTORS_GGML_WIDTH"


@functools.cache
def ggml_width() -> int:
    """Floats per vector of the llama.cpp whose numbers we give: one built for this host (16
    with AVX-512F and DQ, else 8), or `VLLM_ACTORS_GGML_WIDTH` (16 or 8; the emulation runs
    on any x86 host with FMA, so a golden from an AVX-512 build can be checked anywhere)."""
    forced = os.environ.get(WIDTH_ENV, "").strip()
    if forced:
        if forced not in ("8", "16"):
            raise ValueError(f"{WIDTH_ENV}={forced!r}: expected 8 or 16")
        return int(forced)
    return 16 if {"avx512f", "avx512dq"} <= host_features() else 8


@numba.njit(inline="always", cache=True)
def _reduce(x):  # type: ignore[no-untyped-def]
    """(n, b): x = n ln2 + b with n integral, as both versions split it."""
    z = fma_f32(x, _LOG2E, _R)
    n = np.float32(z - _R)
    b = fma_f32(-n, _LN2_LO, fma_f32(-n, _LN2_HI, x))
    return z, n, b


@numba.njit(inline="always", cache=True)
def expf16(x):  # type: ignore[no-untyped-def]
    """exp(x) as ggml's AVX-512 `ggml_v_expf` (`_mm512_scalef_ps` for the 2^n)."""
    z, n, b = _reduce(np.float32(x))
    u = np.float32(b * b)
    j = fma_f32(fma_f32(fma_f32(_C5, b, _C4), u, fma_f32(_C3, b, _C2)), u,
                fma_f32(_C1, b, np.float32(1.0)))
    if abs(n) > 192:
        return np.float32(0.0) if n <= 0 else np.float32(np.inf)
    m = np.int64(n)      # scalef: j * 2^n rounded once; where 2^n is no float32, an exact
    if m > 127:          # first step (j is in [0.5, 2)) and then the one rounding
        return np.float32(np.float32(j * _pow2(127)) * _pow2(m - 127))
    if m < -149:
        return np.float32(np.float32(j * _pow2(m + 149)) * _pow2(-149))
    return np.float32(j * _pow2(m))


NORMAL_LOW, NORMAL_HIGH = -87.0, 88.0
_NORMAL_LOW32, _NORMAL_HIGH32 = np.float32(NORMAL_LOW), np.float32(NORMAL_HIGH)


@numba.njit(inline="always", cache=True)
def expf16_normal(x):  # type: ignore[no-untyped-def]
    """`expf16(x)` for NORMAL_LOW <= x <= NORMAL_HIGH, where 2^n is a normal float32: no
    branch, so a loop of them vectorizes (the caller takes `expf16` outside that range)."""
    z, n, b = _reduce(np.float32(x))
    u = np.float32(b * b)
    j = fma_f32(fma_f32(fma_f32(_C5, b, _C4), u, fma_f32(_C3, b, _C2)), u,
                fma_f32(_C1, b, np.float32(1.0)))
    return np.float32(j * bits_to_f32(np.uint32((np.int32(n) + 127) << 23)))


@numba.njit(inline="always", cache=True)
def _pow2(n):  # type: ignore[no-untyped-def]
    """2^n as a float32, -149 <= n <= 127 (subnormal below -126)."""
    if n >= -126:
        return bits_to_f32(np.uint32((n + 127) << 23))
    return bits_to_f32(np.uint32(1 << (n + 149)))


@numba.njit(inline="always", cache=True)
def _expf8_parts(x):  # type: ignore[no-untyped-def]
    """(n, 2^n's exponent bits e, the polynomial j, 2^n as k) of ggml's AVX2 exp."""
    z, n, b = _reduce(np.float32(x))
    e = (f32_to_bits(z) << np.uint32(23)) & np.uint32(0xFFFFFFFF)
    k = bits_to_f32((e + np.uint32(0x3F800000)) & np.uint32(0xFFFFFFFF))
    u = np.float32(b * b)
    j = fma_f32(fma_f32(fma_f32(_C5, b, _C4), u, fma_f32(_C3, b, _C2)), u,
                np.float32(_C1 * b))
    return n, e, j, k


@numba.njit(inline="always", cache=True)
def expf8(x):  # type: ignore[no-untyped-def]
    """exp(x) as ggml's AVX2 `ggml_v_expf` (2^n built in the exponent bits)."""
    n, e, j, k = _expf8_parts(x)
    if abs(n) <= 126:
        return fma_f32(j, k, k)
    g = np.uint32(0x82000000) if n <= 0 else np.uint32(0)
    s1 = bits_to_f32((g + np.uint32(0x7F000000)) & np.uint32(0xFFFFFFFF))
    if abs(n) > 192:
        return np.float32(s1 * s1)
    s2 = bits_to_f32((e - g) & np.uint32(0xFFFFFFFF))
    return np.float32(fma_f32(s2, j, s2) * s1)


@numba.njit(inline="always", cache=True)
def expf(x, width):  # type: ignore[no-untyped-def]
    """ggml's vector exp of an element, in `width` lanes (16: AVX-512, 8: AVX2)."""
    return expf16(x) if width == 16 else expf8(x)


@numba.njit(inline="always", cache=True)
def expf8_normal(x):  # type: ignore[no-untyped-def]
    """`expf8(x)` for NORMAL_LOW <= x <= NORMAL_HIGH (|n| <= 126): no branch, as
    `expf16_normal`."""
    _, _, j, k = _expf8_parts(x)
    return fma_f32(j, k, k)


@numba.njit(inline="always", cache=True)
def _clamp(x):  # type: ignore[no-untyped-def]
    """x within [NORMAL_LOW, NORMAL_HIGH] (NaN anywhere: its element is redone)."""
    return min(max(x, _NORMAL_LOW32), _NORMAL_HIGH32)


@numba.njit(inline="always", cache=True)
def _silu_times(x, e, up):  # type: ignore[no-untyped-def]
    return np.float32(x / np.float32(np.float32(1.0) + e)) * up


@numba.njit(inline="always", cache=True)
def _swiglu_row(gate_up, out, r, width, exp_normal, exp_any):  # type: ignore[no-untyped-def]
    """Row r in `width` lanes, with ggml's exp of that width for the normal range
    (`exp_normal`) and for any value (`exp_any`): the whole vectors branch-free (clamped into
    the normal range, so the loop vectorizes), then the rare elements outside it again, then
    the tail through libm's, as ggml's loop leaves it."""
    f = out.shape[1]
    whole = f - f % width
    g, u, o = gate_up[r, :whole], gate_up[r, f:f + whole], out[r, :whole]
    for i in range(whole):
        o[i] = _silu_times(g[i], exp_normal(_clamp(-g[i])), u[i])
    outside = 0                 # counted first: a loop with the exact call inside is slow
    for i in range(whole):
        outside += np.int32(not _NORMAL_LOW32 <= -g[i] <= _NORMAL_HIGH32)     # NaN too
    if outside:
        for i in range(whole):
            if not _NORMAL_LOW32 <= -g[i] <= _NORMAL_HIGH32:
                o[i] = _silu_times(g[i], exp_any(-g[i]), u[i])
    # the tail through libm's exp, called directly: each inlined exp costs 0.4 s of a cold
    # start's compile
    for i in range(whole, f):
        e = np.float32(math.exp(np.float32(-gate_up[r, i])))
        out[r, i] = _silu_times(gate_up[r, i], e, gate_up[r, f + i])


# exact (no fast math), error_model="numpy": no zero-division check in the loops, so they
# vectorize. One thread: a parallel form halved a 512-row prefill's SwiGLU (0.34 -> 0.17 ms)
# and cost 1.5-2 s of compiling on a cold start (docs/BENCHMARKS.md, "The matmuls of many rows").
# A kernel per width: a process compiles only its host's (both in one kernel cost 1.3 s more).
@kernel(exact=True)
def _swiglu_rows8(gate_up, out):  # type: ignore[no-untyped-def]
    for r in range(out.shape[0]):
        _swiglu_row(gate_up, out, r, 8, expf8_normal, expf8)


@kernel(exact=True)
def _swiglu_rows16(gate_up, out):  # type: ignore[no-untyped-def]
    for r in range(out.shape[0]):
        _swiglu_row(gate_up, out, r, 16, expf16_normal, expf16)


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [T, 2F] -> silu(gate) * up [T, F] as ggml's `ggml_vec_swiglu_f32`."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    rows = _swiglu_rows16 if ggml_width() == 16 else _swiglu_rows8
    rows(np.ascontiguousarray(gate_up, np.float32), out)
    return out


_GELU_A = np.float32(0.044715)
_GELU_S = np.float32(0.79788456080286535587989211986876)


@numba.njit(cache=True)
def _gelu_entries(values, out):  # type: ignore[no-untyped-def]
    for i in range(values.shape[0]):
        x = values[i]
        inner = fma_f32(np.float32(_GELU_A * x), x, np.float32(1.0))
        t = np.float32(math.tanh(np.float32(np.float32(_GELU_S * x) * inner)))
        out[i] = np.float32(np.float32(np.float32(0.5) * x) * np.float32(np.float32(1.0) + t))


@functools.cache
def gelu_table() -> np.ndarray:
    """float32 [65536]: ggml's `ggml_table_gelu_f16`, indexed by float16 bits."""
    from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT
    out = np.empty(1 << 16, np.float32)
    with np.errstate(invalid="ignore"):
        _gelu_entries(HALF_LUT, out)
        table = out.astype(np.float16).astype(np.float32)
    table.setflags(write=False)
    return table


@kernel(inline=True, exact=True)
def _geglu_row(gate_up, table, out, r):  # type: ignore[no-untyped-def]
    """Row r in ggml's three cases. The table is read for every element (a float16 index is
    always within it), then the cases select: no branch, so the loop vectorizes."""
    f = out.shape[1]
    for i in range(f):
        x, g = gate_up[r, i], gate_up[r, f + i]
        looked_up = table[_half_index(x)] * g
        out[r, i] = np.float32(0.0) if x <= -10.0 else (x * g if x >= 10.0 else looked_up)


@kernel(exact=True)
def _geglu_rows(gate_up, table, out):  # type: ignore[no-untyped-def]
    for r in range(out.shape[0]):
        _geglu_row(gate_up, table, out, r)


# A prefill's rows in parallel: Gemma 3 270M's 512 x 2048 went 0.88 -> 0.22 ms on 2 threads
# (4x: each thread's loop also ran faster in the parallel region, not examined); 0.4 s of
# compiling, in a GeGLU model's warm-up (docs/BENCHMARKS.md, "Two rows of x a pass").
@kernel(parallel=True, exact=True)
def _geglu_rows_parallel(gate_up, table, out):  # type: ignore[no-untyped-def]
    for r in prange(out.shape[0]):
        _geglu_row(gate_up, table, out, r)


def geglu(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [T, 2F] -> gelu_tanh(gate) * up [T, F] as ggml's `ggml_vec_geglu_f32`."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    rows = _geglu_rows_parallel if len(out) >= PARALLEL_ROWS else _geglu_rows
    rows(np.ascontiguousarray(gate_up, np.float32), gelu_table(), out)
    return out
