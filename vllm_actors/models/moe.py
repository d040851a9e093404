"""Mixture-of-experts families: mixtral, qwen2_moe (with a gated shared expert), qwen3_moe,
olmoe (q/k norms over all heads). The decoder runs their sparse MLPs (`models/experts.py`);
this module reads their hyper-parameters and names their expert weights.

Weights: GGUF stacks each layer's experts (`ffn_gate_exps` [E, F, D], ...); HF checkpoints
name each expert (`mlp.experts.3.gate_proj`, mixtral's `block_sparse_moe.experts.3.w1`).
Both become per-expert tensors `blk.N.ffn_{gate,up,down}.E.weight` at load.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.weights import RawTensor, WeightSet
from vllm_actors.models.base import ModelArgs, layer_windows
from vllm_actors.models.decoder import DecoderLM
from vllm_actors.models.family import Family
from vllm_actors.models.hparams import gguf_common, hf_common

_HF_TO_GGUF_ARCH = {"MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
                    "Qwen3MoeForCausalLM": "qwen3moe", "OlmoeForCausalLM": "olmoe"}
# HF per-expert names -> (layer, expert, projection)
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_PROJ = {"gate_proj": "ffn_gate", "w1": "ffn_gate", "up_proj": "ffn_up", "w3": "ffn_up",
         "down_proj": "ffn_down", "w2": "ffn_down"}
_HF_OTHER = {"block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
             "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
             # the dense layers of a sparse model (qwen2_moe's mlp_only_layers)
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}


def hf_name(name: str) -> str | None:
    """GGUF-style names for the MoE tensors gguf-py's map leaves out."""
    m = _HF_EXPERT.fullmatch(name)
    if m:
        return f"blk.{m[1]}.{_PROJ[m[3]]}.{m[2]}.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m[2] in _HF_OTHER:
        return f"blk.{m[1]}.{_HF_OTHER[m[2]]}"
    return None


def _windows(config: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """mixtral slides every layer when its config sets a window (as transformers does); the
    qwen MoE models only with use_sliding_window."""
    if arch == "MixtralForCausalLM":
        return layer_windows(config, num_layers, default_sliding=True)
    return layer_windows(config, num_layers) if config.get("use_sliding_window") else ()


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    arch = config["architectures"][0]
    common = hf_common(config, _HF_TO_GGUF_ARCH[arch])
    num_layers = common["num_layers"]
    if arch == "Qwen2MoeForCausalLM":
        common["attention_bias"] = bool(config.get("qkv_bias", True))
    step = int(config.get("decoder_sparse_step", 1) or 1)
    dense = {int(i) for i in config.get("mlp_only_layers") or ()}
    dense |= {i for i in range(num_layers) if (i + 1) % step}
    experts = int(config.get("num_local_experts") or config.get("num_experts"))
    return ModelArgs(
        **common, qk_norm=arch == "Qwen3MoeForCausalLM", qk_norm_full=arch == "OlmoeForCausalLM",
        num_experts=experts, num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config.get("moe_intermediate_size")
                                  or config["intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", arch == "MixtralForCausalLM")),
        shared_expert_size=int(config.get("shared_expert_intermediate_size") or 0),
        dense_layers=tuple(sorted(dense)),
        layer_windows=_windows(config, arch, num_layers))


def args_from_gguf(gguf: GGUFFile) -> ModelArgs:
    arch, get = gguf.architecture, gguf.arch_get
    common = gguf_common(gguf)
    if arch == "llama":       # mixtral is a llama GGUF with experts; its Q/K rows are permuted
        common["rope_interleaved"] = True
    if arch == "olmoe":
        common["qk_norm"] = False
    shared = gguf.tensors.get("blk.0.ffn_up_shexp.weight")
    return ModelArgs(
        **common, qk_norm_full=arch == "olmoe",
        num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length",
                                      common["intermediate_size"])),
        # llama.cpp renormalizes for mixtral and qwen3moe, not for qwen2moe and olmoe
        norm_topk_prob=bool(get("expert_weights_norm", arch in ("llama", "qwen3moe"))),
        shared_expert_size=0 if shared is None else int(shared.shape[0]),
        dense_layers=tuple(i for i in range(common["num_layers"])
                           if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors))


def _expert_rows(tensor: RawTensor, expert: int, name: str) -> RawTensor:
    """Expert `expert`'s 2-D weight out of a stacked [E, out, in] GGUF tensor (block rows of
    a quantized one are [E * out, row bytes])."""
    num, rows = tensor.shape[0], tensor.shape[1]
    data = tensor.data
    if data.ndim == 2 and data.shape[0] == num * rows:
        data = data.reshape(num, rows, data.shape[1])
    return RawTensor(name, tuple(tensor.shape[1:]), tensor.qtype,
                     np.ascontiguousarray(data[expert]), tensor.activations)


def sanitize(weights: WeightSet, args: ModelArgs, kind: str) -> WeightSet:
    """GGUF's stacked experts -> one tensor per expert (HF names arrive per expert)."""
    if kind != "gguf":
        return weights
    tensors = dict(weights.tensors)
    for i in range(args.num_layers):
        for proj in ("ffn_gate", "ffn_up", "ffn_down"):
            stacked = tensors.pop(f"blk.{i}.{proj}_exps.weight", None)
            if stacked is None:
                continue
            for e in range(args.num_experts):
                name = f"blk.{i}.{proj}.{e}.weight"
                tensors[name] = _expert_rows(stacked, e, name)
    return WeightSet(tensors, weights.path, weights.activations)


FAMILY = Family(
    name="moe", hf_architectures=tuple(_HF_TO_GGUF_ARCH),
    gguf_architectures=("qwen2moe", "qwen3moe", "olmoe"),
    args_from_hf=args_from_hf, args_from_gguf=args_from_gguf, model_class=DecoderLM,
    sanitize=sanitize, hf_name=hf_name,
)
