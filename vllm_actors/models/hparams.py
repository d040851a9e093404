"""Hyper-parameters most families read the same way, from an HF config.json or GGUF metadata;
a family module takes these and adds or overrides what is its own."""

from __future__ import annotations

from typing import Any

from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.models.base import rope_params


def hf_common(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """ModelArgs keyword arguments from an HF config (transformers' usual key names);
    `architecture` is the GGUF architecture name whose tensor-name map applies."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    theta, scaling = rope_params(config)
    partial = config.get("partial_rotary_factor")
    if partial is None and isinstance(config.get("rope_parameters"), dict):
        partial = config["rope_parameters"].get("partial_rotary_factor")
    eps = config.get("rms_norm_eps", config.get("layer_norm_eps", config.get("norm_eps", 1e-6)))
    max_positions = int(config.get("max_position_embeddings", 4096))
    if scaling.get("rope_type", scaling.get("type")) == "dynamic" and scaling.get("factor"):
        # the context dynamic NTK extends to, as vLLM derives it
        scaling.setdefault("original_max_position_embeddings", max_positions)
        max_positions = int(max_positions * float(scaling["factor"]))
    return dict(
        architecture=architecture,
        hidden_size=hidden, num_layers=int(config["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
        intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
        rms_norm_eps=float(eps), rope_theta=theta,
        max_position_embeddings=max_positions,
        rotary_dim=int(head_dim * float(partial or 1.0)),
        rope_interleaved=False, rope_scaling=scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
    )


def gguf_common(gguf: GGUFFile) -> dict[str, Any]:
    """ModelArgs keyword arguments from GGUF metadata (llama.cpp's key names)."""
    get = gguf.arch_get
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    scaling: dict[str, Any] = {}
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0)),
                   "original_max_position_embeddings": get("rope.scaling.original_context_length")}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("attn_factor", "attention_factor")):
            if get(f"rope.scaling.{key}") is not None:
                scaling[name] = float(get(f"rope.scaling.{key}"))
    vocab = get("vocab_size") or len(gguf.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        vocab = gguf.tensors["token_embd.weight"].shape[0]
    eps = get("attention.layer_norm_rms_epsilon", get("attention.layer_norm_epsilon", 1e-5))
    return dict(
        architecture=gguf.architecture, hidden_size=hidden, num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim, intermediate_size=int(get("feed_forward_length")),
        vocab_size=int(vocab), rms_norm_eps=float(eps),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        rotary_dim=int(get("rope.dimension_count", head_dim)),
        rope_interleaved=False, rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
    )
