"""The granite family (IBM Granite 3.x dense): llama's decoder with four multipliers —
embeddings, residual branches, the softmax scale, and logits divided by `logits_scaling`."""

from __future__ import annotations

from typing import Any

from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.models.base import ModelArgs
from vllm_actors.models.decoder import DecoderLM
from vllm_actors.models.family import Family
from vllm_actors.models.hparams import gguf_common, hf_common


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    common = hf_common(config, "granite")
    return ModelArgs(**common,
                     embed_scale=float(config.get("embedding_multiplier", 1.0)),
                     residual_scale=float(config.get("residual_multiplier", 1.0)),
                     attn_scale=float(config.get("attention_multiplier", 0.0)),
                     logit_scale=1.0 / float(config.get("logits_scaling", 1.0)))


def args_from_gguf(gguf: GGUFFile) -> ModelArgs:
    get = gguf.arch_get
    common = gguf_common(gguf)
    common["rope_interleaved"] = True      # llama.cpp permutes granite's Q/K rows as llama's
    return ModelArgs(**common,
                     embed_scale=float(get("embedding_scale", 1.0)),
                     residual_scale=float(get("residual_scale", 1.0)),
                     attn_scale=float(get("attention.scale", 0.0)),
                     logit_scale=1.0 / float(get("logit_scale", 1.0)))


FAMILY = Family(
    name="granite", hf_architectures=("GraniteForCausalLM",), gguf_architectures=("granite",),
    args_from_hf=args_from_hf, args_from_gguf=args_from_gguf, model_class=DecoderLM,
)
