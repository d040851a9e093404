"""RoPE as ggml computes it, for the quantized GGUF semantics (llama.cpp's numbers).

Tables: per position p the angle starts at float32(p) and is multiplied, in float32, by
theta_scale = powf(base, -2 / n_dims) once per pair of dimensions (ggml's rope cache), divided
by the pair's frequency factor and scaled by freq_scale; cos and sin are libm's `cosf` and
`sinf` of it. numba lowers `math.cos` / `math.sin` / `math.pow` on float32 to exactly those
libm calls (numpy's own cos differs from them in about 1 % of float32 inputs).

Rotation (`RopeTables.fused`): x0' = fma(x0, cos, -(x1 sin)), x1' = fma(x0, sin, x1 cos), the
multiply-adds GCC contracts ggml's `x0*cos - x1*sin` and `x0*sin + x1*cos` into
(bench/llamacpp_tensors.py shows them bit for bit on llama.cpp's inputs).
"""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(cache=True)
def _angles(theta_scale, factors, freq_scale, cos, sin):  # type: ignore[no-untyped-def]
    for p in range(cos.shape[0]):
        theta = np.float32(p)
        for i in range(cos.shape[1]):
            angle = np.float32(freq_scale * np.float32(theta / factors[i]))
            cos[p, i] = math.cos(angle)
            sin[p, i] = math.sin(angle)
            theta = np.float32(theta * theta_scale)


@numba.njit(cache=True)
def _pow(base, exponent):  # type: ignore[no-untyped-def]
    return np.float32(math.pow(base, exponent))      # libm powf on float32 arguments


def ggml_rope_tables(max_positions: int, rotary_dim: int, base: float,
                     freq_factors: np.ndarray | None = None, freq_scale: float = 1.0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 `[max_positions, rotary_dim / 2]` as ggml's rope cache holds them."""
    half = rotary_dim // 2
    theta_scale = _pow(np.float32(base), np.float32(-2.0) / np.float32(rotary_dim))
    factors = (np.ones(half, np.float32) if freq_factors is None
               else np.ascontiguousarray(freq_factors, np.float32))
    cos = np.empty((max_positions, half), np.float32)
    sin = np.empty((max_positions, half), np.float32)
    _angles(theta_scale, factors, np.float32(freq_scale), cos, sin)
    return cos, sin
