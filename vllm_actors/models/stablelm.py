"""The stablelm family (StableLM 2, StableLM-3B-4E1T): llama's decoder with LayerNorm (with
biases), partial rotary (a quarter of each head), optional q/k/v biases. Variants with
per-head q/k LayerNorms or a parallel residual are refused."""

from __future__ import annotations

from typing import Any

from vllm_actors.errors import UnsupportedModelError
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.models.base import ModelArgs
from vllm_actors.models.decoder import DecoderLM
from vllm_actors.models.family import Family
from vllm_actors.models.hparams import gguf_common, hf_common


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    for key in ("qk_layernorm", "use_parallel_residual"):
        if config.get(key):
            raise UnsupportedModelError("StableLmForCausalLM", f"{key}=true is not supported")
    common = hf_common(config, "stablelm")
    common["rms_norm_eps"] = float(config.get("layer_norm_eps", 1e-5))
    common["attention_bias"] = bool(config.get("use_qkv_bias", False))
    return ModelArgs(**common, norm_type="layer", norm_bias=True)


def args_from_gguf(gguf: GGUFFile) -> ModelArgs:
    if "blk.0.attn_q_norm.weight" in gguf.tensors or "blk.0.ffn_norm.weight" not in gguf.tensors:
        raise UnsupportedModelError(gguf.path, "stablelm with q/k norms or a parallel "
                                               "residual is not supported")
    return ModelArgs(**gguf_common(gguf), norm_type="layer", norm_bias=True)


FAMILY = Family(
    name="stablelm", hf_architectures=("StableLmForCausalLM",), gguf_architectures=("stablelm",),
    args_from_hf=args_from_hf, args_from_gguf=args_from_gguf, model_class=DecoderLM,
)
