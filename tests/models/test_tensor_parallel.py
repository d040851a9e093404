"""Tensor-parallel shards of tiny random-weight models give the TP=1 logits.

The ranks run as threads of this process sharing one shared-memory communicator (the same
code the worker processes run; numpy releases the GIL in BLAS). Covered: KV heads split
(llama 2 KV heads at TP=2) and replicated (TP=4; qwen2's single KV head), q/k/v biases,
tied and separate LM heads, Q8_0 row-parallel cuts on and off block boundaries (dequantized
to float32 when off), chunked prompts.
"""

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from model_driver import prompt_logits
from tiny_models import TINY_PROMPT, write_hf_dir, write_llama_gguf
from tp_ranks import TP_TOLERANCE, run_ranks

from vllm_actors.errors import ValidationError
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.base import ModelArgs
from vllm_actors.models.registry import load_model
from vllm_actors.models.sharding import ShardPlan


KV_TP_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-tp")
    write_hf_dir(root / "llama", "llama")
    write_hf_dir(root / "qwen2", "qwen2")
    write_llama_gguf(root / "llama-q8.gguf", qtype=T.Q8_0)
    return {name: resolve_model(root / path) for name, path in
            [("llama", "llama"), ("qwen2", "qwen2"), ("llama-q8", "llama-q8.gguf")]}


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-q8"])
def test_tp_logits_equal_tp1(tiny_sources, name):
    source = tiny_sources[name]
    backend = NumpyBackend()
    expected = prompt_logits(load_model(source, backend), backend, TINY_PROMPT,
                             [17, 1, 1, 21], block_size=8)
    for world_size in (1, 2, 4):
        logits = run_ranks(world_size, lambda group, b: prompt_logits(
            load_model(source, b, group), b, TINY_PROMPT, [17, 1, 1, 21], block_size=8))
        diff = float(np.abs(logits - expected).max())
        print(f"{name} TP={world_size}: max |logits - TP1| = {diff:.2e}")
        assert logits.shape == expected.shape
        assert diff <= TP_TOLERANCE
        assert (logits.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "turboquant_3.5"])
def test_tp_with_a_quantized_kv_cache(tiny_sources, dtype):
    """Each rank's KV heads in the quantized format (turboquant: the same rotation per slot
    on every rank) give TP=1's logits over the same format. Shards sum in another order, so
    a row may land on the other side of a code boundary: logits within KV_TP_TOLERANCE."""
    from vllm_actors.kernels.kv_quant import kv_format
    fmt, source = kv_format(dtype), tiny_sources["llama"]
    backend = NumpyBackend()
    expected = prompt_logits(load_model(source, backend), backend, TINY_PROMPT,
                             [17, 1, 1, 21], block_size=8, kv_format=fmt)
    plain = prompt_logits(load_model(source, backend), backend, TINY_PROMPT, [17, 1, 1, 21],
                          block_size=8)
    assert float(np.abs(plain - expected).max()) > 10 * TP_TOLERANCE   # the format mattered
    logits = run_ranks(2, lambda group, b: prompt_logits(
        load_model(source, b, group), b, TINY_PROMPT, [17, 1, 1, 21], block_size=8,
        kv_format=fmt))
    diff = float(np.abs(logits - expected).max())
    print(f"{dtype} TP=2: max |logits - TP1| = {diff:.2e}")
    assert diff <= KV_TP_TOLERANCE


SMOL = ModelArgs("llama", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                 head_dim=64, intermediate_size=1536, vocab_size=49152, rms_norm_eps=1e-5,
                 rope_theta=1e4, max_position_embeddings=8192, rotary_dim=64)


def test_shard_plan_for_smollm2_at_tp3():
    plans = [ShardPlan.build(SMOL, r, 3) for r in range(3)]
    assert [p.heads for p in plans] == [(0, 3), (3, 6), (6, 9)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 2), (2, 3)]
    assert [p.ffn for p in plans] == [(0, 512), (512, 1024), (1024, 1536)]
    assert plans[0].vocab_widths == [16384] * 3
    assert plans[2].local_args.num_heads == 3 and plans[2].local_args.num_kv_heads == 1
    assert not plans[0].gathered
    # llama.cpp's order: o_proj and down split by output rows, whole runs of 16
    gathered = [ShardPlan.build(replace(SMOL, hidden_size=600), r, 3, gathered=True)
                for r in range(3)]
    assert [p.hidden for p in gathered] == [(0, 208), (208, 416), (416, 600)]
    assert gathered[0].gathered and gathered[0].hidden_widths == (208, 208, 184)
    narrow = ShardPlan.build(replace(SMOL, hidden_size=50), 0, 3, gathered=True)
    assert narrow.hidden_widths == (17, 17, 16)        # no rank without rows


def test_kv_heads_replicated_when_fewer_than_ranks():
    args = ModelArgs("llama", 64, 1, num_heads=8, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, vocab_size=10, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=16, rotary_dim=8)
    assert [ShardPlan.build(args, r, 4).kv_heads for r in range(4)] == [(0, 1), (0, 1),
                                                                       (1, 2), (1, 2)]
    uneven = ShardPlan.build(replace(args, num_heads=12, num_kv_heads=3, intermediate_size=48),
                             2, 3)
    assert uneven.vocab == (8, 10) and uneven.vocab_widths == [4, 4, 2]


@pytest.mark.parametrize("args, size, message", [
    (SMOL, 2, "9 attention heads are not divisible by --tensor-parallel-size 2"),
    (SMOL, 9, "MLP width 1536 is not divisible by --tensor-parallel-size 9"),
    (replace(SMOL, num_heads=12, num_kv_heads=8), 3,
     "8 KV heads and --tensor-parallel-size 3 do not divide one another"),
])
def test_indivisible_sizes_are_explained(args, size, message):
    with pytest.raises(ValidationError, match=message) as info:
        ShardPlan.build(args, 0, size)
    assert info.value.param == "tensor_parallel_size"
