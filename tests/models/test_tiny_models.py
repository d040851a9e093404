"""Tiny random-weight llama / qwen2 / qwen3 / mistral against transformers (fp32 goldens), and
the same llama weights as GGUF (llama.cpp Q/K permutation, rope_freqs) against safetensors."""

import json

import numpy as np
import pytest
from golden_files import GOLDEN
from gguf import GGMLQuantizationType as T
from model_driver import prompt_logits
from tiny_models import (TINY_CONFIGS, TINY_PROMPT, tiny_weights, write_hf_dir,
                         write_llama_gguf, write_safetensors)

from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.registry import load_model

GOLDEN_LOGITS = np.load(GOLDEN / "tiny_models.npz")
TOLERANCE = 1e-4  # absolute, on logits of magnitude ~1-10


@pytest.fixture(scope="module")
def backend():
    return NumpyBackend()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    for name in TINY_CONFIGS:
        write_hf_dir(root / name, name)
    return root


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
@pytest.mark.parametrize("chunks", [None, [17, 1, 1, 21]], ids=["one-step", "chunked"])
def test_tiny_model_matches_transformers(tiny_dirs, backend, name, chunks):
    model = load_model(resolve_model(tiny_dirs / name), backend)
    logits = prompt_logits(model, backend, TINY_PROMPT, chunks, block_size=8)
    expected = GOLDEN_LOGITS[name]
    assert logits.dtype == np.float32
    diff = np.abs(logits - expected).max()
    print(f"{name}: max |logits - transformers| = {diff:.2e}")
    assert diff <= TOLERANCE
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


def test_gguf_and_safetensors_give_the_same_logits(tiny_dirs, backend, tmp_path):
    gguf_path = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(gguf_path)
    from_gguf = load_model(resolve_model(gguf_path), backend)
    from_st = load_model(resolve_model(tiny_dirs / "llama"), backend)
    assert from_gguf.args.rope_interleaved and not from_st.args.rope_interleaved
    a = prompt_logits(from_gguf, backend, TINY_PROMPT)
    b = prompt_logits(from_st, backend, TINY_PROMPT)
    assert np.abs(a - b).max() <= 1e-5
    assert np.abs(a - GOLDEN_LOGITS["llama"]).max() <= TOLERANCE


def test_quantized_gguf_stays_close(tiny_dirs, backend, tmp_path):
    """Q8_0 weights perturb logits a little, not a lot (a wrong block layout would)."""
    gguf_path = tmp_path / "tiny-llama-q8.gguf"
    write_llama_gguf(gguf_path, qtype=T.Q8_0)
    logits = prompt_logits(load_model(resolve_model(gguf_path), backend), backend, TINY_PROMPT)
    diff = np.abs(logits - GOLDEN_LOGITS["llama"]).max()
    assert 0 < diff < 0.05


def test_bf16_safetensors(tmp_path, backend):
    """A BF16 checkpoint loads without torch: same logits as F32 weights holding the very
    values BF16 keeps (the upper 16 bits)."""
    config = TINY_CONFIGS["qwen3"]
    weights = tiny_weights(config)
    truncated = {k: (v.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
                 for k, v in weights.items()}
    for sub, tensors, dtype in (("bf16", weights, "BF16"), ("f32", truncated, "F32")):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text(json.dumps(config))
        write_safetensors(tmp_path / sub / "model.safetensors", tensors, dtype=dtype)
    a, b = (prompt_logits(load_model(resolve_model(tmp_path / sub), backend), backend,
                          TINY_PROMPT) for sub in ("bf16", "f32"))
    assert np.array_equal(a, b)
    assert np.abs(a - GOLDEN_LOGITS["qwen3"]).max() > 1e-3  # the rounding did change something


def test_sharded_safetensors(tmp_path, backend):
    config = TINY_CONFIGS["qwen2"]
    weights = tiny_weights(config)
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        write_safetensors(tmp_path / shard, {k: weights[k] for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    logits = prompt_logits(load_model(resolve_model(tmp_path), backend), backend, TINY_PROMPT)
    assert np.abs(logits - GOLDEN_LOGITS["qwen2"]).max() <= TOLERANCE
