"""LoRA deltas on the host (numpy and the compiled CPU backend): `y[rows] += scale * B (A x)`
for one adapter's rows, every part of a fused linear from one product with the stacked A.

Float order: x's rows times A, each part's rank columns times its B, that product scaled,
then added to y: PEFT's `lora_B(lora_A(x)) * scaling` and llama.cpp's `build_lora_mm`
(`ggml_add(res, ggml_scale(mul_mat(b, mul_mat(a, x)), scale))`) alike. The numpy backend
multiplies with BLAS; the compiled one in one call per adapter and linear, in llama.cpp's
orders (`lora_add_ggml`, exact under the quantized semantics, and as good as any order
under float32)."""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_actors.kernels.ggml_matmul_f32 import (SERIAL_MAX_WORK, lora_delta_parallel,
                                                  lora_delta_serial, pack)


def lora_add(y: np.ndarray, x: np.ndarray, rows: np.ndarray | None, lora: Any) -> np.ndarray:
    """y [T, N] plus the adapter's delta on `rows` (indices into T; None: every row), in
    place, through BLAS; returns y. lora: a `models.lora.LinearLoRA` in its plain layout
    (a: [R, K] stacked A of the parts; each part's B transposed in b_t's columns)."""
    xs = x if rows is None else x[rows]
    xa = xs @ lora.a.T                                      # [rows, R]
    for (r0, r, col, n, b0), scale in zip(lora.meta.tolist(), lora.scales):
        delta = xa[:, r0:r0 + r] @ lora.b_t[:r, b0:b0 + n]
        delta *= scale
        if rows is None:
            y[:, col:col + n] += delta
        else:
            y[rows, col:col + n] += delta
    return y


def warm_up_lora(half: bool = False) -> None:
    """Compile the LoRA kernels (both thread variants) for float32 or float16 weights before
    the first request needs them (compiled once, then read from numba's cache)."""
    x = np.zeros((2, 16), np.float32)
    a, tiles, parts = pack(np.zeros((16, 16), np.float32), np.zeros((16, 16), np.float32),
                           np.array([[0, 16, 0, 16, 0]], np.int64), half)
    for kernel in (lora_delta_serial, lora_delta_parallel):
        kernel(np.zeros((2, 16), np.float32), x, np.arange(2, dtype=np.int64), a, tiles,
               parts, np.ones(1, np.float32), np.zeros(2, np.bool_), half)


def lora_add_ggml(y: np.ndarray, x: np.ndarray, rows: np.ndarray, lora: Any,
                  alone: np.ndarray, round_x: bool = False) -> np.ndarray:
    """`lora_add` in one compiled call (`ggml_matmul_f32._lora_delta`, `lora` in the
    layout of `ggml_matmul_f32.pack`), both products in llama.cpp's float order; rows: int64
    token rows; alone: bool [T], each row its request's only row in the step; round_x: F16
    weights under llama.cpp's semantics (its vec_dot rounds their inputs to float16). On the
    calling thread when small (waking the threads for two parallel loops costs about 20 us)."""
    small = len(rows) * lora.work <= SERIAL_MAX_WORK
    kernel = lora_delta_serial if small else lora_delta_parallel
    kernel(y, np.ascontiguousarray(x, dtype=np.float32), rows, lora.a, lora.b_t, lora.meta,
           lora.scales, alone, round_x)
    return y
