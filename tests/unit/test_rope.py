"""RoPE pairings at several positions (at position 0 every pairing is the identity)."""

import math
from dataclasses import replace

import numpy as np
import pytest
from tiny_models import det_uniform, llama_cpp_permute

from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.kernels.ops import RopeTables
from vllm_actors.models.base import (ModelArgs, rope_attention_factor, rope_cos_sin,
                                     rope_inv_freq)

HEAD_DIM = 16
POSITIONS = np.array([0, 1, 5, 37, 200, 1023])


def tables(interleaved: bool, rotary_dim: int = HEAD_DIM) -> RopeTables:
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim))
    cos, sin = rope_cos_sin(inv_freq.astype(np.float32), 1024)
    return RopeTables(cos, sin, rotary_dim, interleaved)


def rotate(x: np.ndarray, table: RopeTables) -> np.ndarray:
    """The backend's RoPE on a copy (it may rotate in place)."""
    backend = NumpyBackend()
    out = backend.rope(x.copy(), backend.prepare_rope(POSITIONS, table))
    assert out.shape == x.shape
    return out


def reference_neox(x: np.ndarray, positions: np.ndarray, rotary_dim: int) -> np.ndarray:
    """Complex-number form: pair (i, i + d/2) rotated by position * theta_i, in float64."""
    half = rotary_dim // 2
    theta = 1.0 / (10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim))
    z = x[..., :half].astype(np.float64) + 1j * x[..., half:rotary_dim]
    z = z * np.exp(1j * positions[:, None, None] * theta)
    out = x.astype(np.float64).copy()
    out[..., :half], out[..., half:rotary_dim] = z.real, z.imag
    return out


def test_neox_matches_complex_rotation():
    x = det_uniform((len(POSITIONS), 3, HEAD_DIM), seed=5)
    ours = rotate(x, tables(False))
    assert np.abs(ours - reference_neox(x, POSITIONS, HEAD_DIM)).max() < 1e-5
    assert np.array_equal(ours[0], x[0])  # position 0 is the identity
    assert np.abs(ours[1:] - x[1:]).max() > 0.1


def test_interleaved_on_permuted_rows_equals_neox():
    """llama.cpp permutes Q/K rows so that adjacent-pair RoPE on them equals NeoX RoPE on the
    original rows: q.k scores agree at every position."""
    w = det_uniform((2 * HEAD_DIM, 24), seed=9)        # 2 heads
    h = det_uniform((len(POSITIONS), 24), seed=10)
    neox = rotate((h @ w.T).reshape(-1, 2, HEAD_DIM), tables(False))
    perm = rotate((h @ llama_cpp_permute(w, 2).T).reshape(-1, 2, HEAD_DIM), tables(True))
    # same vectors up to the within-head permutation -> identical dot products
    scores_neox = np.einsum("thd,shd->hts", neox, neox)
    scores_perm = np.einsum("thd,shd->hts", perm, perm)
    assert np.abs(scores_neox - scores_perm).max() < 1e-4
    wrong = rotate((h @ llama_cpp_permute(w, 2).T).reshape(-1, 2, HEAD_DIM), tables(False))
    assert np.abs(np.einsum("thd,shd->hts", wrong, wrong) - scores_neox).max() > 1e-2


def test_partial_rotary_leaves_the_rest():
    x = det_uniform((len(POSITIONS), 2, HEAD_DIM), seed=11)
    out = rotate(x, tables(False, rotary_dim=8))
    assert np.array_equal(out[..., 8:], x[..., 8:])
    assert np.abs(out[..., :8] - reference_neox(x, POSITIONS, 8)[..., :8]).max() < 1e-5


def _args(**scaling) -> ModelArgs:
    return ModelArgs("llama", 64, 1, 4, 4, 16, 32, 10, 1e-5, 10000.0, 128, 16,
                     rope_scaling=scaling)


def test_linear_scaling_divides_frequencies():
    base = rope_inv_freq(_args())
    assert np.allclose(rope_inv_freq(_args(rope_type="linear", factor=4.0)), base / 4)


def test_unknown_scaling_is_rejected():
    from vllm_actors.errors import UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'mrope'.*dynamic"):
        rope_inv_freq(_args(rope_type="mrope", factor=4.0))


def test_longrope_picks_its_factors_by_the_serving_context():
    """128 positions, original 32: long factors unless the context fits the original."""
    short, long = [1.0, 1.1, 1.2, 1.3] * 2, [1.0, 2.0, 4.0, 8.0] * 2
    args = _args(rope_type="longrope", short_factor=short, long_factor=long,
                 original_max_position_embeddings=32)
    base = rope_inv_freq(_args())
    assert np.allclose(rope_inv_freq(args), base / np.float32(long), rtol=1e-6)
    within = replace(args, context_len=32)
    assert np.allclose(rope_inv_freq(within), base / np.float32(short), rtol=1e-6)
    assert rope_attention_factor(args) == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))


def test_dynamic_ntk_is_plain_rope_within_the_original_context():
    args = _args(rope_type="dynamic", factor=2.0, original_max_position_embeddings=64)
    base = rope_inv_freq(_args())
    assert np.array_equal(rope_inv_freq(replace(args, context_len=64)), base)
    theta = 10000.0 * ((2.0 * 128 / 64) - 1) ** (16 / 14)      # context 128 = max positions
    expected = 1.0 / (np.float32(theta) ** (np.arange(0, 16, 2, dtype=np.float32) / 16))
    assert np.allclose(rope_inv_freq(args), expected, rtol=1e-6)


def test_yarn_without_its_original_context_is_explained():
    from vllm_actors.errors import ModelFormatError
    with pytest.raises(ModelFormatError, match="original_max_position_embeddings"):
        rope_inv_freq(_args(rope_type="yarn", factor=4.0))
