"""Our vectorized dequantizers against gguf-py's reference, bit for bit, on random blocks."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from vllm_actors.kernels.quant import (BLOCK_FIELDS, BLOCK_OFFSETS, block_layout, dequantize,
                                      is_supported)

TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
         T.Q5_K, T.Q6_K]
# Byte offsets of the float16 scale fields in each block type (kept finite in the test data).
F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
              T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
              T.IQ4_NL: [0]}


def random_blocks(qtype: T, num_rows: int, row_len: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block_size, type_size = block_layout(qtype)
    if qtype in (T.F32, T.F16, T.BF16):
        values = rng.standard_normal((num_rows, row_len)).astype(np.float32)
        if qtype == T.F16:
            return values.astype(np.float16).view(np.uint8)
        if qtype == T.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.view(np.uint8)
    blocks = rng.integers(0, 256, (num_rows * row_len // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(num_rows, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype):
    raw = random_blocks(qtype, num_rows=6, row_len=512, seed=int(qtype))
    expected = gguf_quants.dequantize(raw, qtype)
    ours = dequantize(raw, qtype, expected.shape)
    assert ours.dtype == np.float32
    assert ours.shape == (6, 512)
    assert np.array_equal(ours, expected)
    assert np.isfinite(ours).all() and np.abs(ours).max() > 0


def test_dequantize_chunks_large_tensors_identically():
    raw = random_blocks(T.Q4_K, num_rows=300, row_len=256 * 300, seed=7)  # > one chunk
    expected = gguf_quants.dequantize(raw, T.Q4_K)
    assert np.array_equal(dequantize(raw, T.Q4_K, expected.shape), expected)


def test_fallback_type_uses_gguf_reference():
    iq4 = np.random.default_rng(0).integers(0, 256, (2, 2 * 18), dtype=np.uint8)  # IQ4_NL
    iq4[:, 0:2] = np.array([0.01], np.float16).view(np.uint8)
    iq4[:, 18:20] = np.array([0.02], np.float16).view(np.uint8)
    expected = gguf_quants.dequantize(iq4, T.IQ4_NL)
    assert np.array_equal(dequantize(iq4, T.IQ4_NL, expected.shape), expected)


def test_supported_types():
    assert all(is_supported(t) for t in TYPES)
    assert not is_supported(T.I32)
    assert not is_supported(9999)


@pytest.mark.parametrize("qtype", list(BLOCK_FIELDS), ids=lambda t: T(t).name)
def test_block_fields_match_ggml_layout(qtype):
    """The layouts the device kernels read (BLOCK_FIELDS) fill GGML's block exactly, and put
    the half-float scales where this file's own table does."""
    assert sum(size for _, size in BLOCK_FIELDS[qtype]) == block_layout(qtype)[1]
    halves = [off for name, off in BLOCK_OFFSETS[qtype].items() if name in ("d", "m", "dmin")]
    assert sorted(halves) == sorted(F16_FIELDS[qtype])
