"""The compiled backend's LoRA kernel (`ggml_matmul_f32`) against a float64 reference on
random adapters: three parts of ranks 7, 16 and 70 (a fused linear; B's products then take
vec_dot's leftovers only, tinyBLAS, and vec_dot's chunks of 64), contractions of A with and
without chunks and leftovers (K = 200, 64, 48), requests of one row and of several, the
parallel and the serial build, weights stored as float32 and as float16.

The reference is exact math on the same inputs (float64), so the bound is float32 summation
order: 1e-5 of sum |B| |A| |x| per output, well above float32's rounding of one sum of a few
hundred terms (about sqrt(K) * 2^-24 = 1e-6 of it) and far below what a wrong layout or a
dropped part gives. `round_x` (F16 weights under llama.cpp's semantics) must equal the
reference on float16-rounded inputs, and miss the bound against the unrounded one; the
bit-exact float order itself is checked on llama.cpp's tokens
(tests/integration/test_lora_engine.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_actors.kernels.ggml_matmul_f32 import OUT_BLOCK, pack
from vllm_actors.kernels.lora_ops import lora_add_ggml

RANKS = (7, 16, 70)      # 93 rows of A: the last pair padded
WIDTHS = (300, 40, 20)       # the first part spans two tiles of B


def _adapter(k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(A [sum r, K], b_t [max r, sum n], meta, scales), values exact in float16."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((sum(RANKS), k)).astype(np.float16).astype(np.float32)
    b_t = np.zeros((max(RANKS), sum(WIDTHS)), np.float32)
    meta, r0, col = [], 0, 0
    for r, n in zip(RANKS, WIDTHS):
        b_t[:r, col:col + n] = rng.standard_normal((r, n)).astype(np.float16)
        meta.append((r0, r, col + 7, n, col))         # outputs start at column 7 of y
        r0, col = r0 + r, col + n
    return a, b_t, np.array(meta, np.int64), np.array([0.5, 2.0, 1.0], np.float32)


def _reference(y, x, a, b_t, meta, scales, half_inputs):  # type: ignore[no-untyped-def]
    """(y plus the delta in float64, sum |B| |A| |x| per output)."""
    round16 = (lambda v: v.astype(np.float16).astype(np.float64)) if half_inputs \
        else (lambda v: v.astype(np.float64))
    out, size = y.astype(np.float64), np.zeros_like(y, np.float64)
    xs = round16(x)
    for (r0, r, col, n, b0), scale in zip(meta.tolist(), scales):
        xa = round16((xs @ a[r0:r0 + r].T.astype(np.float64)).astype(np.float32))
        b = b_t[:r, b0:b0 + n].astype(np.float64)
        out[:, col:col + n] += scale * (xa @ b)
        size[:, col:col + n] += scale * (np.abs(xs) @ np.abs(a[r0:r0 + r].T) @ np.abs(b))
    return out, size


@pytest.mark.parametrize("k", [200, 64, 48])
def test_lora_kernel_layouts_and_float16_weights(k):
    a, b_t, meta, scales = _adapter(k, seed=k)
    rng = np.random.default_rng(1)
    rows = np.arange(5, dtype=np.int64)
    x = rng.standard_normal((5, k)).astype(np.float32)
    y0 = rng.standard_normal((5, 7 + sum(WIDTHS) + 3)).astype(np.float32)
    a_p, tiles, packed = pack(a, b_t, meta)
    assert a_p.shape == ((len(a) + 1) // 2 * 2 * k,)
    assert tiles.shape[1:] == (OUT_BLOCK // 16, max(RANKS), 16) and tiles.flags.c_contiguous
    assert packed[:, 4].tolist() == [0, 2, 3]         # 300 outputs take tiles 0 and 1
    for half in (False, True):
        a_p, tiles, packed = pack(a, b_t, meta, half)
        assert a_p.dtype == (np.uint16 if half else np.float32)
        work = 10 ** 7 if half else 1                 # the parallel build, then the serial
        lora = SimpleNamespace(a=a_p, b_t=tiles, meta=packed, scales=scales, work=work)
        for alone in (np.ones(5, bool), np.zeros(5, bool)):
            for round_x in ((False, True) if half else (False,)):
                got = lora_add_ggml(y0.copy(), x, rows, lora, alone, round_x)
                want, size = _reference(y0, x, a, b_t, meta, scales, round_x)
                assert np.all(np.abs(got - want) <= 1e-5 * size + 1e-6), (half, alone[0])
                assert np.array_equal(got[:, :7], y0[:, :7])      # outside the parts: as is
                if round_x:
                    plain, _ = _reference(y0, x, a, b_t, meta, scales, False)
                    assert not np.all(np.abs(got - plain) <= 1e-5 * size + 1e-6)


@pytest.mark.parametrize("qtype,k", [("Q4_1", 96), ("Q4_1", 768), ("Q4_K", 768)])
def test_delta_inside_the_gemv_is_the_gemv_then_the_delta(qtype, k):
    """A one-row step's adapted linear in one call (`matmul_float_lora` of `qmatmul_int` and
    `qmatmul_int_k`) gives the base GEMV followed by the separate delta call bit for bit:
    parts whose outputs start off the GEMV's 32-row chunks (column 7), on one thread (K =
    96) and two (K = 768), float32 and float16 weights with and without rounded inputs."""
    from gguf import GGMLQuantizationType as T
    from quant_blocks import random_blocks

    from vllm_actors.kernels.cpu import qmatmul, qmatmul_int, qmatmul_int_k
    a, b_t, meta, scales = _adapter(k, seed=k)
    rng = np.random.default_rng(2)
    n, qtype = 7 + sum(WIDTHS) + 3, T[qtype]
    w = qmatmul.pack(random_blocks(qtype, n, k, rng), qtype, (n, k))
    integer = qmatmul_int_k if qtype == T.Q4_K else qmatmul_int
    x = rng.standard_normal((1, k)).astype(np.float32)
    base = integer.matmul_float(w, x)
    for half, round_x in ((False, False), (True, False), (True, True)):
        a_p, tiles, packed = pack(a, b_t, meta, half)
        lora = SimpleNamespace(a=a_p, b_t=tiles, meta=packed, scales=scales, work=1,
                               half=half, memo={})
        want = lora_add_ggml(base.copy(), x, np.zeros(1, np.int64), lora, np.ones(1, bool),
                             round_x)
        got = integer.matmul_float_lora(w, x, lora, round_x)
        assert np.array_equal(got, want), (half, round_x)
