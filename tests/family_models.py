"""Tiny random-weight checkpoints of the model families beyond llama (gemma, gemma2, gemma3,
granite, phi3, olmo2, starcoder2, stablelm), in HF layout, for comparison against transformers
(goldens from tests/oracle/make_golden.py). Weights come from `tiny_models.det_uniform`, so
they are identical on every machine. Sliding windows, soft-caps and multipliers are set small
or large enough that a model ignoring them fails its golden."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from tiny_models import det_uniform, write_checkpoint

_BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 256, "max_position_embeddings": 512,
         "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma": {**_BASE, "architectures": ["GemmaForCausalLM"], "model_type": "gemma",
              "num_hidden_layers": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
              "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 10000.0},
    "gemma2": {**_BASE, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
               "num_hidden_layers": 4, "head_dim": 16, "rms_norm_eps": 1e-6,
               "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 10000.0,
               "query_pre_attn_scalar": 24, "sliding_window": 8, "tie_word_embeddings": False,
               "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0},
    "gemma3": {**_BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "num_hidden_layers": 3, "head_dim": 32, "rms_norm_eps": 1e-6,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 20,
               "sliding_window": 8, "tie_word_embeddings": False,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
               "rope_parameters": {
                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                      "rope_theta": 1000000.0},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
               "attn_logit_softcapping": None, "final_logit_softcapping": None},
    "granite": {**_BASE, "architectures": ["GraniteForCausalLM"], "model_type": "granite",
                "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22, "attention_multiplier": 0.1,
                "logits_scaling": 4.0, "hidden_act": "silu"},
    "phi3": {**_BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
             "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "partial_rotary_factor": 0.5, "sliding_window": 12, "tie_word_embeddings": False,
             "hidden_act": "silu", "original_max_position_embeddings": 512},
    "olmo2": {**_BASE, "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2",
              "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "hidden_act": "silu"},
    "starcoder2": {**_BASE, "architectures": ["Starcoder2ForCausalLM"],
                   "model_type": "starcoder2", "num_hidden_layers": 2, "norm_epsilon": 1e-5,
                   "rope_theta": 10000.0, "sliding_window": 10, "use_bias": True,
                   "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    "stablelm": {**_BASE, "architectures": ["StableLmForCausalLM"], "model_type": "stablelm",
                 "num_hidden_layers": 2, "layer_norm_eps": 1e-5, "rope_theta": 10000.0,
                 "partial_rotary_factor": 0.25, "use_qkv_bias": True,
                 "tie_word_embeddings": False, "hidden_act": "silu"},
    "mixtral": {**_BASE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                "num_local_experts": 4, "num_experts_per_tok": 2, "hidden_act": "silu",
                "tie_word_embeddings": False, "sliding_window": None},
    "qwen2_moe": {**_BASE, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                  "num_hidden_layers": 3, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                  "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [1], "qkv_bias": True,
                  "hidden_act": "silu", "tie_word_embeddings": False,
                  "use_sliding_window": False},
    "qwen3_moe": {**_BASE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "num_hidden_layers": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
                  "rope_theta": 1000000.0, "num_experts": 8, "num_experts_per_tok": 3,
                  "moe_intermediate_size": 32, "norm_topk_prob": True,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
                  "tie_word_embeddings": False, "use_sliding_window": False},
    # qwen3 with YaRN over an original context of 64 (the 300-token prompt runs past it)
    "qwen3_yarn": {**_BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                   "num_hidden_layers": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
                   "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 64},
                   "hidden_act": "silu", "tie_word_embeddings": False},
    # Phi-3-128k's LongRoPE over an original context of 16: every prompt and every decode
    # step runs past it, so transformers uses the long factors throughout, as our static
    # rule does for a 512-token context (short factors differ enough to fail the goldens)
    "phi3_longrope": {**_BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                      "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5,
                      "tie_word_embeddings": False, "hidden_act": "silu", "rope_theta": 10000.0,
                      "original_max_position_embeddings": 16,
                      "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                          "long_factor": [1.0, 1.7, 4.5, 11.0],
                                          "short_factor": [1.0, 1.05, 1.2, 1.4],
                                          "original_max_position_embeddings": 16}},
    # dynamic NTK over an original context of 128: transformers rescales per forward pass by
    # the sequence's length, our rule once for the serving context (CONTEXT_DEPENDENT)
    "llama_dynamic": {**_BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                      "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
                      "rope_parameters": {"rope_type": "dynamic", "factor": 4.0,
                                          "rope_theta": 10000.0},
                      "hidden_act": "silu", "tie_word_embeddings": False},
    # gpt-oss: sinks, windows of 8 on even layers, YaRN, biased top-k-softmax experts whose
    # clamped SwiGLU limit (7, llama.cpp's constant) bites on most activations (gate/up
    # weights scaled up in `_experts`)
    "gpt_oss": {**_BASE, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "num_hidden_layers": 2, "head_dim": 16, "intermediate_size": 32,
                "rms_norm_eps": 1e-5, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                    "original_max_position_embeddings": 128},
                "attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
                "tie_word_embeddings": False, "hidden_act": "silu"},
    "olmoe": {**_BASE, "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
              "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False,
              "hidden_act": "silu", "tie_word_embeddings": False},
}
MOE_NAMES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
# families whose logits depend on the serving context (loaded with context_len; the goldens'
# 300-token forward and the 49-token greedy run need different contexts)
CONTEXT_DEPENDENT = ("llama_dynamic",)

# 300 token ids; its first 1 and 17 are the short prompts (causal: their logits are rows of
# the long one's), golden logits are kept for GOLDEN_ROWS only.
FAMILY_PROMPT = [(i * 53 + 7) % 251 + 3 for i in range(300)]
GOLDEN_ROWS = np.array(sorted({*range(24), *range(24, 300, 9), 299}))
GREEDY_PROMPT_LEN = 17
GREEDY_STEPS = 32
NEAR_TIE = 1e-3       # golden top-2 margins below this may flip under float32 rounding


def check_greedy(tokens: list[int], name: str) -> None:
    """Greedy tokens of FAMILY_PROMPT[:GREEDY_PROMPT_LEN] (the first len(tokens) steps)
    against transformers' golden ones; the first difference must be at a golden near-tie
    (after it the runs diverge)."""
    from golden_files import GOLDEN
    goldens = np.load(GOLDEN / "family_models.npz")
    expected = goldens[f"{name}/greedy"].tolist()
    margins = goldens[f"{name}/margins"]
    assert 0 < len(tokens) <= len(expected), f"{name}: {len(tokens)} tokens"
    for step, (got, want) in enumerate(zip(tokens, expected)):
        if got != want:
            assert margins[step] < NEAR_TIE, (f"{name}: step {step} gave {got}, transformers "
                                              f"{want} (margin {margins[step]:.3g})")
            return


def family_weights(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """HF-named float32 weights for a FAMILY_CONFIGS entry."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    h, hk = config["num_attention_heads"], config["num_key_value_heads"]
    dh = config.get("head_dim") or d // h
    kind = config["model_type"]
    seed = iter(range(101, 100_000))

    def linear(out: int, inp: int) -> np.ndarray:
        return det_uniform((out, inp), next(seed)) * np.float32(1.5 / math.sqrt(inp))

    def norm(n: int) -> np.ndarray:   # gemma stores w - 1: values near 0 there
        base = 0.0 if kind.startswith("gemma") else 1.0
        return np.float32(base) + np.float32(0.2) * det_uniform((n,), next(seed))

    def bias(n: int) -> np.ndarray:
        return np.float32(0.3) * det_uniform((n,), next(seed))

    layer_norm = kind in ("starcoder2", "stablelm")
    w = {"model.embed_tokens.weight": det_uniform((v, d), next(seed)),
         "model.norm.weight": norm(d)}
    if layer_norm:
        w["model.norm.bias"] = bias(d)
    if not config.get("tie_word_embeddings", kind.startswith("gemma")):
        w["lm_head.weight"] = linear(v, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norms = {"olmo2": ["post_attention_layernorm", "post_feedforward_layernorm"],
                 "gemma2": ["input_layernorm", "post_attention_layernorm",
                            "pre_feedforward_layernorm", "post_feedforward_layernorm"]}
        norms["gemma3_text"] = norms["gemma2"]
        for name in norms.get(kind, ["input_layernorm", "post_attention_layernorm"]):
            w[p + name + ".weight"] = norm(d)
            if layer_norm:
                w[p + name + ".bias"] = bias(d)
        a = p + "self_attn."
        if kind == "phi3":
            w[a + "qkv_proj.weight"] = linear((h + 2 * hk) * dh, d)
        else:
            w[a + "q_proj.weight"] = linear(h * dh, d)
            w[a + "k_proj.weight"] = linear(hk * dh, d)
            w[a + "v_proj.weight"] = linear(hk * dh, d)
        w[a + "o_proj.weight"] = linear(d, h * dh)
        if kind in ("starcoder2", "stablelm"):
            for name, n in (("q_proj", h * dh), ("k_proj", hk * dh), ("v_proj", hk * dh)):
                w[a + name + ".bias"] = bias(n)
        if kind == "starcoder2":
            w[a + "o_proj.bias"] = bias(d)
        if kind == "gemma3_text":
            w[a + "q_norm.weight"] = norm(dh)
            w[a + "k_norm.weight"] = norm(dh)
        if kind in ("olmo2", "olmoe"):
            w[a + "q_norm.weight"] = norm(h * dh)
            w[a + "k_norm.weight"] = norm(hk * dh)
        if kind in ("qwen3_moe", "qwen3"):
            w[a + "q_norm.weight"] = norm(dh)
            w[a + "k_norm.weight"] = norm(dh)
        if kind in ("qwen2_moe", "gpt_oss"):
            for name, n in (("q_proj", h * dh), ("k_proj", hk * dh), ("v_proj", hk * dh)):
                w[a + name + ".bias"] = bias(n)
        if kind == "gpt_oss":
            w[a + "o_proj.bias"] = bias(d)
            w[a + "sinks"] = np.float32(2.0) * det_uniform((h,), next(seed))
        m = p + "mlp."
        if kind in MOE_NAMES and i not in config.get("mlp_only_layers", ()):
            w.update(_experts(config, p, d, linear, bias))
        elif kind == "starcoder2":
            w[m + "c_fc.weight"], w[m + "c_fc.bias"] = linear(f, d), bias(f)
            w[m + "c_proj.weight"], w[m + "c_proj.bias"] = linear(d, f), bias(d)
        elif kind == "phi3":
            w[m + "gate_up_proj.weight"] = linear(2 * f, d)
            w[m + "down_proj.weight"] = linear(d, f)
        else:
            w[m + "gate_proj.weight"] = linear(f, d)
            w[m + "up_proj.weight"] = linear(f, d)
            w[m + "down_proj.weight"] = linear(d, f)
    return w


def _experts(config: dict[str, Any], p: str, d: int, linear: Any, bias: Any
             ) -> dict[str, np.ndarray]:
    """A sparse layer's router and experts under their HF checkpoint names (per expert, as
    the hub ships them; transformers 5 fuses them on load; gpt-oss ships them stacked)."""
    kind, w = config["model_type"], {}
    num = config.get("num_local_experts") or config["num_experts"]
    f = config.get("moe_intermediate_size") or config["intermediate_size"]
    if kind == "gpt_oss":    # x @ W layouts, gate and up interleaved by column
        m = p + "mlp."
        w[m + "router.weight"] = linear(num, d) * np.float32(4.0)
        w[m + "router.bias"] = bias(num)
        w[m + "experts.gate_up_proj"] = np.stack([linear(2 * f, d).T * np.float32(12.0)
                                                  for _ in range(num)])
        w[m + "experts.gate_up_proj_bias"] = np.stack([bias(2 * f) for _ in range(num)])
        w[m + "experts.down_proj"] = np.stack([linear(d, f).T for _ in range(num)])
        w[m + "experts.down_proj_bias"] = np.stack([bias(d) for _ in range(num)])
        return {k: np.ascontiguousarray(v) for k, v in w.items()}
    block = p + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    w[block + "gate.weight"] = linear(num, d) * np.float32(4.0)   # decisive routing
    for e in range(num):
        w[f"{block}experts.{e}.{names[0]}.weight"] = linear(f, d)
        w[f"{block}experts.{e}.{names[1]}.weight"] = linear(f, d)
        w[f"{block}experts.{e}.{names[2]}.weight"] = linear(d, f)
    if config.get("shared_expert_intermediate_size"):
        s = config["shared_expert_intermediate_size"]
        w[block + "shared_expert.gate_proj.weight"] = linear(s, d)
        w[block + "shared_expert.up_proj.weight"] = linear(s, d)
        w[block + "shared_expert.down_proj.weight"] = linear(d, s)
        w[block + "shared_expert_gate.weight"] = linear(1, d)
    return w


def write_family_dir(path: Path, name: str) -> dict[str, np.ndarray]:
    """config.json + model.safetensors for FAMILY_CONFIGS[name]; returns the weights."""
    return write_checkpoint(path, FAMILY_CONFIGS[name], family_weights(FAMILY_CONFIGS[name]))
