"""The gemma family: gemma, gemma2, gemma3 (text).

Llama's decoder with: embeddings scaled by sqrt(D); RMSNorm weights stored as w - 1 in HF
checkpoints (llama.cpp's converter adds the 1, so GGUF files hold w: `sanitize` adds it for
safetensors); GeGLU MLP (tanh GELU); a softmax scale of query_pre_attn_scalar^-1/2.
gemma2 and gemma3 add post-norms after attention and MLP ("sandwich"), and sliding-window
layers: every other layer on gemma2, five of six on gemma3. gemma2 soft-caps attention scores
and final logits; gemma3 has q/k norms and a separate RoPE base for its sliding layers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.weights import RawTensor, WeightSet
from vllm_actors.models.base import ModelArgs, layer_windows, rope_params
from vllm_actors.models.decoder import DecoderLM
from vllm_actors.models.family import Family
from vllm_actors.models.hparams import gguf_common, hf_common

_HF_TO_GGUF_ARCH = {"GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
                    "Gemma3ForCausalLM": "gemma3"}
# every n-th layer is global, the others slide (transformers' and llama.cpp's default)
_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast":
                "gelu_tanh", "gelu": "gelu"}


def _pattern_windows(window: int, pattern: int, num_layers: int) -> tuple[int, ...]:
    return tuple(0 if (i + 1) % pattern == 0 else window for i in range(num_layers))


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    arch = _HF_TO_GGUF_ARCH[config["architectures"][0]]
    common = hf_common(config, arch)
    common["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", True))
    act = config.get("hidden_activation") or "gelu_pytorch_tanh"
    extra: dict[str, Any] = dict(
        hidden_act=_ACTIVATIONS.get(act, act), embed_scale=math.sqrt(common["hidden_size"]),
        attn_scale=float(config.get("query_pre_attn_scalar") or common["head_dim"]) ** -0.5)
    if arch != "gemma":
        num_layers = common["num_layers"]
        windows = layer_windows(config, num_layers)
        if not windows and not config.get("layer_types") and config.get("sliding_window"):
            pattern = int(config.get("sliding_window_pattern", _SLIDING_PATTERN[arch]))
            windows = _pattern_windows(int(config["sliding_window"]), pattern, num_layers)
        extra.update(norm_placement="sandwich", layer_windows=windows,
                     attn_logit_softcap=float(config.get("attn_logit_softcapping") or 0.0),
                     final_logit_softcap=float(config.get("final_logit_softcapping") or 0.0))
    if arch == "gemma3":
        local = rope_params(config, "sliding_attention")[0]
        if "rope_local_base_freq" in config:
            local = float(config["rope_local_base_freq"])
        extra.update(qk_norm=True, rope_local_theta=local)
    return ModelArgs(**common, **extra)


def args_from_gguf(gguf: GGUFFile) -> ModelArgs:
    arch, get = gguf.architecture, gguf.arch_get
    common = gguf_common(gguf)
    hidden, heads, layers = common["hidden_size"], common["num_heads"], common["num_layers"]
    # llama.cpp's rule: the 27B models scale by (D / H)^-1/2, the others by head_dim^-1/2
    big = (arch == "gemma2" and layers == 46) or (arch == "gemma3" and layers == 62)
    extra: dict[str, Any] = dict(
        hidden_act="gelu_tanh", embed_scale=math.sqrt(hidden),
        attn_scale=(hidden / heads if big else common["head_dim"]) ** -0.5)
    if arch != "gemma":
        window = int(get("attention.sliding_window", 0) or 0)
        pattern = int(get("attention.sliding_window_pattern", _SLIDING_PATTERN[arch]))
        extra.update(norm_placement="sandwich",
                     layer_windows=_pattern_windows(window, pattern, layers) if window else (),
                     attn_logit_softcap=float(get("attn_logit_softcapping", 0.0) or 0.0),
                     final_logit_softcap=float(get("final_logit_softcapping", 0.0) or 0.0))
    if arch == "gemma3":
        # llama.cpp's base of the local layers unless the file says otherwise
        extra.update(rope_local_theta=float(get("rope.freq_base_swa", 10000.0)))
    return ModelArgs(**common, **extra)


def sanitize(weights: WeightSet, args: ModelArgs, kind: str) -> WeightSet:
    """HF gemma norms hold w - 1 (the model computes x * (1 + w)): stored as w here."""
    if kind == "gguf":
        return weights
    tensors = dict(weights.tensors)
    for name, tensor in tensors.items():
        if name.endswith("norm.weight"):
            shifted = tensor.to_float32() + np.float32(1.0)
            tensors[name] = RawTensor(name, tensor.shape, int(GGMLQuantizationType.F32), shifted)
    return WeightSet(tensors, weights.path, weights.activations)


FAMILY = Family(
    name="gemma",
    hf_architectures=tuple(_HF_TO_GGUF_ARCH),
    gguf_architectures=("gemma", "gemma2", "gemma3"),
    args_from_hf=args_from_hf, args_from_gguf=args_from_gguf, model_class=DecoderLM,
    sanitize=sanitize,
)
