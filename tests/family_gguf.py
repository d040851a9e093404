"""The tiny family checkpoints of `family_models` written as llama.cpp's converter would write
them (GGUF names and metadata keys, experts stacked per layer, llama-layout Q/K permuted), so
the GGUF readers of each family are checked against the same transformers goldens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from family_models import FAMILY_CONFIGS, family_weights
from tiny_models import llama_cpp_permute

from vllm_actors.models import moe

# family -> GGUF architecture (the converter's choice)
GGUF_ARCH = {"phi3": "phi3", "phi3_longrope": "phi3",
             "olmo2": "olmo2", "granite": "granite", "starcoder2": "starcoder2",
             "stablelm": "stablelm", "mixtral": "llama", "qwen2_moe": "qwen2moe",
             "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
_LAYER_NORM = ("starcoder2", "stablelm")
_PERMUTED = ("granite", "mixtral")


def _metadata(w: gguf.GGUFWriter, name: str, config: dict[str, Any]) -> None:
    d, h = config["hidden_size"], config["num_attention_heads"]
    dh = config.get("head_dim") or d // h
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(h)
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(dh)
    w.add_value_length(dh)
    w.add_rope_freq_base(config["rope_theta"])
    w.add_rope_dimension_count(int(dh * config.get("partial_rotary_factor", 1.0)))
    w.add_vocab_size(config["vocab_size"])
    if name in _LAYER_NORM:
        w.add_layer_norm_eps(config.get("norm_epsilon", config.get("layer_norm_eps")))
    else:
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":       # the converter's keys for Phi-3's LongRoPE
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        factor = config["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(factor) / np.log(original))))
    if name == "granite":
        w.add_embedding_scale(config["embedding_multiplier"])
        w.add_residual_scale(config["residual_multiplier"])
        w.add_attention_scale(config["attention_multiplier"])
        w.add_logit_scale(config["logits_scaling"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _stack_experts(weights: dict[str, np.ndarray], config: dict[str, Any]
                   ) -> dict[str, np.ndarray]:
    """Per-expert HF tensors -> one [E, out, in] tensor per layer and projection, under the
    stacked HF name the converter maps (`...experts.gate_proj.weight`)."""
    num = config.get("num_local_experts") or config.get("num_experts")
    if not num:
        return weights
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, list[np.ndarray]] = {}
    for key, value in weights.items():
        parts = key.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            stacked = ".".join(parts[:i + 1] + parts[i + 2:])
            stacks.setdefault(stacked, [None] * num)[int(parts[i + 1])] = value
        else:
            out[key] = value
    out.update({k: np.stack(v) for k, v in stacks.items()})
    return out


def write_family_gguf(path: Path, name: str, qtype: Any = None) -> None:
    """FAMILY_CONFIGS[name] as a GGUF file; `qtype` quantizes the 2-D and 3-D weights."""
    config = FAMILY_CONFIGS[name]
    arch = GGUF_ARCH[name]
    weights = _stack_experts(family_weights(config), config)
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, name, config)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.asarray(rope[f"{kind}_factor"], np.float32))
    for hf_name, w in weights.items():
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None and hf_name == "lm_head.weight":
            gguf_name = "output.weight"
        gguf_name = gguf_name or moe.hf_name(hf_name)   # a sparse model's dense layers
        assert gguf_name is not None, hf_name
        if name in _PERMUTED and gguf_name.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, config["num_attention_heads"])
        elif name in _PERMUTED and gguf_name.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, config["num_key_value_heads"])
        if name == "qwen2_moe" and gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(-1)      # the converter stores the shared gate as a vector
        if qtype is not None and w.ndim >= 2 and "gate_inp" not in gguf_name:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
