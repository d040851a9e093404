"""`--gguf-activations`: the flag, its default, what `auto` KV means under it, and how the
loader marks a GGUF file's matrices (the numbers themselves: tests/kernels/
test_activation_quant.py and tests/models/test_llamacpp_oracle.py)."""

from __future__ import annotations

import argparse

import pytest
from gguf import GGMLQuantizationType as QT

from vllm_actors.config import EngineArgs, resolve_kv_dtype
from vllm_actors.errors import ValidationError
from vllm_actors.kernels.activation_quant import activation_format
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.weights import gguf_weights


def test_flag_default_choices_and_errors():
    assert EngineArgs().gguf_activations == "quantized"       # llama.cpp's, as DESIGN.md says
    assert EngineArgs().create_engine_config().model.gguf_activations == "quantized"
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])).gguf_activations == "quantized"
    args = EngineArgs.from_cli_args(parser.parse_args(["--gguf-activations", "float32"]))
    assert args.create_engine_config().model.gguf_activations == "float32"
    with pytest.raises(ValidationError, match="--gguf-activations must be one of") as info:
        EngineArgs(gguf_activations="int8").create_engine_config()
    assert info.value.param == "gguf_activations"
    with pytest.raises(SystemExit):
        parser.parse_args(["--gguf-activations", "int8"])


def test_auto_kv_cache_is_float16_only_for_quantized_gguf():
    assert EngineArgs().create_engine_config().cache.kv_cache_dtype == "auto"
    assert resolve_kv_dtype("auto", quantized_gguf=True) == "float16"
    assert resolve_kv_dtype("auto", quantized_gguf=False) == "float32"
    assert resolve_kv_dtype("float32", quantized_gguf=True) == "float32"
    assert resolve_kv_dtype("fp8_e4m3", quantized_gguf=False) == "fp8_e4m3"


def test_activation_formats_follow_ggml_vec_dot_type():
    assert [activation_format(t) for t in (QT.Q4_0, QT.Q5_0, QT.Q8_0)] == ["q8_0"] * 3
    assert [activation_format(t) for t in (QT.Q4_1, QT.Q5_1)] == ["q8_1"] * 2
    assert {activation_format(t) for t in (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)} \
        == {"q8_k"}
    assert (activation_format(QT.F16), activation_format(QT.BF16)) == ("f16", "bf16")
    assert activation_format(QT.F32) is None and activation_format(None) is None


def test_loader_marks_matrices_only_under_quantized(smollm2_path):
    gguf = GGUFFile(smollm2_path)
    quantized = gguf_weights(gguf, "quantized").tensors
    exact = gguf_weights(gguf, "float32").tensors
    assert all(t.activations is None for t in exact.values())
    for name, tensor in quantized.items():
        want = activation_format(tensor.qtype) if len(tensor.shape) == 2 else None
        assert tensor.activations == want, name
    head = quantized["token_embd.weight"]
    assert head.activations == "q8_0" and head.row_slice(0, 64).activations == "q8_0"
    q = quantized["blk.0.attn_q.weight"]
    assert q.activations == "q8_1" and q.col_slice(0, 64).activations == "q8_1"
