"""LoRA deltas on the host (numpy and the compiled CPU backend): `y[rows] += scale * B (A x)`
for one adapter's rows, every part of a fused linear from one product with the stacked A.

Float order: x's rows times A, each part's rank columns times its B, that product scaled,
then added to y: PEFT's `lora_B(lora_A(x)) * scaling` and llama.cpp's `build_lora_mm`
(`ggml_add(res, ggml_scale(mul_mat(b, mul_mat(a, x)), scale))`) alike."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from vllm_actors.kernels.ggml_matmul_f32 import ggml_matmul_f32


def _blas(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x @ w.T


def lora_add(y: np.ndarray, x: np.ndarray, rows: np.ndarray | None, a: np.ndarray,
             parts: Sequence[tuple[np.ndarray, int, int, float]],
             alone: np.ndarray | None = None) -> np.ndarray:
    """y [T, N] plus the adapter's delta on `rows` (indices into T; None: every row), in
    place; returns y. a: [R, K] stacked A of the parts; parts: (B [n, r], first rank row in
    a, first output column, scale). alone: bool [T], whether each row is its request's only
    row in the step; given, both products follow llama.cpp's float order
    (`ggml_matmul_f32`), else BLAS's."""
    if alone is None:
        matmul = _blas
    else:
        flags = alone if rows is None else alone[rows]
        matmul = functools.partial(ggml_matmul_f32, alone=flags)
    xs = x if rows is None else x[rows]
    xa = matmul(xs, a)                                      # [rows, R]
    for b, r0, col, scale in parts:
        r = b.shape[1]
        delta = matmul(xa[:, r0:r0 + r], b)
        delta *= np.float32(scale)
        if rows is None:
            y[:, col:col + b.shape[0]] += delta
        else:
            y[rows, col:col + b.shape[0]] += delta
    return y
