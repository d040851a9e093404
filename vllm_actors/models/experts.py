"""Mixture-of-experts MLP: loading each expert and the routed forward.

Routing as transformers does it for mixtral, qwen2_moe, qwen3_moe and olmoe: router logits ->
softmax over all experts (float32) -> the top k -> renormalized to sum 1 where the family does
(`norm_topk_prob`); for gpt_oss: the top k logits (the router has a bias) -> their softmax,
with biased experts whose gate is gpt-oss's clamped SwiGLU (computed on the host).
Tokens are then grouped by expert and each expert's MLP runs once over its tokens (an
[n_e, D] matmul, not n_e GEMVs); outputs are weighted and summed per token on the host.
The routing is host work (a few numbers per token), so the layer needs only the
backend's linear and SiLU ops and runs on every backend; device backends pay one copy of the
step's activations each way per sparse layer.

Under tensor parallelism each rank holds its slice of every expert's MLP width (and of the
shared expert's); the decoder's all-reduce after the MLP sums the slices.

LoRA adapters on the experts (`models/lora.py`) add their deltas inside each expert's
matmuls, over the rows of its tokens that run with an adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vllm_actors.kernels.ops import Backend
from vllm_actors.loaders.weights import RawTensor, WeightSet
from vllm_actors.models.base import ModelArgs
from vllm_actors.models.lora import LoRABatch, linear


@dataclass
class Experts:
    router: Any                    # [E, D] linear
    gate_up: list[Any]             # per expert: gate and up rows of this rank, fused
    down: list[Any]                # per expert: [D, F_local]
    shared_gate_up: Any = None     # qwen2_moe's shared expert and its sigmoid gate
    shared_down: Any = None
    shared_gate: Any = None
    router_bias: Any = None        # gpt_oss: router and expert biases (down: rank 0's only)
    gate_up_bias: list[Any] | None = None
    down_bias: list[Any] | None = None


def _slice(width: int, rank: int, size: int) -> tuple[int, int]:
    per = width // size
    return rank * per, (rank + 1) * per


def _mlp_weights(weights: WeightSet, names: tuple[str, str, str], width: int, plan: Any
                 ) -> tuple[list[RawTensor], RawTensor]:
    gate, up, down = (weights.require(n) for n in names)
    if plan.sharded:
        lo, hi = _slice(width, plan.rank, plan.size)
        gate, up, down = gate.row_slice(lo, hi), up.row_slice(lo, hi), down.col_slice(lo, hi)
    return [gate, up], down


def load_experts(weights: WeightSet, layer: int, args: ModelArgs, plan: Any,
                 backend: Backend) -> Experts:
    """Layer `layer`'s router and experts (`blk.N.ffn_{gate,up,down}.E.weight`)."""
    p, b = f"blk.{layer}.", backend
    gate_up, down = [], []
    for e in range(args.num_experts):
        parts, d = _mlp_weights(weights, tuple(f"{p}{proj}.{e}.weight" for proj in (
            "ffn_gate", "ffn_up", "ffn_down")), args.moe_intermediate_size, plan)
        gate_up.append(b.upload_linear(parts))
        down.append(b.upload_linear([d]))
    experts = Experts(router=b.upload_linear([weights.require(p + "ffn_gate_inp.weight")]),
                      gate_up=gate_up, down=down)
    if args.moe_bias:
        experts.router_bias = b.upload_vector(weights.require(p + "ffn_gate_inp.bias"))
        experts.gate_up_bias, experts.down_bias = [], []
        for e in range(args.num_experts):
            parts = [weights.require(f"{p}{proj}.{e}.bias") for proj in ("ffn_gate", "ffn_up")]
            if plan.sharded:
                lo, hi = _slice(args.moe_intermediate_size, plan.rank, plan.size)
                parts = [t.row_slice(lo, hi) for t in parts]
            experts.gate_up_bias.append(b.upload_array(
                np.concatenate([t.to_float32() for t in parts])))
            down_bias = weights.require(f"{p}ffn_down.{e}.bias")
            experts.down_bias.append(b.upload_vector(down_bias) if plan.rank == 0 else None)
    if args.shared_expert_size:
        parts, d = _mlp_weights(weights, tuple(f"{p}{proj}_shexp.weight" for proj in (
            "ffn_gate", "ffn_up", "ffn_down")), args.shared_expert_size, plan)
        experts.shared_gate_up = b.upload_linear(parts)
        experts.shared_down = b.upload_linear([d])
        gate = weights.require(p + "ffn_gate_inp_shexp.weight")
        if len(gate.shape) == 1:     # llama.cpp stores the shared expert's gate as a vector
            gate = RawTensor(gate.name, (1, gate.shape[0]), gate.qtype, gate.data.reshape(1, -1))
        experts.shared_gate = b.upload_linear([gate])
    return experts


def route(logits: np.ndarray, k: int, renormalize: bool, routing: str = "softmax_topk"
          ) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [T, E] -> (experts [T, k], weights [T, k] float32), the highest
    probability first (ties to the lower expert id, as torch.topk on CPU)."""
    if routing == "topk_softmax":
        chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        top = np.take_along_axis(logits, chosen, -1)
        weights = np.exp(top - top[:, :1])
        return chosen, (weights / weights.sum(-1, keepdims=True)).astype(np.float32)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, -1)
    if renormalize:
        weights /= weights.sum(-1, keepdims=True)
    return chosen, weights.astype(np.float32)


def clamped_swiglu(gate_up: np.ndarray, limit: float, alpha: float) -> np.ndarray:
    """gpt-oss's gate on [n, 2F] (gate columns, then up): min(g, L) * sigmoid(alpha *
    min(g, L)) * (clip(u, -L, L) + 1)."""
    f = gate_up.shape[1] // 2
    gate = np.minimum(gate_up[:, :f], np.float32(limit))
    up = np.clip(gate_up[:, f:], np.float32(-limit), np.float32(limit))
    glu = gate / (np.float32(1.0) + np.exp(-np.float32(alpha) * gate))
    return ((up + np.float32(1.0)) * glu).astype(np.float32)


@dataclass(frozen=True)
class ExpertLoRA:
    """The step's adapters (`LoRABatch`, None: none) as layer `layer_id`'s experts see them."""

    batch: LoRABatch | None = None
    layer_id: int = 0
    ggml: bool = False

    def on(self, rows: np.ndarray) -> ExpertLoRA:
        """The adapters of the step's `rows` (one expert's tokens), renumbered into them."""
        return self if self.batch is None else replace(self, batch=self.batch.select(rows))

    def linear(self, b: Backend, x: Any, weight: Any, bias: Any, name: str) -> Any:
        return linear(b, x, weight, bias, self.batch, self.layer_id, name, self.ggml)


def _expert_mlp(experts: Experts, e: int, x: Any, args: ModelArgs, b: Backend,
                lora: ExpertLoRA) -> np.ndarray:
    bias = experts.gate_up_bias[e] if experts.gate_up_bias else None
    gate_up = lora.linear(b, x, experts.gate_up[e], bias, f"gate_up.{e}")
    if args.swiglu_limit:
        h = b.from_host(clamped_swiglu(np.asarray(b.to_host(gate_up), np.float32),
                                       args.swiglu_limit, args.swiglu_alpha))
    else:
        h = b.silu_mul(gate_up)
    return b.to_host(lora.linear(b, h, experts.down[e],
                                 experts.down_bias[e] if experts.down_bias else None,
                                 f"down.{e}"))


def _shared_expert(experts: Experts, x: Any, b: Backend, lora: ExpertLoRA) -> np.ndarray:
    up = lora.linear(b, x, experts.shared_gate_up, None, "shared_gate_up")
    shared = b.to_host(lora.linear(b, b.silu_mul(up), experts.shared_down, None,
                                   "shared_down"))
    gate = b.to_host(b.linear(x, experts.shared_gate))
    return shared * (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate)))


def run_experts(experts: Experts, x: Any, args: ModelArgs, backend: Backend,
                lora: ExpertLoRA = ExpertLoRA()) -> Any:
    """The routed MLP of x [T, D] -> [T, D] (this rank's partial sum under TP)."""
    b, k = backend, args.num_experts_per_tok
    host_x = b.to_host(x)
    logits = np.asarray(b.to_host(b.linear(x, experts.router, experts.router_bias)),
                        np.float32)
    chosen, weights = route(logits, k, args.norm_topk_prob, args.moe_routing)
    out = np.zeros(host_x.shape, np.float32)
    flat = chosen.reshape(-1)
    order = np.argsort(flat, kind="stable")                  # (token, slot) pairs by expert
    bounds = np.searchsorted(flat[order], np.arange(args.num_experts + 1))
    for e in range(args.num_experts):
        picks = order[bounds[e]:bounds[e + 1]]
        if not len(picks):
            continue
        tokens = picks // k                                   # each token once per expert
        y = _expert_mlp(experts, e, b.from_host(np.ascontiguousarray(host_x[tokens])), args, b,
                        lora.on(tokens))
        out[tokens] += y * weights.reshape(-1)[picks][:, None]
    if experts.shared_gate_up is not None:
        out += _shared_expert(experts, x, b, lora)
    return b.from_host(out)
