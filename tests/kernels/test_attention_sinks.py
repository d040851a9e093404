"""Attention sinks (gpt-oss): one more softmax column per head with a learned logit and no
value. Every backend against a direct per-token computation (not against each other): decode,
prefill and mixed steps, with and without a sliding window, GQA, a long decode that the
compiled CPU backend splits across threads (its partial states merge with the sink counted
once), and sinks large enough to take most of the weight."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from opencl_platform import require_opencl

from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.kernels.ops import AttentionMetadata
from vllm_actors.loaders.weights import RawTensor

RNG = np.random.default_rng(77)
BS, KV_HEADS, HEADS, DH, SCALE = 4, 2, 6, 16, 0.3
STEPS = {"decode": ([1, 1, 1], [230, 37, 3]),
         "prefill": ([9, 5, 24], [29, 5, 224]),
         "mixed": ([1, 9, 5, 1], [230, 29, 5, 3]),
         "long-decode": ([1, 1], [3000, 1500])}


def backend(name: str):
    if name == "numpy":
        return NumpyBackend()
    if name == "cpu":
        from vllm_actors.kernels.cpu.backend import CpuBackend
        return CpuBackend()
    if name == "opencl":
        require_opencl()
        from vllm_actors.kernels.opencl.backend import OpenCLBackend
        return OpenCLBackend()
    from vllm_actors.kernels.cuda.backend import CudaBackend, cuda_available
    if not cuda_available():
        pytest.skip("no CUDA GPU visible to CuPy")
    return CudaBackend()


def expected(q, keys, values, q_lens, seq_lens, window, sinks) -> np.ndarray:
    """Per token and head, in float64: softmax over the visible keys' scores and the sink."""
    out, t = np.zeros(q.shape), 0
    g = HEADS // KV_HEADS
    for r, (n, total) in enumerate(zip(q_lens, seq_lens)):
        for p in range(total - n, total):
            first = max(0, p - window + 1) if window else 0
            for h in range(HEADS):
                k = keys[r][first:p + 1, h // g].astype(np.float64)
                v = values[r][first:p + 1, h // g].astype(np.float64)
                logits = np.append(k @ q[t, h].astype(np.float64) * SCALE, sinks[h])
                weights = np.exp(logits - logits.max())
                weights /= weights.sum()
                out[t, h] = weights[:-1] @ v
            t += 1
    return out


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("name", ["numpy", "cpu", "opencl", "cuda"])
def test_attention_sinks_match_a_direct_computation(name, step, window):
    dev = backend(name)
    q_lens, seq_lens = np.array(STEPS[step][0]), np.array(STEPS[step][1], np.int32)
    need = -(-seq_lens // BS)
    num_blocks = int(need.sum()) + 1
    perm = RNG.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(q_lens), int(need.max())), np.int32)
    for r, offset in enumerate(np.cumsum(need) - need):
        tables[r, :need[r]] = perm[offset:offset + need[r]]
    keys = [RNG.standard_normal((s, KV_HEADS, DH)).astype(np.float32) for s in seq_lens]
    values = [RNG.standard_normal((s, KV_HEADS, DH)).astype(np.float32) for s in seq_lens]
    k_cache = np.zeros((num_blocks, BS, KV_HEADS, DH), np.float32)
    v_cache = np.zeros_like(k_cache)
    for r, s in enumerate(seq_lens):     # the context before this step, already cached
        for j in range(s - q_lens[r]):
            k_cache[tables[r, j // BS], j % BS] = keys[r][j]
            v_cache[tables[r, j // BS], j % BS] = values[r][j]
    positions = np.concatenate([np.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = tables[rows, positions // BS].astype(np.int64) * BS + positions % BS
    meta = AttentionMetadata(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                             seq_lens, tables, slots, BS)
    k = np.stack([keys[r][p] for r, p in zip(rows, positions)])
    v = np.stack([values[r][p] for r, p in zip(rows, positions)])
    q = RNG.standard_normal((len(rows), HEADS, DH)).astype(np.float32) * 2
    sinks = np.array([0.0, 3.0, -2.0, 8.0, 1.5, 20.0], np.float32)   # 20: nearly all sink
    want = expected(q, keys, values, q_lens, seq_lens, window, sinks)

    cache = (dev.upload_array(k_cache), dev.upload_array(v_cache))
    if name == "cpu":
        from vllm_actors.kernels.cpu.attention import allocate_kv_cache
        cache = allocate_kv_cache(1, num_blocks, BS, KV_HEADS, DH)[0]
        cache[0][:], cache[1][:] = k_cache, v_cache
    attn = dev.prepare_attention(meta)
    dev.reshape_and_cache(dev.upload_array(k), dev.upload_array(v), cache, attn)
    sink_logits = dev.upload_vector(RawTensor("sinks", (HEADS,), int(QT.F32), sinks))
    got = dev.to_host(dev.paged_attention(dev.upload_array(q), cache, attn, SCALE, window,
                                          0.0, sink_logits))
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
    plain = dev.to_host(dev.paged_attention(dev.upload_array(q), cache, attn, SCALE, window))
    assert np.abs(plain - want).max() > 0.1 * np.abs(want).max()   # the sinks mattered
