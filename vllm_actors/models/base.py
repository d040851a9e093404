"""What every model shares: its hyper-parameters (`ModelArgs`), RoPE frequency tables, and the
`CausalLM` interface the model runner calls."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from vllm_actors.errors import ModelFormatError, UnsupportedModelError, ValidationError
from vllm_actors.kernels.ops import AttentionMetadata


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a decoder-only transformer, whatever file they came from."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rotary_dim: int
    rope_interleaved: bool = False     # ggml NORM / GPT-J pairing (GGUF llama), else NeoX
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False                # q/k RMSNorm per head (qwen3, gemma3)
    # -- what other families vary (defaults: llama) -------------------------------------
    hidden_act: str = "silu"             # silu | gelu_tanh | gelu (erf)
    gated_mlp: bool = True               # act(gate) * up; False: act(up) (starcoder2)
    mlp_bias: bool = False               # biases on the MLP projections
    attn_out_bias: bool = False          # a bias on the attention output projection
    norm_type: str = "rms"               # rms | layer (LayerNorm, with bias when norm_bias)
    norm_bias: bool = False
    norm_placement: str = "pre"          # pre | sandwich (pre and post, gemma2/3) | post (olmo2)
    qk_norm_full: bool = False           # q/k norm over all heads at once (olmo2)
    embed_scale: float = 1.0             # embeddings multiplied by (gemma: sqrt(D))
    attn_scale: float = 0.0              # softmax scale; 0: 1 / sqrt(head_dim)
    residual_scale: float = 1.0          # attention/MLP outputs multiplied by (granite)
    logit_scale: float = 1.0             # logits multiplied by (granite: 1 / logits_scaling)
    final_logit_softcap: float = 0.0     # logits -> cap * tanh(logits / cap) (gemma2)
    attn_logit_softcap: float = 0.0      # attention scores soft-capped (gemma2)
    layer_windows: tuple[int, ...] = ()  # sliding window per layer, 0 = full; () = all full
    rope_local_theta: float = 0.0        # RoPE base of sliding layers (gemma3); 0: rope_theta
    context_len: int = 0                 # the serving context (max_model_len), for the static
    #                                      choices of longrope and dynamic; 0: max positions
    # -- mixture of experts (models/experts.py) ------------------------------------------
    num_experts: int = 0                 # 0: every layer's MLP is dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0       # each expert's MLP width
    norm_topk_prob: bool = True          # top-k routing weights renormalized to sum 1
    shared_expert_size: int = 0          # qwen2_moe's always-on, sigmoid-gated expert
    dense_layers: tuple[int, ...] = ()   # layers with a dense MLP in a sparse model
    moe_routing: str = "softmax_topk"    # softmax_topk | topk_softmax (gpt_oss: softmax of
    #                                      the k largest logits)
    moe_bias: bool = False               # router and expert biases (gpt_oss)
    swiglu_limit: float = 0.0            # gpt_oss's clamped SwiGLU (0: plain SiLU gating),
    swiglu_alpha: float = 1.702          #   `experts.clamped_swiglu`
    attn_sinks: bool = False             # per-head attention sink logits (gpt_oss)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class ParallelGroup(Protocol):
    """The tensor-parallel group a model shard belongs to, handed to the model by its worker
    (models never see processes, shared memory or NCCL; see `workers/parallel_state.py`).
    Every rank makes the same calls in the same order."""

    rank: int
    world_size: int

    def all_reduce(self, x: Any) -> Any:
        """Sum of x (a backend array, e.g. [T, D]) over the ranks; every rank gets the same
        bits (partials are added in rank order)."""

    def gather_columns(self, x: np.ndarray, widths: list[int]) -> np.ndarray | None:
        """Host float32 x [R, widths[rank]] from every rank -> [R, sum(widths)] (the ranks'
        columns in rank order) on rank 0; None on the others."""

    def all_gather_columns(self, x: Any, widths: list[int]) -> Any:
        """A backend array x [R, widths[rank]] from every rank -> [R, sum(widths)], the
        ranks' columns in rank order, on every rank."""

    def broadcast_ids(self, ids: np.ndarray | None, count: int) -> np.ndarray:
        """int64 [count] from rank 0 (others pass None) -> the same array on every rank."""


@dataclass(frozen=True)
class PipelineStage:
    """Which contiguous slice of the layers a pipeline stage holds: stage `index` of `size`
    gets layers [index * L // size, (index + 1) * L // size); the first stage also holds
    the embedding, the last the final norm and the LM head."""

    index: int = 0
    size: int = 1

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        """Raises ValidationError when a stage would get no layer."""
        if num_layers < self.size:
            raise ValidationError(f"{num_layers} layers cannot be split into "
                                  f"--pipeline-parallel-size {self.size} stages",
                                  "pipeline_parallel_size")
        return range(self.index * num_layers // self.size,
                     (self.index + 1) * num_layers // self.size)


class SingleRank:
    """The trivial group of one rank (no tensor parallelism)."""

    rank = 0
    world_size = 1

    def all_reduce(self, x: Any) -> Any:
        return x

    def gather_columns(self, x: np.ndarray, widths: list[int]) -> np.ndarray:
        return x

    def all_gather_columns(self, x: Any, widths: list[int]) -> Any:
        return x

    def broadcast_ids(self, ids: np.ndarray | None, count: int) -> np.ndarray:
        assert ids is not None
        return ids


def layer_windows(config: dict[str, Any], num_layers: int, default_sliding: bool = False
                  ) -> tuple[int, ...]:
    """Per-layer sliding windows from an HF config: its `layer_types` ("sliding_attention" /
    "full_attention") where given, else every layer windowed when `default_sliding` and a
    `sliding_window` is set; () when no layer is windowed."""
    window = int(config.get("sliding_window") or 0)
    types = config.get("layer_types")
    if window <= 0:
        return ()
    if types:
        windows = tuple(window if t == "sliding_attention" else 0 for t in types[:num_layers])
    elif default_sliding:
        windows = (window,) * num_layers
    else:
        return ()
    return windows if any(windows) else ()


def rope_params(config: dict[str, Any], layer_type: str = "full_attention"
                ) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from transformers 5's `rope_parameters` (flat, or per layer
    type as gemma3 writes it) or the older `rope_theta` + `rope_scaling` keys."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(config.get("rope_theta", 10000.0))
        scaling = dict(config.get("rope_scaling") or {})
    if scaling and config.get("original_max_position_embeddings") and \
            not scaling.get("original_max_position_embeddings"):   # phi3 keeps it at the top
        scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return theta, scaling


class CausalLM(Protocol):
    """A model the runner can drive. Backend arrays in, backend arrays out.

    `args` describe the whole model; `local_args` this rank's shard (heads, KV heads and MLP
    width per rank; equal to `args` without tensor parallelism), which sizes the KV cache."""

    args: ModelArgs
    local_args: ModelArgs
    gguf_activations: str   # "quantized" (llama.cpp's semantics) or "float32"; set by the loader
    extra_names: Any        # the family's `hf_name` (GGUF names gguf-py lacks); set by the loader

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata,
                kv_caches: list[Any]) -> Any:
        """token_ids, positions [T] -> final hidden states [T, D] (KV written into kv_caches)."""

    def compute_logits(self, hidden: Any, rows: np.ndarray, on_device: bool = False) -> Any:
        """Rows `rows` of hidden [T, D] -> float32 logits [len(rows), V] on the host (or left
        on the device for the backend's sampling helpers). Under tensor parallelism every
        rank must call it; rank 0 gets the logits, the others None."""


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(args: ModelArgs, scaling: dict[str, Any]) -> np.ndarray:
    """YaRN (Peng et al., 2023) as transformers computes it: per frequency, a linear ramp
    between the interpolated (divided by `factor`) and the original inverse frequency, the
    ramp's ends set by beta_fast / beta_slow rotations over the original context."""
    dim, base = args.rotary_dim, args.rope_theta
    factor = float(scaling.get("factor") or args.max_position_embeddings
                   / scaling["original_max_position_embeddings"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    keep = np.float32(1.0) - ramp
    return (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)


def rope_kind(args: ModelArgs) -> str:
    return args.rope_scaling.get("rope_type", args.rope_scaling.get("type")) or "default"


def _original_context(args: ModelArgs) -> int:
    return int(args.rope_scaling.get("original_max_position_embeddings")
               or args.max_position_embeddings)


def uses_long_factors(args: ModelArgs) -> bool:
    """longrope's static choice, llama.cpp's rule: the long factors when the serving
    context is longer than the original one. transformers chooses per forward pass by the
    sequence's length, so the two agree for every sequence when the context is within the
    original, and for sequences longer than the original otherwise."""
    return (args.context_len or args.max_position_embeddings) > _original_context(args)


def rope_attention_factor(args: ModelArgs) -> float:
    """The factor cos/sin are multiplied by (YaRN's and longrope's attention scaling; 1 for
    other types)."""
    scaling = args.rope_scaling
    kind = rope_kind(args)
    if kind not in ("yarn", "longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind != "yarn":
        original = _original_context(args)
        factor = float(scaling.get("factor") or args.max_position_embeddings / original)
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor = float(scaling.get("factor") or args.max_position_embeddings
                   / scaling["original_max_position_embeddings"])
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


def _dynamic_theta(args: ModelArgs) -> float:
    """Dynamic NTK's base, static as vLLM computes it: for the serving context when that is
    longer than the original context (transformers recomputes it per forward pass for the
    sequence's length, so the two agree on sequences of exactly the serving context and on
    every sequence when the context is within the original)."""
    context, original = args.context_len or args.max_position_embeddings, _original_context(args)
    if context <= original:
        return args.rope_theta
    factor, dim = float(args.rope_scaling["factor"]), args.rotary_dim
    return args.rope_theta * ((factor * context / original) - (factor - 1)) ** (dim / (dim - 2))


def rope_inv_freq(args: ModelArgs, freq_factors: np.ndarray | None = None,
                  path: str | Path = "") -> np.ndarray:
    """inv_freq [rotary_dim / 2] with the model's scaling (none, linear, llama3, yarn,
    longrope, dynamic, or the GGUF `rope_freqs` factors), computed in float32 as transformers
    does.

    Raises:
        UnsupportedModelError: a rope scaling type we do not implement.
        ModelFormatError: a scaling that lacks a key it needs.
    """
    kind = rope_kind(args)
    theta = _dynamic_theta(args) if kind == "dynamic" else args.rope_theta
    exponents = np.arange(0, args.rotary_dim, 2, dtype=np.int64).astype(np.float32)
    inv_freq = (1.0 / (np.float32(theta) ** (exponents / np.float32(args.rotary_dim))))
    inv_freq = inv_freq.astype(np.float32)
    if kind in ("yarn", "longrope", "su") and \
            not args.rope_scaling.get("original_max_position_embeddings"):
        raise ModelFormatError(path or args.architecture, f"{kind} rope scaling needs "
                               "original_max_position_embeddings")
    if kind == "linear":
        inv_freq = inv_freq / np.float32(args.rope_scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, args.rope_scaling)
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(args, args.rope_scaling)
    elif kind in ("longrope", "su") and freq_factors is None:   # GGUF files carry them
        key = "long_factor" if uses_long_factors(args) else "short_factor"
        ext = np.asarray(args.rope_scaling[key], np.float32)
        if ext.shape != inv_freq.shape:
            raise ModelFormatError(path or args.architecture, f"rope {key} has {ext.size} "
                                   f"values, want {inv_freq.size}")
        inv_freq = (np.float32(1.0) / (ext * (np.float32(args.rope_theta)
                                              ** (exponents / np.float32(args.rotary_dim)))))
    elif kind == "dynamic" and not args.rope_scaling.get("factor"):
        raise ModelFormatError(path or args.architecture, "dynamic rope scaling needs a factor")
    elif kind not in ("default", "none", "longrope", "su", "dynamic"):
        raise UnsupportedModelError(path or args.architecture,
                                    f"rope scaling type {kind!r} is not supported (supported: "
                                    "default, linear, llama3, yarn, longrope, su, dynamic)")
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float32)
    return inv_freq.astype(np.float32)


def rope_cos_sin(inv_freq: np.ndarray, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of positions x inv_freq: two float32 [max_positions, len(inv_freq)]."""
    freqs = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(freqs), np.sin(freqs)
