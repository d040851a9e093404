"""Row-wise kernels of the CPU backend: RMSNorm (alone and fused with the residual add),
LayerNorm, SiLU- and GELU-and-multiply, GELU and RoPE in place.

Each comes as a serial kernel (few rows: decode steps, where a parallel region's ~3 us launch
would cost more than the work) and a `prange` kernel over rows (prefill), picked by
`PARALLEL_ROWS`. Inputs may be strided views (q/k/v of a fused projection); outputs are new
C-contiguous arrays unless the op is documented in place.
"""

from __future__ import annotations

import math

import numpy as np
from numba import carray, prange, types

from vllm_actors.kernels.cpu.attention_math import exp2
from vllm_actors.kernels.cpu.intrinsics import (
    call_address,
    data_pointer,
    fma_f32,
    realign_stack,
    square_sums16,
    stack_f64,
)
from vllm_actors.kernels.cpu.jit import callback, kernel

# From this many rows a kernel runs over rows in parallel.
PARALLEL_ROWS = 16


@kernel(exact=True)
def _sum_squares(x):  # type: ignore[no-untyped-def]
    """sum of x[i] * x[i] (each product rounded to float32) in float64, in order, as ggml
    sums them (fast math had let LLVM vectorize the sum of a contiguous row: another order,
    which float64 seldom showed)."""
    acc = 0.0
    for i in range(x.shape[0]):
        acc += np.float64(x[i] * x[i])
    return acc


@kernel(exact=True)
def rms_row(x, weight, eps, out):  # type: ignore[no-untyped-def]
    """ggml's RMSNorm: mean = float32(sum / n), scale = 1 / sqrt(mean + eps) in float32,
    out = (x * scale) * w, each product rounded (no fast math: the order is the point)."""
    _scale_row(x, weight, _rms_scale(_sum_squares(x), x.shape[0], eps), out)


@kernel(exact=True)
def _rms_scale(total, n, eps):  # type: ignore[no-untyped-def]
    mean = np.float32(total / n)
    return np.float32(1.0) / np.float32(math.sqrt(mean + np.float32(eps)))


@kernel(exact=True)
def _scale_row(x, weight, scale, out):  # type: ignore[no-untyped-def]
    for i in range(x.shape[0]):
        out[i] = (x[i] * scale) * weight[i]


GROUP = 16    # rows whose sums of squares `_rms_rows` runs as vector lanes


@kernel(exact=True)
def _rms_rows(x, r0, weight, eps, out):  # type: ignore[no-untyped-def]
    """`rms_row` of rows r0 .. r0 + GROUP - 1 of the C-contiguous x, the same floats: each
    row's float64 sum is a chain of dependent adds (a row alone waits an add's latency a
    value), so the rows run as the lanes of `intrinsics.square_sums16`, 8 values at a time;
    values past the last whole 8 are added one by one."""
    n = x.shape[1]
    flat = x.reshape(-1)
    sums = stack_f64(GROUP)
    for r in range(GROUP):
        sums[r] = 0.0
    whole = n - n % 8
    for i in range(0, whole, 8):
        square_sums16(sums, 0, flat, r0 * n + i, n)
    for r in range(GROUP):
        total = sums[r]
        for i in range(whole, n):
            total += np.float64(x[r0 + r, i] * x[r0 + r, i])
        _scale_row(x[r0 + r], weight, _rms_scale(total, n, eps), out[r0 + r])


@kernel
def _rms_norm_serial(x, weight, eps, out):
    for r in range(x.shape[0]):
        rms_row(x[r], weight, eps, out[r])


_F32P, _I64, _F64 = types.CPointer(types.float32), types.int64, types.float64


@callback(_F32P, _F32P, _I64, _I64, _I64, _F32P, _F64, _F32P, _I64, _I64, exact=True)
def _norm_rows(h_p, delta_p, add, rows, n, w_p, eps, out_p, r0, r1):  # type: ignore[no-untyped-def]
    """Rows r0..r1-1 of h `[rows, n]`: h += delta first where `add` (the residual add of
    `add_rms_norm`), then RMSNorm into out, a whole GROUP by `_rms_rows`. A C callback, so
    that the parallel kernel calling it links none of its code (docs/BENCHMARKS.md, "Cold
    start on the AVX2 host")."""
    realign_stack()     # its callees' vector spills aligned whatever the caller's stack
    h, w, out = carray(h_p, (rows, n)), carray(w_p, (n,)), carray(out_p, (rows, n))
    if add:
        delta = carray(delta_p, (rows, n))
        for r in range(r0, r1):
            for i in range(n):
                h[r, i] = h[r, i] + delta[r, i]
    if r1 - r0 == GROUP:
        _rms_rows(h, r0, w, eps, out)
    else:
        for r in range(r0, r1):
            rms_row(h[r], w, eps, out[r])


def compile_norm_rows() -> None:
    """Compile (or load from the cache) `_norm_rows`, whose types its signature fixes, and
    the parallel kernel that calls it (`_norm_parallel`, on the float32 arrays a model's
    steps pass): a task of the cold start's shared compile work
    (`workers.warm_up.SharedWork`)."""
    _norm_rows.address   # noqa: B018
    rows = np.zeros((PARALLEL_ROWS, GROUP), np.float32)
    rms_norm(rows, np.ones(GROUP, np.float32), 1e-6)


@kernel(parallel=True)
def _norm_parallel(fn, h, delta, add, weight, eps, out):  # type: ignore[no-untyped-def]
    """`_norm_rows` by the callback at `fn` on each GROUP of rows (`add`: with the residual
    add), shared among the threads; each row alone, so the split changes no value."""
    rows, n = h.shape
    for g in prange((rows + GROUP - 1) // GROUP):
        r0 = np.int64(g * GROUP)
        call_address(fn, (data_pointer(h), data_pointer(delta), np.int64(add), np.int64(rows),
                          np.int64(n), data_pointer(weight), np.float64(eps),
                          data_pointer(out), r0, np.int64(min(rows, r0 + GROUP))))


@kernel
def _add_rms_row(h, delta, weight, eps, out):  # type: ignore[no-untyped-def]
    """h += delta, then `rms_row` of it."""
    for i in range(h.shape[0]):
        h[i] = h[i] + delta[i]
    rms_row(h, weight, eps, out)


@kernel
def _add_rms_norm_serial(h, delta, weight, eps, out):
    for r in range(h.shape[0]):
        _add_rms_row(h[r], delta[r], weight, eps, out[r])


_LOG2E = np.float32(1.4426950408889634)


@kernel
def _silu_mul_row(gate_up, out):
    """exp through the attention kernels' polynomial `exp2` (vectorizes; numba's `np.exp` is
    a libm call per element: SmolLM2's 512-token prefill spent 70 ms of 1193 here)."""
    f = out.shape[0]
    for i in range(f):
        g = gate_up[i]
        e = exp2(min(-g * _LOG2E, np.float32(126.0)))
        out[i] = g / (np.float32(1.0) + e) * gate_up[f + i]


@kernel
def _silu_mul_serial(gate_up, out):
    for r in range(out.shape[0]):
        _silu_mul_row(gate_up[r], out[r])


@kernel(parallel=True)
def _silu_mul_parallel(gate_up, out):
    for r in prange(out.shape[0]):
        _silu_mul_row(gate_up[r], out[r])


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_A = np.float32(_SQRT_2_OVER_PI)
_GELU_B = np.float32(_SQRT_2_OVER_PI * 0.044715)
_INV_SQRT2_64 = 1.0 / math.sqrt(2.0)


@kernel
def gelu_tanh(x):
    """0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), as x / (1 + e^(-2u)): the same
    value (0.5 (1 + tanh u) is the logistic of 2u) with no cancellation for x < 0, through the
    `exp2` polynomial like SiLU."""
    u = x * (_GELU_A + _GELU_B * x * x)
    e = exp2(min(u * np.float32(-2.0) * _LOG2E, np.float32(126.0)))
    return x / (np.float32(1.0) + e)


# erfc(a) = t exp(-a^2 + sum c_k t^k), t = 1 / (1 + a / 2), a >= 0: the Chebyshev fit of
# Press et al.'s Numerical Recipes (erfcc), fractional error below 1.2e-7 everywhere
(_E0, _E1, _E2, _E3, _E4, _E5, _E6, _E7, _E8, _E9) = (np.float32(c) for c in (
    -1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
    1.48851587, -0.82215223, 0.17087277))
_INV_SQRT2 = np.float32(_INV_SQRT2_64)


@kernel(inline=True)
def erfc_pos(a):
    """erfc(a) for float32 a >= 0 through `exp2` (no libm call, so loops vectorize)."""
    t = np.float32(1.0) / (np.float32(1.0) + np.float32(0.5) * a)
    p = ((((((((_E9 * t + _E8) * t + _E7) * t + _E6) * t + _E5) * t + _E4) * t + _E3) * t
          + _E2) * t + _E1) * t + _E0
    return t * exp2((p - a * a) * _LOG2E)


@kernel(inline=True)
def gelu_erf(x):
    """0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2): erfc of the positive side
    directly (no cancellation for x < 0), 2 - erfc otherwise. 3x the float64 libm path
    (docs/BENCHMARKS.md, "Embeddings")."""
    z = x * _INV_SQRT2
    c = erfc_pos(abs(z))
    return np.float32(0.5) * x * (np.float32(2.0) - c if z >= 0 else c)


@kernel
def _gelu_mul_row(gate_up, out, approximate):
    f = out.shape[0]
    if approximate:
        for i in range(f):
            out[i] = gelu_tanh(gate_up[i]) * gate_up[f + i]
    else:
        for i in range(f):
            out[i] = gelu_erf(gate_up[i]) * gate_up[f + i]


@kernel
def _gelu_mul_serial(gate_up, out, approximate):
    for r in range(out.shape[0]):
        _gelu_mul_row(gate_up[r], out[r], approximate)


@kernel(parallel=True)
def _gelu_mul_parallel(gate_up, out, approximate):
    for r in prange(out.shape[0]):
        _gelu_mul_row(gate_up[r], out[r], approximate)


@kernel
def _gelu_row(x, approximate):
    """In place, with one array: the loop vectorizes (given an output array that may be
    the input, LLVM's runtime alias check sends it to its scalar version, 9x slower)."""
    if approximate:
        for i in range(x.shape[0]):
            x[i] = gelu_tanh(x[i])
    else:
        for i in range(x.shape[0]):
            x[i] = gelu_erf(x[i])


@kernel
def _gelu_serial(x, approximate):
    for r in range(x.shape[0]):
        _gelu_row(x[r], approximate)


@kernel(parallel=True)
def _gelu_parallel(x, approximate):
    for r in prange(x.shape[0]):
        _gelu_row(x[r], approximate)


@kernel
def _layer_norm_row(x, weight, bias, has_bias, eps, out):
    """Mean, then the variance of the centered row, both summed in float32 (as numpy does)."""
    n = x.shape[0]
    acc = np.float32(0.0)
    for i in range(n):
        acc += x[i]
    mean = acc / np.float32(n)
    var = np.float32(0.0)
    for i in range(n):
        c = x[i] - mean
        var += c * c
    inv = np.float32(1.0) / np.float32(math.sqrt(var / np.float32(n) + np.float32(eps)))
    if has_bias:
        for i in range(n):
            out[i] = (x[i] - mean) * inv * weight[i] + bias[i]
    else:
        for i in range(n):
            out[i] = (x[i] - mean) * inv * weight[i]


@kernel
def _layer_norm_serial(x, weight, bias, has_bias, eps, out):
    for r in range(x.shape[0]):
        _layer_norm_row(x[r], weight, bias, has_bias, eps, out[r])


@kernel(parallel=True)
def _layer_norm_parallel(x, weight, bias, has_bias, eps, out):
    for r in prange(x.shape[0]):
        _layer_norm_row(x[r], weight, bias, has_bias, eps, out[r])


@kernel(exact=True)
def rope_row(x, cos, sin, rotary_dim, interleaved, fused):
    """x [H, Dh] of one token rotated in place by its position's cos/sin [rotary_dim / 2];
    `fused`: ggml's multiply-adds (`ops.RopeTables.fused`)."""
    half = rotary_dim // 2
    for h in range(x.shape[0]):
        for i in range(half):
            if interleaved:
                a, b = 2 * i, 2 * i + 1
            else:
                a, b = i, half + i
            x1, x2 = x[h, a], x[h, b]
            if fused:
                x[h, a] = fma_f32(x1, cos[i], -(x2 * sin[i]))
                x[h, b] = fma_f32(x1, sin[i], x2 * cos[i])
            else:
                x[h, a] = x1 * cos[i] - x2 * sin[i]
                x[h, b] = x2 * cos[i] + x1 * sin[i]


@kernel
def _rope_serial(x, positions, cos, sin, rotary_dim, interleaved, fused):
    for t in range(x.shape[0]):
        p = positions[t]
        rope_row(x[t], cos[p], sin[p], rotary_dim, interleaved, fused)


@kernel(parallel=True)
def _rope_parallel(x, positions, cos, sin, rotary_dim, interleaved, fused):
    for t in prange(x.shape[0]):
        p = positions[t]
        rope_row(x[t], cos[p], sin[p], rotary_dim, interleaved, fused)


def _contiguous(a: np.ndarray) -> np.ndarray:
    """a as a C-contiguous float32 array (itself when it is one), for a callback's pointer."""
    return np.ascontiguousarray(a, np.float32)


def _rows(x: np.ndarray) -> np.ndarray:
    """x [..., n] as a 2-D [rows, n] array (a view when the layout allows)."""
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: a new float32 array of x's shape."""
    out = np.empty(x.shape, np.float32)
    rows = _rows(x)
    if len(rows) >= PARALLEL_ROWS:
        rows = np.ascontiguousarray(rows)
        _norm_parallel(_norm_rows.address, rows, rows, False, _contiguous(weight), eps,
                       out.reshape(rows.shape))
    else:
        _rms_norm_serial(rows, weight, eps, out.reshape(rows.shape))
    return out


def add_rms_norm(h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
                 ) -> np.ndarray:
    """h += delta in place (the residual stream), then RMSNorm(h) as a new array."""
    out = np.empty(h.shape, np.float32)
    if len(h) >= PARALLEL_ROWS and h.flags.c_contiguous:
        _norm_parallel(_norm_rows.address, h, _contiguous(delta), True, _contiguous(weight),
                       eps, out)
    else:
        _add_rms_norm_serial(h, delta, weight, eps, out)
    return out


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [T, 2F] -> silu(gate) * up [T, F]."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    fn = _silu_mul_parallel if len(out) >= PARALLEL_ROWS else _silu_mul_serial
    fn(gate_up, out)
    return out


def gelu_mul(gate_up: np.ndarray, approximate: bool = True) -> np.ndarray:
    """gate_up [T, 2F] -> gelu(gate) * up [T, F]; approximate: the tanh form, else erf."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    fn = _gelu_mul_parallel if len(out) >= PARALLEL_ROWS else _gelu_mul_serial
    fn(gate_up, out, bool(approximate))
    return out


def gelu(x: np.ndarray, approximate: bool = True) -> np.ndarray:
    """Elementwise GELU of x [..., n]; in place when x is a writable C-contiguous float32
    array, else in a copy."""
    inplace = x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable
    out = x if inplace else np.array(x, np.float32, order="C")
    rows = _rows(out)
    fn = _gelu_parallel if len(rows) >= PARALLEL_ROWS else _gelu_serial
    fn(rows, bool(approximate))
    return out


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float
               ) -> np.ndarray:
    """LayerNorm over the last axis (bias optional): a new float32 array of x's shape."""
    out = np.empty(x.shape, np.float32)
    rows = _rows(x)
    fn = _layer_norm_parallel if len(rows) >= PARALLEL_ROWS else _layer_norm_serial
    fn(rows, weight, weight if bias is None else bias, bias is not None, eps,
       out.reshape(rows.shape))
    return out


def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
         rotary_dim: int, interleaved: bool, fused: bool = False) -> np.ndarray:
    """Rotate x [T, H, Dh] in place by the cos/sin rows [max_pos, rotary_dim / 2] of each
    token's position (`fused`: ggml's multiply-adds, `ops.RopeTables.fused`); returns x."""
    fn = _rope_parallel if len(x) >= PARALLEL_ROWS else _rope_serial
    fn(x, positions, cos, sin, rotary_dim, interleaved, fused)
    return x
