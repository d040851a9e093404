"""The starcoder2 family: LayerNorm with biases, an ungated GELU MLP (c_fc -> gelu -> c_proj)
with biases, biases on every attention projection, tied embeddings, and a sliding window on
every layer."""

from __future__ import annotations

from typing import Any

from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.models.base import ModelArgs, layer_windows
from vllm_actors.models.decoder import DecoderLM
from vllm_actors.models.family import Family
from vllm_actors.models.hparams import gguf_common, hf_common

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}


def _layout(bias: bool) -> dict[str, Any]:
    return dict(norm_type="layer", norm_bias=True, gated_mlp=False, mlp_bias=bias,
                attention_bias=bias, attn_out_bias=bias)


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    common = hf_common(config, "starcoder2")
    common["rms_norm_eps"] = float(config.get("norm_epsilon", 1e-5))
    common["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", True))
    act = config.get("hidden_act", "gelu_pytorch_tanh")
    common.update(_layout(bool(config.get("use_bias", True))))
    return ModelArgs(**common, hidden_act=_ACTIVATIONS.get(act, act),
                     layer_windows=layer_windows(config, common["num_layers"],
                                                 default_sliding=True))


def args_from_gguf(gguf: GGUFFile) -> ModelArgs:
    common = gguf_common(gguf)
    common.update(_layout("blk.0.attn_q.bias" in gguf.tensors))
    window = int(gguf.arch_get("attention.sliding_window", 0) or 0)
    return ModelArgs(**common, hidden_act="gelu_tanh",
                     layer_windows=(window,) * common["num_layers"] if window else ())


FAMILY = Family(
    name="starcoder2", hf_architectures=("Starcoder2ForCausalLM",),
    gguf_architectures=("starcoder2",), args_from_hf=args_from_hf,
    args_from_gguf=args_from_gguf, model_class=DecoderLM,
)
