"""LoRA adapters against PEFT on transformers (fp32; tests/golden/lora.npz from
tests/oracle/make_lora_golden.py): random adapters with non-zero B on llama, qwen2 (rsLoRA,
rank 64), gemma3, phi3 (fused qkv_proj / gate_up_proj) and the MoE families (qwen3_moe,
qwen2_moe with its shared expert, mixtral: routed experts under PEFT's `target_parameters`,
and the same numbers one module per expert), on the numpy and the compiled CPU backends, at
TP=2, and on a GGUF base whose Q/K rows llama.cpp permuted (the adapter's rows follow the HF
checkpoint)."""

from __future__ import annotations

import numpy as np
import pytest
from family_models import NEAR_TIE, write_family_dir
from golden_files import GOLDEN
from model_driver import greedy_tokens, prompt_logits
from tiny_lora import (LORA_CASES, LORA_GREEDY_PROMPT_LEN, LORA_GREEDY_STEPS, LORA_PROMPT,
                       SMOLLM2_LORA, SMOLLM2_SHAPES, attach, write_case, write_gguf_moe_case,
                       write_peft_adapter)
from tiny_models import TINY_CONFIGS, tiny_weights, write_llama_gguf
from tp_ranks import run_ranks

from vllm_actors.kernels import get_backend
from vllm_actors.kernels.ops import AttentionMetadata
from vllm_actors.loaders.lora import LoRAAdapterError, load_adapter
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.lora import LoRABatch, build_model_lora
from vllm_actors.models.registry import load_model

GOLDENS = np.load(GOLDEN / "lora.npz")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: write_case(root, name) for name in LORA_CASES}


def check_greedy(tokens: list[int], name: str) -> None:
    """Equal to PEFT's greedy tokens up to a first difference at a golden near-tie."""
    want, margins = GOLDENS[f"{name}/greedy"].tolist(), GOLDENS[f"{name}/margins"]
    for step, (got, expected) in enumerate(zip(tokens, want)):
        if got != expected:
            assert margins[step] < NEAR_TIE, (name, step, got, expected, margins[step])
            return
    assert len(tokens) == len(want)


def run_case(model, backend, name: str) -> None:
    logits = prompt_logits(model, backend, LORA_PROMPT, [17, 1, 30], block_size=8)
    assert np.abs(logits - GOLDENS[f"{name}/logits"]).max() < TOLERANCE, name
    check_greedy(greedy_tokens(model, backend, LORA_PROMPT[:LORA_GREEDY_PROMPT_LEN],
                               LORA_GREEDY_STEPS), name)


@pytest.mark.parametrize("device, name", [*(("numpy", n) for n in LORA_CASES),
                                          ("cpu", "llama"), ("cpu", "phi3"),
                                          ("cpu", "qwen2_moe")])
def test_adapter_matches_peft(cases, device, name):
    model_dir, adapter = cases[name]
    backend = get_backend(device)
    run_case(attach(load_model(resolve_model(str(model_dir)), backend), adapter), backend,
             name)


@pytest.mark.parametrize("name", ["llama", "phi3", "qwen2_moe"])
def test_adapter_sharded_over_two_ranks(cases, name):
    """B split along the output of QKV / gate+up, A along the input of o / down (and of
    every expert's, as the experts are sharded along their width)."""
    model_dir, adapter = cases[name]
    source = resolve_model(str(model_dir))
    logits = run_ranks(2, lambda group, b: prompt_logits(
        attach(load_model(source, b, group), adapter), b, LORA_PROMPT, [17, 1, 30],
        block_size=8))
    assert np.abs(logits - GOLDENS[f"{name}/logits"]).max() < TOLERANCE


@pytest.mark.parametrize("semantics", ["float32", "quantized"])
def test_hf_adapter_on_a_gguf_base(tmp_path, cases, semantics):
    """The tiny llama as llama.cpp writes it (Q/K rows permuted; under the quantized
    semantics they stay so): the PEFT adapter's rows follow, on both backends; under the
    quantized semantics over two ranks too, whose o / down are split by output rows (B's
    rows, A whole)."""
    write_llama_gguf(tmp_path / "llama.gguf")
    source, adapter = resolve_model(str(tmp_path / "llama.gguf")), cases["llama"][1]
    for device in ("numpy", "cpu"):
        backend = get_backend(device)
        model = attach(load_model(source, backend, gguf_activations=semantics), adapter)
        logits = prompt_logits(model, backend, LORA_PROMPT)
        assert np.abs(logits - GOLDENS["llama/logits"]).max() < TOLERANCE, device
    if semantics == "quantized":
        logits = run_ranks(2, lambda group, b: prompt_logits(attach(load_model(
            source, b, group, gguf_activations=semantics), adapter), b, LORA_PROMPT))
        assert np.abs(logits - GOLDENS["llama/logits"]).max() < TOLERANCE


def test_gguf_expert_adapter_matches_llamacpp(tmp_path):
    """llama.cpp's GGUF adapter layout for stacked experts (`blk.N.ffn_gate_exps.weight.
    lora_a` [E, r, in]) on the tiny qwen3_moe as a GGUF: llama.cpp's logits (tests/golden/
    llamacpp_qwen3_moe_lora.npz) on both backends under its semantics. The adapter holds
    the numbers of PEFT's qwen3_moe case, and llama.cpp's logits are PEFT's within 4e-6."""
    model_path, adapter = write_gguf_moe_case(tmp_path)
    want = np.load(GOLDEN / "llamacpp_qwen3_moe_lora.npz")["logits"]
    assert np.abs(want - GOLDENS["qwen3_moe/logits"]).max() < TOLERANCE
    for device in ("numpy", "cpu"):
        backend = get_backend(device)
        model = attach(load_model(resolve_model(str(model_path)), backend), adapter)
        logits = prompt_logits(model, backend, LORA_PROMPT, [17, 1, 30], block_size=8)
        assert np.abs(logits - want).max() < TOLERANCE, device


def test_experts_one_module_each_match_peft(tmp_path, cases):
    """Older PEFT's form, one module per expert (mixtral's `block_sparse_moe.experts.E.w1`),
    holding the numbers of the stacked golden adapter."""
    weights = write_family_dir(tmp_path / "model", "mixtral")
    adapter = write_peft_adapter(tmp_path / "a", weights,
                                 **{**LORA_CASES["mixtral"][2], "experts": "per_expert"})
    backend = get_backend("numpy")
    model = attach(load_model(resolve_model(str(cases["mixtral"][0])), backend), adapter)
    logits = prompt_logits(model, backend, LORA_PROMPT)
    assert np.abs(logits - GOLDENS["mixtral/logits"]).max() < TOLERANCE


def test_expert_rows_of_a_mixed_step(cases):
    """One step holding the prompt with the adapter and a shorter one without: every expert
    sees tokens of both, and each request gets its logits alone (PEFT's; the base model's)."""
    model_dir, adapter = cases["qwen2_moe"]
    backend = get_backend("numpy")
    model = load_model(resolve_model(str(model_dir)), backend)
    short = LORA_PROMPT[:30]
    alone = prompt_logits(model, backend, short)
    lora = build_model_lora(model, load_adapter("a", str(adapter), model.args, 16,
                                                extra_names=model.extra_names))
    n, block = len(LORA_PROMPT), 8
    pos = np.concatenate([np.arange(n), np.arange(len(short))])
    table = np.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 0, 0]], np.int32)
    seq = np.repeat([0, 1], [n, len(short)])
    kv = backend.allocate_kv_cache(model.args.num_layers, 11, block, model.args.num_kv_heads,
                                   model.args.head_dim)
    meta = AttentionMetadata(np.array([0, n, n + len(short)], np.int32),
                             np.array([n, len(short)], np.int32), table,
                             table[seq, pos // block].astype(np.int64) * block + pos % block,
                             block)
    hidden = model.forward(np.array(LORA_PROMPT + short), pos, meta, kv,
                           lora=LoRABatch(((lora, np.arange(n)),)))
    logits = model.compute_logits(hidden, np.arange(n + len(short)))
    assert np.abs(logits[:n] - GOLDENS["qwen2_moe/logits"]).max() < TOLERANCE
    assert np.abs(logits[n:] - alone).max() < TOLERANCE


def test_refused_adapters_name_their_problem(tmp_path, cases):
    model = load_model(resolve_model(str(cases["llama"][0])), get_backend("numpy"))
    weights = tiny_weights(TINY_CONFIGS["llama"])
    deeper = {**weights, **{k.replace("layers.0.", "layers.2."): v for k, v in weights.items()
                            if "layers.0." in k}}
    wider = {k: np.zeros((v.shape[0], 2 * v.shape[1]), np.float32)
             if k.endswith("down_proj.weight") else v for k, v in weights.items()}
    bad = {
        "DoRA": write_peft_adapter(tmp_path / "dora", weights, use_dora=True),
        "modules_to_save": write_peft_adapter(tmp_path / "save", weights,
                                              modules_to_save=["lm_head"]),
        "rank 32 is above --max-lora-rank 16": write_peft_adapter(tmp_path / "r32", weights,
                                                                   rank=32),
        "no adapter_config.json": tmp_path,
        "no such PEFT directory": tmp_path / "missing",
        "target module .model.layers.2.*no such linear layer": write_peft_adapter(
            tmp_path / "deeper", deeper),
        r"ffn_down: lora_A \(8, 192\)": write_peft_adapter(tmp_path / "wider", wider,
                                                            ("down_proj",)),
    }
    for problem, path in bad.items():
        with pytest.raises(LoRAAdapterError, match=problem):
            build_model_lora(model, load_adapter("x", str(path), model.args, 16))
    moe = load_model(resolve_model(str(cases["qwen2_moe"][0])), get_backend("numpy"))
    with pytest.raises(LoRAAdapterError, match="fit neither stacked expert parameter of this "
                                               "model .6 experts"):
        load_adapter("x", str(cases["qwen3_moe"][1]), moe.args, 16)


def test_smollm2_adapter_matches_peft(tmp_path, smollm2_path):
    """A rank-16 adapter on every linear of SmolLM2 (its Q4_1 GGUF computed exactly, as
    transformers dequantizes it): the last prompt row's logits and 32 greedy tokens."""
    adapter = write_peft_adapter(tmp_path / "a", SMOLLM2_SHAPES, **SMOLLM2_LORA)
    backend = get_backend("cpu")
    model = attach(load_model(resolve_model(smollm2_path), backend,
                              gguf_activations="float32"), adapter)
    prompt = GOLDENS["smollm2/prompt"].tolist()
    logits = prompt_logits(model, backend, prompt, first_row=len(prompt) - 1)
    assert np.abs(logits - GOLDENS["smollm2/logits"]).max() < TOLERANCE
    check_greedy(greedy_tokens(model, backend, prompt, LORA_GREEDY_STEPS), "smollm2")
