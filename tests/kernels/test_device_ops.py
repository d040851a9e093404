"""Every device-backend op (OpenCL, CUDA) against the numpy reference on random inputs (never
zeros).

OpenCL runs on the first OpenCL device (PoCL on the CPU in CI); CUDA runs where CuPy sees a
GPU and is skipped, with the reason, elsewhere. Tolerances, float32:
elementwise ops and copies 1e-6 relative (exact where nothing is computed); reductions over
the hidden size (matmuls, RMSNorm, attention) 2e-5 of the output's scale, since the kernels
sum in a different order than BLAS.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants
from quant_blocks import random_blocks

from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.kernels.ops import AttentionMetadata, RopeTables
from vllm_actors.loaders.weights import RawTensor
from vllm_actors.models.base import rope_cos_sin

REF = NumpyBackend()
RNG = np.random.default_rng(1234)


def rand(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) + 0.1).astype(np.float32)


def f32(name: str, array: np.ndarray) -> RawTensor:
    return RawTensor(name, array.shape, int(QT.F32), array)


def close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    scale = float(np.abs(want).max())
    assert scale > 0
    assert float(np.abs(got - want).max()) <= rel * scale


def test_embedding_add_silu_split(dev):
    table = rand(50, 24)
    ids = np.array([3, 0, 49, 3, 17])
    h = dev.embedding(dev.upload_table(f32("t", table)), ids)
    assert np.array_equal(dev.to_host(h), table[ids])
    y = rand(5, 24)
    close(dev.to_host(dev.add(h, dev.upload_array(y))), table[ids] + y, 1e-6)
    gate_up = rand(5, 32)
    close(dev.to_host(dev.silu_mul(dev.upload_array(gate_up))), REF.silu_mul(gate_up), 1e-6)
    qkv = rand(5, (4 + 2 * 2) * 8)
    for got, want in zip(dev.split_qkv(dev.upload_array(qkv), 4, 2, 8),
                         REF.split_qkv(qkv, 4, 2, 8)):
        assert np.array_equal(dev.to_host(got), want)


@pytest.mark.parametrize("shape", [(7, 576), (5, 3, 64)])
def test_rms_norm(dev, shape):
    x, w = rand(*shape), rand(shape[-1])
    got = dev.rms_norm(dev.upload_array(x), dev.upload_array(w), 1e-5)
    close(dev.to_host(got), REF.rms_norm(x, w, 1e-5), 2e-5)


@pytest.mark.parametrize("shape", [(7, 577), (5, 3, 33), (4, 3)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_layer_norm(dev, shape, with_bias):
    x = rand(*shape) * 2 + 5     # rows far from mean 0: the kernel has to center them
    w, b = rand(shape[-1]), rand(shape[-1]) if with_bias else None
    got = dev.layer_norm(dev.upload_array(x), dev.upload_array(w),
                         None if b is None else dev.upload_array(b), 1e-5)
    close(dev.to_host(got), REF.layer_norm(x, w, b, 1e-5), 2e-5)


@pytest.mark.parametrize("approximate", [True, False], ids=["tanh", "erf"])
def test_gelu(dev, approximate):
    gate_up = rand(5, 2 * 37) * 3
    want = REF.gelu_mul(gate_up, approximate)
    close(dev.to_host(dev.gelu_mul(dev.upload_array(gate_up), approximate)), want, 1e-6)
    # the two forms differ by more than 10x the tolerance, so each is checked for itself
    assert np.abs(want - REF.gelu_mul(gate_up, not approximate)).max() > 1e-5 * np.abs(want).max()
    x = rand(6, 129) * 3
    close(dev.to_host(dev.gelu(dev.upload_array(x), approximate)), REF.gelu(x, approximate),
          1e-6)


def test_scale(dev):
    x = rand(5, 67)
    got = dev.to_host(dev.scale(dev.upload_array(x), 33.941125))
    assert np.array_equal(got, REF.scale(x.copy(), 33.941125))


@pytest.mark.parametrize("interleaved, rotary_dim", [(False, 16), (True, 16), (False, 8)])
def test_rope(dev, interleaved, rotary_dim):
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    cos, sin = rope_cos_sin(inv_freq, 512)
    positions = np.array([0, 1, 7, 300, 511, 42])
    x = rand(len(positions), 3, 16)
    want = REF.rope(x.copy(), REF.prepare_rope(positions, RopeTables(cos, sin, rotary_dim,
                                                                        interleaved)))
    table = RopeTables(dev.upload_array(cos), dev.upload_array(sin), rotary_dim, interleaved)
    got = dev.rope(dev.upload_array(x), dev.prepare_rope(positions, table))
    close(dev.to_host(got), want, 1e-5)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1,
                                   QT.Q5_0, QT.Q5_1])
def test_linear_and_lm_head(dev, qtype):
    weights = [rand(48, 96), rand(16, 96)]     # fused: two parts along out
    stored = [quants.quantize(w, qtype) for w in weights]
    if qtype == QT.BF16:    # RawTensor keeps BF16 as uint16 [out, in]
        stored = [s.view(np.uint16) for s in stored]
    parts = [RawTensor(f"w{i}", w.shape, int(qtype), s)
             for i, (w, s) in enumerate(zip(weights, stored))]
    x, bias = rand(6, 96), rand(64)
    want = REF.linear(x, REF.upload_linear(parts), bias)   # numpy runs the dequantized weights
    handle = dev.upload_linear(parts)
    assert handle.kernel == f"linear_{qtype.name.lower()}"
    got = dev.linear(dev.upload_array(x), handle, dev.upload_array(bias))
    close(dev.to_host(got), want, 2e-5)
    rows = np.array([5, 0, 2])
    head = parts[0]
    close(dev.lm_head(dev.upload_array(x), dev.upload_lm_head(head), rows),
          REF.lm_head(x, REF.upload_lm_head(head), rows), 2e-5)


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL])
def test_linear_k_quants(dev, qtype):
    """K-quant super-blocks (and IQ4_NL blocks, which gguf-py cannot quantize) of random
    bytes, scales set to sane halves, against numpy's dequantizer, bit-identical to gguf-py's."""
    rows, k = 40, 512
    part = RawTensor("wk", (rows, k), int(qtype), random_blocks(qtype, rows, k, RNG))
    x = rand(3, k)
    want = REF.linear(x, REF.upload_linear([part]))
    handle = dev.upload_linear([part])
    assert handle.kernel == f"linear_{qtype.name.lower()}"
    close(dev.to_host(dev.linear(dev.upload_array(x), handle)), want, 2e-5)


# (query tokens, context after the step) of each request, blocks of 4 tokens: contexts up to
# 230, so that every window tried hides over half the keys of some rows; prompt chunks start
# after cached tokens (20, 200) or at 0.
STEPS = {"decode": ([1, 1, 1], [230, 37, 3]),
         "prefill": ([9, 5, 24], [29, 5, 224]),
         "mixed": ([1, 9, 5, 1], [230, 29, 5, 3])}


def attention_step(q_lens: np.ndarray, seq_lens: np.ndarray, bs: int, num_blocks: int
                   ) -> AttentionMetadata:
    """Each request's blocks drawn at random from blocks 1.. (0 is the null block)."""
    need = -(-seq_lens // bs)
    perm = RNG.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(q_lens), int(need.max()) + 1), np.int32)
    for r, offset in enumerate(np.cumsum(need) - need):
        tables[r, :need[r]] = perm[offset:offset + need[r]]
    positions = np.concatenate([np.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
    return AttentionMetadata(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                             seq_lens, tables, slots, bs)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("window", [0, 1, 5, 16, 100])
@pytest.mark.parametrize("step", list(STEPS))
def test_paged_attention(dev, step, window, softcap):
    """GQA 6 query heads over 2 KV heads, blocks handed out scrambled; scores of up to ~50
    (q scaled up), so that a soft cap of 30 changes them. The device starts from a cache whose
    keys and values before every query's window are NaN: a windowed query must not read them."""
    bs, kv_heads, heads, dh, scale = 4, 2, 6, 16, 0.25
    q_lens, seq_lens = np.array(STEPS[step][0]), np.array(STEPS[step][1], np.int32)
    meta = attention_step(q_lens, seq_lens, bs, num_blocks=80)
    k_cache, v_cache = rand(80, bs, kv_heads, dh), rand(80, bs, kv_heads, dh)
    t = int(q_lens.sum())
    q, k, v = rand(t, heads, dh) * 12, rand(t, kv_heads, dh), rand(t, kv_heads, dh)

    ref_cache = (k_cache.copy(), v_cache.copy())
    ref_attn = REF.prepare_attention(meta)
    REF.reshape_and_cache(k, v, ref_cache, ref_attn)
    want = REF.paged_attention(q, ref_cache, ref_attn, scale, window, softcap)
    if window or softcap:   # the case tests something: plain attention would fail the check
        plain = REF.paged_attention(q, ref_cache, ref_attn, scale)
        assert np.abs(want - plain).max() > 100 * 2e-5 * np.abs(want).max()

    stale = (k_cache.copy(), v_cache.copy())
    for r, first_seen in enumerate(seq_lens - q_lens - window + 1 if window else ()):
        for j in range(max(0, first_seen)):
            for c in stale:
                c[meta.block_tables[r, j // bs], j % bs] = np.nan
    cache = (dev.upload_array(stale[0]), dev.upload_array(stale[1]))
    attn = dev.prepare_attention(meta)
    dev.reshape_and_cache(dev.upload_array(k), dev.upload_array(v), cache, attn)
    REF.reshape_and_cache(k, v, stale, ref_attn)
    assert np.array_equal(dev.to_host(cache[0]), stale[0], equal_nan=True)
    assert np.array_equal(dev.to_host(cache[1]), stale[1], equal_nan=True)
    got = dev.paged_attention(dev.upload_array(q), cache, attn, scale, window, softcap)
    close(dev.to_host(got), want, 2e-5)


def test_sampling_helpers(dev):
    logits = rand(4, 1000)
    logits[2, 17] = logits[2, 900] = 50.0          # a tie goes to the lowest id
    on_device = dev.upload_array(logits)
    assert np.array_equal(dev.argmax(on_device), [17 if r == 2 else int(np.argmax(logits[r]))
                                                  for r in range(4)])
    broken = logits.copy()
    broken[1, 5], broken[3, 999] = np.nan, np.inf     # non-finite rows come back as -1
    assert dev.argmax(dev.upload_array(broken)).tolist() == [int(np.argmax(logits[0])), -1,
                                                               17, -1]
    temperature = np.array([0.5, 0.0, 2.0, 1.0], np.float32)
    want = logits / np.where(temperature > 0, temperature, 1)[:, None]
    close(dev.to_host(dev.apply_temperature(on_device, temperature)), want, 1e-6)
    threshold = np.sort(want, axis=1)[:, -5]        # keep the top 5 of each row
    masked = dev.to_host(dev.mask_below(on_device, threshold))
    assert (np.isfinite(masked).sum(axis=1) == 5).all()
    assert np.array_equal(masked[np.isfinite(masked)], want[want >= threshold[:, None]])


def test_every_kernel_is_defined(dev):
    from vllm_actors.kernels.device_backend import KERNEL_NAMES
    assert set(KERNEL_NAMES) <= set(dev.kernels)
