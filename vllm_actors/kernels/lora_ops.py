"""LoRA deltas on the host (numpy and the compiled CPU backend): `y[rows] += scale * B (A x)`
for one adapter's rows, every part of a fused linear from one product with the stacked A.

Float order: x's rows times A (BLAS), each part's rank columns scaled, times its B (BLAS),
added to y. The same order as PEFT's `lora_B(lora_A(x)) * scaling` up to where the scale is
applied (on the rank-sized product here, which is cheaper than on the output)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def lora_add(y: np.ndarray, x: np.ndarray, rows: np.ndarray | None, a: np.ndarray,
             parts: Sequence[tuple[np.ndarray, int, int, float]]) -> np.ndarray:
    """y [T, N] plus the adapter's delta on `rows` (indices into T; None: every row), in
    place; returns y. a: [R, K] stacked A of the parts; parts: (B [n, r], first rank row in
    a, first output column, scale)."""
    xs = x if rows is None else x[rows]
    xa = xs @ a.T                                           # [rows, R]
    for b, r0, col, scale in parts:
        r = b.shape[1]
        delta = (xa[:, r0:r0 + r] * np.float32(scale)) @ b.T
        if rows is None:
            y[:, col:col + b.shape[0]] += delta
        else:
            y[rows, col:col + b.shape[0]] += delta
    return y
