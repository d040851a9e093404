"""The olmo2 family (OLMo 2): norms after each sublayer instead of before (the residual adds
norm(attention(h)) and norm(mlp(h))), and q/k RMSNorms over all heads at once (which does not
shard: tensor parallelism is refused)."""

from __future__ import annotations

from typing import Any

from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.models.base import ModelArgs
from vllm_actors.models.decoder import DecoderLM
from vllm_actors.models.family import Family
from vllm_actors.models.hparams import gguf_common, hf_common


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    return ModelArgs(**hf_common(config, "olmo2"), norm_placement="post", qk_norm_full=True)


def args_from_gguf(gguf: GGUFFile) -> ModelArgs:
    common = gguf_common(gguf)
    common["qk_norm"] = False
    return ModelArgs(**common, norm_placement="post", qk_norm_full=True)


FAMILY = Family(
    name="olmo2", hf_architectures=("Olmo2ForCausalLM",), gguf_architectures=("olmo2",),
    args_from_hf=args_from_hf, args_from_gguf=args_from_gguf, model_class=DecoderLM,
)
