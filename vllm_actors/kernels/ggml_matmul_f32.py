"""float32 x float32 matmuls in llama.cpp's CPU order, for the LoRA products under the
quantized GGUF semantics (a GGUF adapter's A and B are F32; `ggml_mul_mat` multiplies them
with float32 inputs, vec_dot_type F32).

- A request with two rows or more in the step and a contraction that is a multiple of 16:
  llamafile's tinyBLAS (ggml tries it first; it leaves one-row products to ggml), one fused
  multiply-add chain of 16 lanes per output over the row, then `_mm512_reduce_add_ps`
  (lanes i + i+8, + i+4, + i+2, + i+1).
- Otherwise `ggml_vec_dot_f32`: four 16-lane accumulators over chunks of 64, folded
  (0+2, 1+3, then 0+1) and reduced the same way, then the leftover elements added one by
  one, `sum += x * y` with two roundings (not contracted: the contracted form parts from
  llama.cpp's tokens on the SmolLM2 adapter golden, this one gives them all).
The 16-lane orders are those of an AVX-512 build (`ggml_math.ggml_width`), as the other
`ggml_*` kernels assume; tests/integration/test_lora_engine.py checks them on llama.cpp's
tokens.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.intrinsics import fma_f32

LANES = 16


@numba.njit(inline="always", cache=True)
def _reduce16(acc):  # type: ignore[no-untyped-def]
    t0 = acc[8] + acc[0]
    t1 = acc[9] + acc[1]
    t2 = acc[10] + acc[2]
    t3 = acc[11] + acc[3]
    t4 = acc[12] + acc[4]
    t5 = acc[13] + acc[5]
    t6 = acc[14] + acc[6]
    t7 = acc[15] + acc[7]
    u0, u1, u2, u3 = t4 + t0, t5 + t1, t6 + t2, t7 + t3
    v0, v1 = u0 + u2, u1 + u3
    return v0 + v1


@numba.njit(inline="always", cache=True)
def _tiny_dot(x, w, t, r, acc):  # type: ignore[no-untyped-def]
    for lane in range(LANES):
        acc[lane] = np.float32(0.0)
    for start in range(0, x.shape[1], LANES):
        for lane in range(LANES):
            acc[lane] = fma_f32(x[t, start + lane], w[r, start + lane], acc[lane])
    return _reduce16(acc)


@numba.njit(inline="always", cache=True)
def _vec_dot(x, w, t, r, acc):  # type: ignore[no-untyped-def]
    k = x.shape[1]
    whole = k - k % 64
    for i in range(4 * LANES):
        acc[i] = np.float32(0.0)
    for start in range(0, whole, 64):
        for j in range(4):
            for lane in range(LANES):
                i = start + j * LANES + lane
                acc[j * LANES + lane] = fma_f32(x[t, i], w[r, i], acc[j * LANES + lane])
    for lane in range(LANES):
        acc[lane] = (acc[lane] + acc[2 * LANES + lane]) + \
            (acc[LANES + lane] + acc[3 * LANES + lane])
    total = _reduce16(acc)
    for i in range(whole, k):
        total = total + x[t, i] * w[r, i]
    return total


@numba.njit(parallel=True, cache=True)
def matmul_f32(x, w, alone, out):  # type: ignore[no-untyped-def]
    """out[T, R] = x[T, K] . w[R, K] row by row, in ggml's order (see the module); alone[t]:
    row t is its request's only row in the step."""
    tiny = x.shape[1] % LANES == 0
    for t in prange(x.shape[0]):
        acc = np.empty(4 * LANES, np.float32)
        for r in range(w.shape[0]):
            if tiny and not alone[t]:
                out[t, r] = _tiny_dot(x, w, t, r, acc)
            else:
                out[t, r] = _vec_dot(x, w, t, r, acc)


def ggml_matmul_f32(x: np.ndarray, w: np.ndarray, alone: np.ndarray) -> np.ndarray:
    """x [T, K] @ w[R, K].T as llama.cpp's `ggml_mul_mat(w, x)` computes it (float32), each
    row as its request's step would alone (`alone`: bool [T], a one-row request)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    matmul_f32(x, np.ascontiguousarray(w, dtype=np.float32), alone, out)
    return out
