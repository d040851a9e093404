"""The tiny family checkpoints of `family_models` written as llama.cpp's converter would write
them (GGUF names and metadata keys, experts stacked per layer, llama-layout Q/K permuted), so
the GGUF readers of each family are checked against the same transformers goldens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from family_models import FAMILY_CONFIGS, family_weights
from quant_blocks import quantize_iq4_nl
from tiny_models import llama_cpp_permute

from vllm_actors.models import moe

# family -> GGUF architecture (the converter's choice)
GGUF_ARCH = {"phi3": "phi3", "phi3_longrope": "phi3",
             "olmo2": "olmo2", "gpt_oss": "gpt-oss", "granite": "granite",
             "starcoder2": "starcoder2",
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
    w.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
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
        if config.get("moe_intermediate_size") or name == "gpt_oss":
            w.add_expert_feed_forward_length(config.get("moe_intermediate_size")
                                             or config["intermediate_size"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


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


def _gpt_oss_layout(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """gpt-oss's stacked x @ W experts as the converter writes them: gate and up split out of
    their interleaved columns, [E, out, in] each, biases [E, out]; sinks named `.weight`."""
    out = {}
    for key, value in weights.items():
        parts = key.split(".")
        if parts[-1] == "sinks":
            out[f"blk.{parts[2]}.attn_sinks.weight"] = value
        elif "experts" in parts:
            p, kind = f"blk.{parts[2]}.", parts[-1]
            if kind == "gate_up_proj":
                out[p + "ffn_gate_exps.weight"] = value[:, :, 0::2].transpose(0, 2, 1)
                out[p + "ffn_up_exps.weight"] = value[:, :, 1::2].transpose(0, 2, 1)
            elif kind == "gate_up_proj_bias":
                out[p + "ffn_gate_exps.bias"] = value[:, 0::2]
                out[p + "ffn_up_exps.bias"] = value[:, 1::2]
            elif kind == "down_proj":
                out[p + "ffn_down_exps.weight"] = value.transpose(0, 2, 1)
            else:
                out[p + "ffn_down_exps.bias"] = value
        else:
            out[key] = value
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def write_family_gguf(path: Path, name: str, qtype: Any = None, dequantized: Any = None,
                      no_vocab: bool = False) -> None:
    """FAMILY_CONFIGS[name] as a GGUF file; `qtype` quantizes the 2-D and 3-D weights (MXFP4:
    the experts only, as gpt-oss ships); `dequantized` stores them in float32 after a round
    trip through that type instead. `no_vocab`: tokenizer.ggml.model "none", which llama.cpp
    needs to load a file without a vocabulary (it then takes token ids)."""
    config = FAMILY_CONFIGS[name]
    arch = GGUF_ARCH[name]
    weights = family_weights(config)
    weights = _gpt_oss_layout(weights) if name == "gpt_oss" else _stack_experts(weights, config)
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, name, config)
    if no_vocab:
        writer.add_tokenizer_model("none")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.asarray(rope[f"{kind}_factor"], np.float32))
    for hf_name, w in weights.items():
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None and hf_name.startswith("blk."):
            gguf_name = hf_name      # already named as the converter names it
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
        kind = qtype or dequantized
        if kind is not None and w.ndim >= 2 and "gate_inp" not in gguf_name and \
                (kind != gguf.GGMLQuantizationType.MXFP4 or "_exps" in gguf_name):
            packed = quantize_iq4_nl(w.reshape(-1, w.shape[-1])).reshape(*w.shape[:-1], -1) \
                if kind == gguf.GGMLQuantizationType.IQ4_NL else gguf.quants.quantize(w, kind)
            if qtype is not None:
                writer.add_tensor(gguf_name, packed, raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, gguf.quants.dequantize(packed, kind)
                                  .astype(np.float32).reshape(w.shape))
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
