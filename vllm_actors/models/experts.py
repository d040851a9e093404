"""Mixture-of-experts MLP: loading each expert and the routed forward.

Routing as transformers does it for mixtral, qwen2_moe, qwen3_moe and olmoe: router logits ->
softmax over all experts (float32) -> the top k -> renormalized to sum 1 where the family does
(`norm_topk_prob`). Tokens are then grouped by expert and each expert's MLP runs once over its
tokens (an [n_e, D] matmul, not n_e GEMVs); outputs are weighted and summed per token on the
host. The routing is host work (a few numbers per token), so the layer needs only the
backend's linear and SiLU ops and runs on every backend; device backends pay one copy of the
step's activations each way per sparse layer.

Under tensor parallelism each rank holds its slice of every expert's MLP width (and of the
shared expert's); the decoder's all-reduce after the MLP sums the slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_actors.kernels.ops import Backend
from vllm_actors.loaders.weights import RawTensor, WeightSet
from vllm_actors.models.base import ModelArgs


@dataclass
class Experts:
    router: Any                    # [E, D] linear
    gate_up: list[Any]             # per expert: gate and up rows of this rank, fused
    down: list[Any]                # per expert: [D, F_local]
    shared_gate_up: Any = None     # qwen2_moe's shared expert and its sigmoid gate
    shared_down: Any = None
    shared_gate: Any = None


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


def route(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [T, E] -> (experts [T, k], weights [T, k] float32), the highest
    probability first (ties to the lower expert id, as torch.topk on CPU)."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, -1)
    if renormalize:
        weights /= weights.sum(-1, keepdims=True)
    return chosen, weights.astype(np.float32)


def run_experts(experts: Experts, x: Any, args: ModelArgs, backend: Backend) -> Any:
    """The routed MLP of x [T, D] -> [T, D] (this rank's partial sum under TP)."""
    b, k = backend, args.num_experts_per_tok
    host_x = b.to_host(x)
    logits = np.asarray(b.to_host(b.linear(x, experts.router)), np.float32)
    chosen, weights = route(logits, k, args.norm_topk_prob)
    out = np.zeros(host_x.shape, np.float32)
    flat = chosen.reshape(-1)
    order = np.argsort(flat, kind="stable")                  # (token, slot) pairs by expert
    bounds = np.searchsorted(flat[order], np.arange(args.num_experts + 1))
    for e in range(args.num_experts):
        picks = order[bounds[e]:bounds[e + 1]]
        if not len(picks):
            continue
        tokens = picks // k                                   # each token once per expert
        h = b.silu_mul(b.linear(b.from_host(np.ascontiguousarray(host_x[tokens])),
                                experts.gate_up[e]))
        y = b.to_host(b.linear(h, experts.down[e]))
        out[tokens] += y * weights.reshape(-1)[picks][:, None]
    if experts.shared_gate_up is not None:
        shared = b.to_host(b.linear(b.silu_mul(b.linear(x, experts.shared_gate_up)),
                                    experts.shared_down))
        gate = b.to_host(b.linear(x, experts.shared_gate))
        out += shared * (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate)))
    return b.from_host(out)
