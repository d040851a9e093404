"""The llama family: llama, mistral, qwen2 (q/k/v biases), qwen3 (q/k RMSNorm), smollm.

RMSNorm -> fused QKV -> RoPE -> paged attention (GQA) -> output projection, then RMSNorm ->
fused gate/up -> SwiGLU -> down projection; tied or separate LM head (`models/decoder.py`).
A llama GGUF with experts (mixtral) reads as `models/moe.py` does. Sliding windows where
the config asks for them: mistral's `sliding_window` on every layer,
qwen2/qwen3's `layer_types` when `use_sliding_window`.
"""

from __future__ import annotations

from typing import Any

from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.models import moe
from vllm_actors.models.base import ModelArgs, layer_windows
from vllm_actors.models.decoder import DecoderLM
from vllm_actors.models.family import Family
from vllm_actors.models.hparams import gguf_common, hf_common

# GGUF architectures whose Q/K rows llama.cpp's converter permutes for adjacent-pair RoPE.
GGUF_INTERLEAVED_ROPE = {"llama", "mistral"}
_HF_TO_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _windows(config: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    if arch == "MistralForCausalLM":
        return layer_windows(config, num_layers, default_sliding=True)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not config.get("use_sliding_window"):
            return ()
        if not config.get("layer_types"):   # older configs: layers from max_window_layers on
            first = int(config.get("max_window_layers", num_layers))
            config = {**config, "layer_types": ["sliding_attention" if i >= first else
                                                "full_attention" for i in range(num_layers)]}
    return layer_windows(config, num_layers)


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    arch = config["architectures"][0]
    common = hf_common(config, _HF_TO_GGUF_ARCH[arch])
    if arch == "Qwen2ForCausalLM":
        common["attention_bias"] = bool(config.get("attention_bias", True))
    return ModelArgs(**common, qk_norm=arch == "Qwen3ForCausalLM",
                     layer_windows=_windows(config, arch, common["num_layers"]))


def args_from_gguf(gguf: GGUFFile) -> ModelArgs:
    if gguf.arch_get("expert_count"):     # mixtral: a llama GGUF with experts
        return moe.args_from_gguf(gguf)
    common = gguf_common(gguf)
    common["rope_interleaved"] = gguf.architecture in GGUF_INTERLEAVED_ROPE
    window = int(gguf.arch_get("attention.sliding_window", 0) or 0)
    return ModelArgs(**common, layer_windows=(window,) * common["num_layers"] if window else ())


FAMILY = Family(
    name="llama",
    hf_architectures=tuple(_HF_TO_GGUF_ARCH),
    gguf_architectures=("llama", "mistral", "qwen2", "qwen3"),
    args_from_hf=args_from_hf, args_from_gguf=args_from_gguf, model_class=DecoderLM,
    sanitize=moe.sanitize,     # splits a mixtral GGUF's stacked experts; else a no-op
)
