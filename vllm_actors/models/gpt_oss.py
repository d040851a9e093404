"""The gpt_oss family (gpt-oss-20b / -120b): a mixture-of-experts decoder with attention sinks
(a learned logit per head that can take attention weight away from every key), sliding-window
attention on every other layer (the first included), biases on the attention projections,
the router and the experts, YaRN RoPE, and experts gated by a clamped SwiGLU with an offset
on the up projection (`experts.clamped_swiglu`). Routing is the softmax of the k largest
router logits.

Weights:
- HF checkpoints stack the experts: `mlp.experts.gate_up_proj` [E, D, 2F] with gate and up
  interleaved by column, `down_proj` [E, F, D] (x @ W layout), and their biases; `sanitize`
  turns them into the per-expert `blk.N.ffn_{gate,up,down}.E.{weight,bias}` every MoE family
  uses.
- llama.cpp's GGUF stacks them as `ffn_{gate,up,down}_exps` [E, out, in] (already split into
  gate and up), usually in MXFP4. MXFP4 has no kernel yet: numpy, OpenCL and CUDA dequantize
  it to float32 at load (exact, 7.5x the file's bytes); the compiled CPU backend requantizes
  it to Q8_0 (its rule for types without kernels, `qmatmul_layout.convert`: each weight moves
  by less than max|block| / 226; 2.1x the bytes).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from vllm_actors.errors import ModelFormatError
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.weights import RawTensor, WeightSet
from vllm_actors.models.base import ModelArgs, layer_windows
from vllm_actors.models.decoder import DecoderLM
from vllm_actors.models.family import Family
from vllm_actors.models.hparams import gguf_common, hf_common
from vllm_actors.models.moe import _expert_rows

F32 = 0
_HF_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702   # llama.cpp's constants (GGUF files carry neither)


def _alternating(num_layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    common = hf_common(config, "gpt-oss")
    num_layers = common["num_layers"]
    types = config.get("layer_types") or _alternating(num_layers)
    return ModelArgs(
        **{**common, "attention_bias": bool(config.get("attention_bias", True))},
        attn_out_bias=bool(config.get("attention_bias", True)), attn_sinks=True,
        num_experts=int(config["num_local_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["intermediate_size"]), norm_topk_prob=False,
        moe_routing="topk_softmax", moe_bias=True,
        swiglu_limit=float(config.get("swiglu_limit", SWIGLU_LIMIT)),
        swiglu_alpha=float(config.get("swiglu_alpha", SWIGLU_ALPHA)),
        layer_windows=layer_windows({**config, "layer_types": types}, num_layers))


def args_from_gguf(gguf: GGUFFile) -> ModelArgs:
    common = gguf_common(gguf)
    if common["rope_scaling"]:   # gpt-oss's YaRN does not round its ramp (HF: truncate=False)
        common["rope_scaling"] = {**common["rope_scaling"], "truncate": False}
    num_layers = common["num_layers"]
    window = int(gguf.arch_get("attention.sliding_window", 0) or 0)
    return ModelArgs(
        **{**common, "attention_bias": True}, attn_out_bias=True, attn_sinks=True,
        num_experts=int(gguf.arch_get("expert_count")),
        num_experts_per_tok=int(gguf.arch_get("expert_used_count")),
        moe_intermediate_size=int(gguf.arch_get("expert_feed_forward_length",
                                                common["intermediate_size"])),
        norm_topk_prob=False, moe_routing="topk_softmax", moe_bias=True,
        swiglu_limit=_gguf_limit(gguf), swiglu_alpha=SWIGLU_ALPHA,
        layer_windows=tuple(window if i % 2 == 0 else 0 for i in range(num_layers))
        if window else ())


def _gguf_limit(gguf: GGUFFile) -> float:
    """`{arch}.swiglu_clamp_exp` where the converter wrote it (one value, or one per layer,
    all equal for gpt-oss), else llama.cpp's constant."""
    value = gguf.arch_get("swiglu_clamp_exp")
    if value is None:
        return SWIGLU_LIMIT
    values = {float(v) for v in (value if isinstance(value, (list, tuple)) else [value])}
    if len(values) != 1:
        raise ModelFormatError(gguf.path, f"swiglu_clamp_exp varies by layer: {sorted(values)}")
    return values.pop()


def hf_name(name: str) -> str | None:
    """The stacked HF experts under temporary names that `sanitize` splits."""
    m = _HF_EXPERTS.fullmatch(name)
    return f"blk.{m[1]}.hf_{m[2]}{m[3] or ''}" if m else None


def _f32(name: str, array: np.ndarray) -> RawTensor:
    array = np.ascontiguousarray(array, np.float32)
    return RawTensor(name, array.shape, F32, array)


def _split_hf_experts(tensors: dict[str, RawTensor], p: str, args: ModelArgs,
                      path: Any) -> None:
    if p + "ffn_down_exps" in tensors:   # gguf-py's map names the HF down_proj (x @ W)
        tensors[p + "hf_down_proj"] = tensors.pop(p + "ffn_down_exps")
    names = [f"{p}hf_{n}" for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                    "down_proj_bias")]
    if not all(n in tensors for n in names):
        missing = [n for n in names if n not in tensors]
        raise ModelFormatError(path, f"gpt_oss experts missing: {missing}")
    gate_up, gate_up_bias, down, down_bias = (tensors.pop(n).to_float32() for n in names)
    num, f = args.num_experts, args.moe_intermediate_size
    if gate_up.shape != (num, args.hidden_size, 2 * f) or down.shape != (num, f,
                                                                         args.hidden_size):
        raise ModelFormatError(path, f"{p} experts shaped {gate_up.shape} / {down.shape}")
    for e in range(num):    # gate and up interleave by column; x @ W -> [out, in] rows
        tensors[f"{p}ffn_gate.{e}.weight"] = _f32("gate", gate_up[e][:, 0::2].T)
        tensors[f"{p}ffn_up.{e}.weight"] = _f32("up", gate_up[e][:, 1::2].T)
        tensors[f"{p}ffn_down.{e}.weight"] = _f32("down", down[e].T)
        tensors[f"{p}ffn_gate.{e}.bias"] = _f32("gate_b", gate_up_bias[e][0::2])
        tensors[f"{p}ffn_up.{e}.bias"] = _f32("up_b", gate_up_bias[e][1::2])
        tensors[f"{p}ffn_down.{e}.bias"] = _f32("down_b", down_bias[e])


def _split_gguf_experts(tensors: dict[str, RawTensor], p: str, args: ModelArgs) -> None:
    for proj in ("ffn_gate", "ffn_up", "ffn_down"):
        stacked = tensors.pop(f"{p}{proj}_exps.weight", None)
        bias = tensors.pop(f"{p}{proj}_exps.bias", None)
        for e in range(args.num_experts):
            if stacked is not None:
                tensors[f"{p}{proj}.{e}.weight"] = _expert_rows(stacked, e,
                                                                f"{p}{proj}.{e}.weight")
            if bias is not None:
                tensors[f"{p}{proj}.{e}.bias"] = _f32(f"{p}{proj}.{e}.bias",
                                                      bias.to_float32()[e])


def sanitize(weights: WeightSet, args: ModelArgs, kind: str) -> WeightSet:
    """Experts to per-expert tensors (see the module docstring); llama.cpp's name for the MLP's
    pre-norm (`post_attention_norm`) to `ffn_norm`; the sinks' name gains `.weight`."""
    tensors = dict(weights.tensors)
    for i in range(args.num_layers):
        p = f"blk.{i}."
        sinks = tensors.pop(p + "attn_sinks", None)
        if sinks is not None:
            tensors[p + "attn_sinks.weight"] = sinks
        norm = tensors.pop(p + "post_attention_norm.weight", None)
        if norm is not None:
            tensors[p + "ffn_norm.weight"] = norm
        if kind == "gguf":
            _split_gguf_experts(tensors, p, args)
        else:
            _split_hf_experts(tensors, p, args, weights.path)
    return WeightSet(tensors, weights.path, weights.activations)


FAMILY = Family(
    name="gpt_oss", hf_architectures=("GptOssForCausalLM",), gguf_architectures=("gpt-oss",),
    args_from_hf=args_from_hf, args_from_gguf=args_from_gguf, model_class=DecoderLM,
    sanitize=sanitize, hf_name=hf_name,
)
