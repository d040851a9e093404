"""The phi3 family (Phi-3, Phi-3.5-mini, Phi-4-mini): llama's decoder with fused weights —
one QKV projection and one gate/up projection, split at load (`sanitize`) so that sharding
and upload see llama's tensors — partial rotary (Phi-4-mini), a sliding window on every
layer when the config sets one (as transformers applies it), and LongRoPE (the 128k models):
long or short frequency factors chosen once by the serving context (`base.uses_long_factors`),
from the config or from the GGUF's `rope_factors_long` / `rope_factors_short` tensors."""

from __future__ import annotations

from typing import Any

from vllm_actors.errors import ModelFormatError
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.weights import WeightSet
from vllm_actors.models.base import ModelArgs, layer_windows, uses_long_factors
from vllm_actors.models.decoder import DecoderLM
from vllm_actors.models.family import Family
from vllm_actors.models.hparams import gguf_common, hf_common


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    common = hf_common(config, "phi3")
    return ModelArgs(**common, layer_windows=layer_windows(config, common["num_layers"],
                                                           default_sliding=True))


def args_from_gguf(gguf: GGUFFile) -> ModelArgs:
    common = gguf_common(gguf)
    if "rope_factors_long.weight" in gguf.tensors:
        # llama.cpp's converter stores LongRoPE as two factor tensors, the original context
        # and the attention factor it computed
        common["rope_scaling"] = {
            "rope_type": "longrope",
            "original_max_position_embeddings": int(
                gguf.arch_get("rope.scaling.original_context_length")
                or common["max_position_embeddings"]),
            **({"attention_factor": float(gguf.arch_get("rope.scaling.attn_factor"))}
               if gguf.arch_get("rope.scaling.attn_factor") is not None else {})}
    window = int(gguf.arch_get("attention.sliding_window", 0) or 0)
    return ModelArgs(**common, layer_windows=(window,) * common["num_layers"] if window else ())


def sanitize(weights: WeightSet, args: ModelArgs, kind: str) -> WeightSet:
    """blk.N.attn_qkv -> attn_q, attn_k, attn_v; blk.N.ffn_up [2F, D] -> ffn_gate, ffn_up
    (row slices: block-quantized rows stay as stored). A GGUF's LongRoPE factor tensors: the
    set the serving context calls for becomes `rope_freqs` (the decoder divides by it)."""
    tensors = dict(weights.tensors)
    long, short = (tensors.pop(f"rope_factors_{k}.weight", None) for k in ("long", "short"))
    if long is not None and short is not None:
        tensors["rope_freqs.weight"] = long if uses_long_factors(args) else short
    q, kv, f = args.q_size, args.kv_size, args.intermediate_size
    for i in range(args.num_layers):
        p = f"blk.{i}."
        qkv = tensors.pop(p + "attn_qkv.weight", None)
        if qkv is not None:
            if qkv.shape[0] != q + 2 * kv:
                raise ModelFormatError(weights.path, f"{p}attn_qkv has {qkv.shape[0]} rows, "
                                                     f"want {q + 2 * kv}")
            for name, (lo, hi) in (("attn_q", (0, q)), ("attn_k", (q, q + kv)),
                                   ("attn_v", (q + kv, q + 2 * kv))):
                tensors[p + name + ".weight"] = qkv.row_slice(lo, hi)
        up = tensors.get(p + "ffn_up.weight")
        if up is not None and p + "ffn_gate.weight" not in tensors and up.shape[0] == 2 * f:
            tensors[p + "ffn_gate.weight"] = up.row_slice(0, f)
            tensors[p + "ffn_up.weight"] = up.row_slice(f, 2 * f)
    return WeightSet(tensors, weights.path, weights.activations)


FAMILY = Family(
    name="phi3", hf_architectures=("Phi3ForCausalLM",), gguf_architectures=("phi3",),
    args_from_hf=args_from_hf, args_from_gguf=args_from_gguf, model_class=DecoderLM,
    sanitize=sanitize,
)
