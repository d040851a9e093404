"""Every model family beyond llama (dense and mixture-of-experts) on tiny random-weight
checkpoints against transformers (fp32 goldens from tests/oracle/make_golden.py): logits of
prompts of 1, 17 and 300 tokens, in one step and in chunks, on the numpy backend; greedy
tokens over 32 decode steps; tensor parallel at TP=2 where the model shards."""

import dataclasses

import numpy as np
import pytest
from family_models import (CONTEXT_DEPENDENT, FAMILY_CONFIGS, FAMILY_PROMPT, GOLDEN_ROWS,
                           GREEDY_PROMPT_LEN, GREEDY_STEPS, check_greedy, write_family_dir)
from family_gguf import GGUF_ARCH, write_family_gguf
import gguf
from gguf import GGMLQuantizationType
from golden_files import GOLDEN
from model_driver import greedy_tokens, prompt_logits
from tp_ranks import run_ranks

from vllm_actors.errors import ValidationError
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models import registry
from vllm_actors.models.registry import inspect_model, load_model

GOLDEN_FAMILIES = np.load(GOLDEN / "family_models.npz")
TOLERANCE = 1e-4      # absolute, on logits of magnitude ~1-10
NAMES = [n for n in FAMILY_CONFIGS if n not in CONTEXT_DEPENDENT]


@pytest.fixture(scope="module")
def family_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: resolve_model(root / name) for name in FAMILY_CONFIGS
            if write_family_dir(root / name, name) is not None}


def check_rows(logits: np.ndarray, name: str, rows: np.ndarray) -> float:
    expected = GOLDEN_FAMILIES[f"{name}/logits"]
    keep = np.isin(GOLDEN_ROWS, rows)
    got = logits[GOLDEN_ROWS[keep]]
    diff = float(np.abs(got - expected[keep]).max())
    assert diff <= TOLERANCE, f"{name}: max |logits - transformers| = {diff:.2e}"
    assert (got.argmax(-1) == expected[keep].argmax(-1)).all()
    return diff


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length, chunks", [(1, None), (17, None), (17, [5, 1, 11]),
                                            (300, None), (300, [1, 16, 83, 200])],
                         ids=["1", "17", "17-chunked", "300", "300-chunked"])
def test_family_logits_match_transformers(family_sources, name, length, chunks):
    backend = NumpyBackend()
    model = load_model(family_sources[name], backend)
    logits = prompt_logits(model, backend, FAMILY_PROMPT[:length], chunks, block_size=8)
    check_rows(logits, name, np.arange(length))


@pytest.fixture(scope="module")
def cpu_backend():
    from vllm_actors.kernels.cpu.backend import CpuBackend
    return CpuBackend()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("device", ["numpy", "cpu"])
def test_family_greedy_matches_transformers(family_sources, name, device, cpu_backend):
    backend = NumpyBackend() if device == "numpy" else cpu_backend
    model = load_model(family_sources[name], backend)
    tokens = greedy_tokens(model, backend, FAMILY_PROMPT[:GREEDY_PROMPT_LEN], GREEDY_STEPS)
    check_greedy(tokens, name)


@pytest.mark.parametrize("name", NAMES)
def test_family_logits_on_the_compiled_cpu_backend(family_sources, name, cpu_backend):
    model = load_model(family_sources[name], cpu_backend)
    logits = prompt_logits(model, cpu_backend, FAMILY_PROMPT, [1, 16, 83, 200], block_size=8)
    check_rows(logits, name, np.arange(300))


def test_dynamic_ntk_follows_the_serving_context(family_sources):
    """Dynamic NTK is rescaled once for the serving context (vLLM's static rule): loaded for
    a 300-token context it gives transformers' logits of the 300-token forward; within the
    original 128 it is plain RoPE, as transformers' 49-token greedy run; for the default
    context (512) it differs from transformers on the 300-token prompt (the stated gap)."""
    source, backend = family_sources["llama_dynamic"], NumpyBackend()
    model = load_model(source, backend, context_len=300)
    check_rows(prompt_logits(model, backend, FAMILY_PROMPT, [17, 283], block_size=8),
               "llama_dynamic", np.arange(300))
    model = load_model(source, backend, context_len=128)
    check_greedy(greedy_tokens(model, backend, FAMILY_PROMPT[:GREEDY_PROMPT_LEN], GREEDY_STEPS),
                 "llama_dynamic")
    default = prompt_logits(load_model(source, backend), backend, FAMILY_PROMPT, block_size=8)
    golden = GOLDEN_FAMILIES["llama_dynamic/logits"]
    assert np.abs(default[GOLDEN_ROWS] - golden).max() > 1e-2


FULL_QK_NORM = ("olmo2", "olmoe")   # q/k norms over all heads: tensor parallelism refused


@pytest.mark.parametrize("name", [n for n in NAMES if n not in FULL_QK_NORM])
def test_family_tensor_parallel(family_sources, name):
    source = family_sources[name]
    logits = run_ranks(2, lambda group, b: prompt_logits(
        load_model(source, b, group), b, FAMILY_PROMPT[:40], [17, 1, 22], block_size=8))
    check_rows(logits, name, np.arange(40))
    tokens = run_ranks(2, lambda group, b: greedy_tokens(
        load_model(source, b, group), b, FAMILY_PROMPT[:GREEDY_PROMPT_LEN], 8))
    check_greedy(tokens, name)


@pytest.mark.parametrize("name", FULL_QK_NORM)
def test_full_qk_norm_refuses_tensor_parallel(family_sources, name):
    with pytest.raises(ValidationError, match="q/k norms over all heads do not shard"):
        run_ranks(2, lambda group, b: load_model(family_sources[name], b, group))


def test_family_hyper_parameters(family_sources):
    """What each family reads from its config (the goldens test that it is used right)."""
    gemma2 = inspect_model(family_sources["gemma2"])[0].args
    assert gemma2.layer_windows == (8, 0, 8, 0) and gemma2.norm_placement == "sandwich"
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (3.0, 5.0)
    assert gemma2.attn_scale == pytest.approx(24 ** -0.5)
    gemma3 = inspect_model(family_sources["gemma3"])[0].args
    assert gemma3.layer_windows == (8, 8, 0) and gemma3.qk_norm
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (1e6, 1e4)
    assert gemma3.rope_scaling["rope_type"] == "linear"
    phi3 = inspect_model(family_sources["phi3"])[0].args
    assert phi3.rotary_dim == 8 and phi3.layer_windows == (12, 12)
    assert inspect_model(family_sources["stablelm"])[0].args.rotary_dim == 4
    qwen2_moe = inspect_model(family_sources["qwen2_moe"])[0].args
    assert (qwen2_moe.num_experts, qwen2_moe.num_experts_per_tok) == (6, 2)
    assert qwen2_moe.dense_layers == (1,) and qwen2_moe.shared_expert_size == 48
    assert not qwen2_moe.norm_topk_prob and qwen2_moe.attention_bias
    mixtral = inspect_model(family_sources["mixtral"])[0].args
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 96


@pytest.mark.parametrize("name", sorted(GGUF_ARCH))
def test_family_gguf_matches_transformers(tmp_path, name):
    """The same weights as llama.cpp's converter lays them out in GGUF."""
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(path, name)
    backend = NumpyBackend()
    model = load_model(resolve_model(path), backend)
    logits = prompt_logits(model, backend, FAMILY_PROMPT[:40], [17, 23], block_size=8)
    check_rows(logits, name, np.arange(40))


@pytest.mark.parametrize("change", [{"attn_sinks": False}, {"swiglu_limit": 0.0},
                                    {"moe_routing": "softmax_topk"}, {"layer_windows": ()}],
                         ids=["no-sinks", "plain-swiglu", "softmax-then-topk", "no-window"])
def test_gpt_oss_needs_each_of_its_features(family_sources, monkeypatch, change):
    """The tiny gpt_oss checkpoint is built so that leaving out any one of its features
    fails the transformers golden (so the golden test checks each of them)."""
    family = registry._BY_HF_NAME["GptOssForCausalLM"]
    monkeypatch.setitem(registry._BY_HF_NAME, "GptOssForCausalLM", dataclasses.replace(
        family, args_from_hf=lambda config: dataclasses.replace(family.args_from_hf(config),
                                                                **change)))
    backend = NumpyBackend()
    logits = prompt_logits(load_model(family_sources["gpt_oss"], backend), backend,
                           FAMILY_PROMPT, block_size=8)
    golden = GOLDEN_FAMILIES["gpt_oss/logits"]
    assert np.abs(logits[GOLDEN_ROWS] - golden).max() > 1e-2


def test_gpt_oss_mxfp4_experts_are_dequantized_exactly(tmp_path):
    """MXFP4 experts (as gpt-oss ships them) give the logits of the same model whose experts
    hold the MXFP4 values dequantized by gguf-py, in float32."""
    write_family_gguf(tmp_path / "mxfp4.gguf", "gpt_oss", qtype=GGMLQuantizationType.MXFP4)
    reader = gguf.GGUFReader(tmp_path / "mxfp4.gguf")
    assert {t.tensor_type.name for t in reader.tensors if "_exps.weight" in t.name} == {"MXFP4"}
    backend = NumpyBackend()
    logits = prompt_logits(load_model(resolve_model(tmp_path / "mxfp4.gguf"), backend), backend,
                           FAMILY_PROMPT[:40], block_size=8)
    write_family_gguf(tmp_path / "f32.gguf", "gpt_oss", dequantized=GGMLQuantizationType.MXFP4)
    plain = prompt_logits(load_model(resolve_model(tmp_path / "f32.gguf"), backend), backend,
                          FAMILY_PROMPT[:40], block_size=8)
    assert np.abs(logits - plain).max() < 1e-5
    golden = GOLDEN_FAMILIES["gpt_oss/logits"][GOLDEN_ROWS < 40]
    assert np.abs(logits[GOLDEN_ROWS[GOLDEN_ROWS < 40]] - golden).max() > 1e-3   # it is lossy


def test_quantized_experts_stay_close(tmp_path):
    """Q8_0 experts split out of their stacked GGUF tensor keep their rows (a wrong split
    would scramble the experts)."""
    path = tmp_path / "qwen3_moe-q8.gguf"
    write_family_gguf(path, "qwen3_moe", qtype=GGMLQuantizationType.Q8_0)
    backend = NumpyBackend()
    logits = prompt_logits(load_model(resolve_model(path), backend), backend,
                           FAMILY_PROMPT[:40], block_size=8)
    expected = GOLDEN_FAMILIES["qwen3_moe/logits"][GOLDEN_ROWS < 40]
    diff = float(np.abs(logits[GOLDEN_ROWS[GOLDEN_ROWS < 40]] - expected).max())
    assert 0 < diff < 0.05


def test_warm_up_view_keeps_the_first_layer_of_each_kind(family_sources):
    """The warm-up runs one layer of each kind (types, shapes, window): gemma2 alternates
    sliding and global layers (two kinds), llama's layers are all alike (one)."""
    backend = NumpyBackend()
    for name, want in (("gemma2", [0, 1]), ("llama_dynamic", [0])):
        model = load_model(family_sources[name], backend)
        kv = backend.allocate_kv_cache(model.args.num_layers, 2, 8, model.args.num_kv_heads,
                                       model.args.head_dim)
        view, view_kv = model.warm_up_view(kv)
        assert view.layer_ids == want and len(view_kv) == len(want)
        assert len(model.layers) == model.args.num_layers > len(want)
        logits = prompt_logits(view, backend, FAMILY_PROMPT[:5], block_size=8)
        assert logits.shape == (5, model.args.vocab_size) and np.isfinite(logits).all()
