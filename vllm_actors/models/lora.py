"""LoRA on the decoder: an adapter's A/B pairs laid onto the model's fused linears, and the
per-step grouping of token rows by adapter.

The base weights are never merged or copied: each linear of a layer with an adapter adds
`scale * B(A x)` to the rows of the requests that use it (punica's batched form, one group
per adapter); rows without an adapter pay nothing. A fused linear (QKV, gate+up) takes its
parts' A stacked, so x is read once per group, and each part's B writes its columns.
Routed experts (`gate_up.E`, `down.E`) and qwen2_moe's shared expert (`shared_gate_up`,
`shared_down`) are linears of their own; an expert's rows are the step's rows routed to it
(`LoRABatch.select`).

Under tensor parallelism A and B are sharded as vLLM shards them: B along the output of the
column-parallel layers (QKV, gate+up), A along the input of the row-parallel ones (output
projection, down). A row-parallel rank adds `B (A_shard x_shard)` before the layer's
all-reduce, which sums those partial products as vLLM's all-reduce of `A_shard x_shard`
would, without a second collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_actors.errors import ValidationError
from vllm_actors.loaders.lora import LoRAAdapter, LoRAAdapterError
from vllm_actors.loaders.weights import RawTensor

# GGUF linear name -> (the fused linear of our layer it belongs to, its part index)
_ATTN = {"attn_q": ("qkv", 0), "attn_k": ("qkv", 1), "attn_v": ("qkv", 2),
         "attn_output": ("attn_out", 0)}
_GATED = {"ffn_gate": ("gate_up", 0), "ffn_up": ("gate_up", 1), "ffn_down": ("down", 0)}
_UNGATED = {"ffn_up": ("gate_up", 0), "ffn_down": ("down", 0)}


@dataclass(frozen=True)
class LinearLoRA:
    """One adapter on one (maybe fused) linear: `a` [sum of ranks, K] (the parts' A
    stacked), the parts' B transposed side by side in `b_t` [largest r, sum of n]
    (zero-padded), `meta` int64 [P, 5] per part (first rank row in `a`, rank, first output
    column, n, first column in b_t), `scales` float32 [P], `work`, the multiply-adds per
    row, `half`: the weights are float16 values (`loaders.lora.LoRAAdapter.half`), and
    `memo`, what a backend derives from them once (`lora_gemv.lora_args`). A
    backend with a `pack_lora` keeps `a`, `b_t` and `meta` in its own layout instead (the
    compiled CPU backend: `ggml_matmul_f32.pack`, float16 where `half`)."""

    a: Any
    b_t: Any
    meta: Any
    scales: Any
    work: int
    half: bool = False
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)


# an adapter on a model: layer id -> fused linear name -> LinearLoRA
ModelLoRA = dict[int, dict[str, LinearLoRA]]


@dataclass(frozen=True)
class LoRABatch:
    """One step's adapters: per adapter used in the step, its ModelLoRA and the token rows
    (indices into the step's flat tokens) that run with it."""

    groups: tuple[tuple[ModelLoRA, np.ndarray | None], ...]

    def select(self, rows: np.ndarray) -> LoRABatch | None:
        """The groups on the sub-batch of the step's `rows` (an expert's tokens), their
        rows renumbered into it; None where no row of it has an adapter."""
        groups = []
        for adapter, mine in self.groups:
            if mine is not None:
                picked = np.flatnonzero(np.isin(rows, mine))
                if not len(picked):
                    continue
                mine = None if len(picked) == len(rows) else picked
            groups.append((adapter, mine))
        return LoRABatch(tuple(groups)) if groups else None

    def linear(self, backend: Any, x: Any, weight: Any, bias: Any, layer_id: int,
               linear: str, ggml: bool = False) -> Any:
        """`backend.linear(x, weight, bias)` with the adapters' deltas (`apply`). A step
        whose rows all use one adapter, on a backend that fuses the delta into the GEMV
        (`linear_lora`), takes one call where there is no bias."""
        if bias is None and len(self.groups) == 1 and self.groups[0][1] is None:
            lora = self.groups[0][0].get(layer_id, {}).get(linear)
            fused = getattr(backend, "linear_lora", None)
            if lora is not None and fused is not None:
                y = fused(x, weight, lora, ggml)
                if y is not None:
                    return y
        return self.apply(backend, backend.linear(x, weight, bias), x, layer_id, linear, ggml)

    def apply(self, backend: Any, y: Any, x: Any, layer_id: int, linear: str,
              ggml: bool = False) -> Any:
        """y (the linear's output for x) plus each group's adapter delta on its rows
        (`ggml`: in llama.cpp's float order, under its semantics)."""
        for adapter, rows in self.groups:
            lora = adapter.get(layer_id, {}).get(linear)
            if lora is not None:
                y = backend.lora_add(y, x, rows, lora, ggml)
        return y


def linear(backend: Any, x: Any, weight: Any, bias: Any, lora: LoRABatch | None,
           layer_id: int, name: str, ggml: bool = False) -> Any:
    """`backend.linear`, with the step's adapter deltas on linear `name` where there are."""
    if lora is None:
        return backend.linear(x, weight, bias)
    return lora.linear(backend, x, weight, bias, layer_id, name, ggml)


def _targets(model: Any, layer: int) -> dict[str, tuple[str, int]]:
    args = model.args
    if not args.is_sparse(layer):
        return {**_ATTN, **(_GATED if args.gated_mlp else _UNGATED)}
    if args.moe_bias:        # gpt-oss: interleaved, biased experts; not adaptable
        return dict(_ATTN)
    targets = dict(_ATTN)
    for e in range(args.num_experts):
        targets.update({f"ffn_gate.{e}": (f"gate_up.{e}", 0), f"ffn_up.{e}": (f"gate_up.{e}", 1),
                        f"ffn_down.{e}": (f"down.{e}", 0)})
    if args.shared_expert_size:
        targets.update({"ffn_gate_shexp": ("shared_gate_up", 0),
                        "ffn_up_shexp": ("shared_gate_up", 1),
                        "ffn_down_shexp": ("shared_down", 0)})
    return targets


def build_model_lora(model: Any, adapter: LoRAAdapter) -> ModelLoRA:
    """The adapter's pairs for this rank's layers of `model` (a DecoderLM), sharded and in
    the model's row order. Raises LoRAAdapterError for modules the model lacks."""
    args = model.args
    staged: dict[int, dict[str, list[tuple[int, np.ndarray, np.ndarray, float]]]] = {}
    for module, (a, b, scale) in _split_fused(args, adapter.modules).items():
        _, layer, kind = (module.split(".", 2) + ["", ""])[:3]
        target = None
        if module.startswith("blk.") and layer.isdigit() and int(layer) < args.num_layers:
            target = _targets(model, int(layer)).get(kind)
        if target is None:
            raise LoRAAdapterError(adapter.name, adapter.path, f"target module {module!r} is "
                                   "not a linear layer LoRA can adapt in this model "
                                   "(attention q/k/v/o, dense MLP projections, routed and "
                                   "shared experts' projections but gpt-oss's)")
        layer_id = int(layer)
        if layer_id not in model.layer_ids:
            continue          # another pipeline stage's layer
        a, b = _shard(model, adapter, kind, a, b)
        staged.setdefault(layer_id, {}).setdefault(target[0], []).append(
            (target[1], a, b, scale))
    return {layer: {linear: _stack(model, linear, parts, adapter.half)
                    for linear, parts in linears.items()}
            for layer, linears in staged.items()}


def _split_fused(args: Any, modules: dict[str, tuple[np.ndarray, np.ndarray, float]]
                 ) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """Adapters on fused projections (phi3's `qkv_proj` and `gate_up_proj`: GGUF `attn_qkv`
    and a `ffn_up` of twice the MLP width) split as the model splits its weights: each
    part keeps A and takes its rows of B."""
    out = {}
    f = args.intermediate_size
    for module, (a, b, scale) in modules.items():
        prefix, _, kind = module.rpartition(".")     # (an expert's `blk.N.ffn_up.E`: kind E)
        if kind == "attn_qkv" and b.shape[0] == args.q_size + 2 * args.kv_size:
            cuts = np.cumsum([0, args.q_size, args.kv_size, args.kv_size])
            for name, lo, hi in zip(("attn_q", "attn_k", "attn_v"), cuts[:-1], cuts[1:]):
                out[f"{prefix}.{name}"] = (a, b[lo:hi], scale)
        elif kind == "ffn_up" and args.gated_mlp and b.shape[0] == 2 * f and \
                f"{prefix}.ffn_gate" not in modules:
            out[f"{prefix}.ffn_gate"] = (a, b[:f], scale)
            out[module] = (a, b[f:], scale)
        else:
            out[module] = (a, b, scale)
    return out


def _check_shape(adapter: LoRAAdapter, kind: str, a: np.ndarray, b: np.ndarray,
                 rows: int, cols: int) -> None:
    if b.shape[0] != rows or a.shape[1] != cols:
        raise LoRAAdapterError(adapter.name, adapter.path,
                               f"{kind}: lora_A {a.shape} / lora_B {b.shape} do not fit the "
                               f"model's [{rows}, {cols}] weight")


def _hf_to_gguf_rows(b: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
    """Q/K rows from the HF order (NeoX halves per head) to the order llama.cpp's converter
    writes for interleaved-RoPE models (pairs per head)."""
    return b.reshape(num_heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(b.shape)


def _shard(model: Any, adapter: LoRAAdapter, kind: str, a: np.ndarray, b: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """A and B of one module as this rank holds them, Q/K rows in the model's order."""
    args, plan, dh = model.args, model.plan, model.args.head_dim
    proj, _, expert = kind.partition(".")
    if expert or proj.endswith("_shexp"):
        return _shard_expert(model, adapter, kind, a, b)
    rows = {"attn_q": args.q_size, "attn_k": args.kv_size, "attn_v": args.kv_size,
            "attn_output": args.hidden_size, "ffn_gate": args.intermediate_size,
            "ffn_up": args.intermediate_size, "ffn_down": args.hidden_size}[kind]
    cols = {"attn_output": args.q_size, "ffn_down": args.intermediate_size}.get(
        kind, args.hidden_size)
    _check_shape(adapter, kind, a, b, rows, cols)
    tb = RawTensor(kind, b.shape, 0, b)
    ta = RawTensor(kind, a.shape, 0, a)
    if kind in ("attn_q", "attn_k"):
        heads = args.num_heads if kind == "attn_q" else args.num_kv_heads
        if args.rope_interleaved and adapter.row_order == "hf":
            tb = RawTensor(kind, b.shape, 0, _hf_to_gguf_rows(b, heads, dh))
        tb = model._neox(tb, heads)
    if plan.sharded:
        if kind == "attn_q":
            tb = plan.q_rows(tb, dh)
        elif kind in ("attn_k", "attn_v"):
            tb = plan.kv_rows(tb, dh)
        elif kind in ("ffn_gate", "ffn_up"):
            tb = plan.ffn_rows(tb)
        elif plan.gathered:         # split by output rows: B's rows, A whole
            tb = tb.row_slice(*plan.hidden)
        elif kind == "attn_output":
            ta = plan.o_cols(ta, dh)
        else:
            ta = plan.ffn_cols(ta)
    return np.ascontiguousarray(ta.data), np.ascontiguousarray(tb.data)


def _shard_expert(model: Any, adapter: LoRAAdapter, kind: str, a: np.ndarray, b: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """A routed or shared expert's pair as this rank holds it: experts are sharded along
    their MLP width (`models/experts.py`), so gate/up take their slice of B's rows and down
    its slice of A's columns."""
    args, plan = model.args, model.plan
    width = args.shared_expert_size if "_shexp" in kind else args.moe_intermediate_size
    down = kind.startswith("ffn_down")
    _check_shape(adapter, kind, a, b, args.hidden_size if down else width,
                 width if down else args.hidden_size)
    per = width // plan.size
    lo, hi = per * plan.rank, per * (plan.rank + 1)
    a, b = (a[:, lo:hi], b) if down else (a, b[lo:hi])
    return np.ascontiguousarray(a), np.ascontiguousarray(b)


def _part_widths(model: Any, linear: str) -> list[int]:
    """Output columns of each part of one of this rank's fused linears."""
    local, size = model.local_args, model.plan.size
    if linear == "qkv":
        return [local.q_size, local.kv_size, local.kv_size]
    if linear == "gate_up":
        return [local.intermediate_size] * (2 if local.gated_mlp else 1)
    if linear.startswith("gate_up."):
        return [local.moe_intermediate_size // size] * 2
    if linear == "shared_gate_up":
        return [local.shared_expert_size // size] * 2
    return [local.hidden_size]


def _stack(model: Any, linear: str, parts: list[tuple[int, np.ndarray, np.ndarray, float]],
           half: bool) -> LinearLoRA:
    widths = _part_widths(model, linear)
    offsets = np.concatenate([[0], np.cumsum(widths)])
    backend = model.backend
    parts = sorted(parts, key=lambda p: p[0])
    width = max(b.shape[1] for _, _, b, _ in parts)
    b_cat = np.zeros((sum(b.shape[0] for _, _, b, _ in parts), width), np.float32)
    a_rows, meta, r0, b0 = [], [], 0, 0
    for index, a, b, _ in parts:
        a_rows.append(a)
        b_cat[b0:b0 + b.shape[0], :b.shape[1]] = b
        meta.append((r0, a.shape[0], int(offsets[index]), b.shape[0], b0))
        r0 += a.shape[0]
        b0 += b.shape[0]
    a, b_t, meta = np.concatenate(a_rows, axis=0), np.ascontiguousarray(b_cat.T), \
        np.array(meta, np.int64)
    pack = getattr(backend, "pack_lora", None)
    if pack is not None:          # the backend's own layout, its arrays as they are
        a, b_t, meta = pack(a, b_t, meta, half)
    else:
        a, b_t = backend.upload_array(a), backend.upload_array(b_t)
    return LinearLoRA(a, b_t, meta,
                      np.array([p[3] for p in parts], np.float32),
                      a.size + sum(b.size for _, _, b, _ in parts), half)


def check_lora_support(model: Any) -> None:
    """Raises ValidationError where the model cannot take adapters at all."""
    if not hasattr(model, "layer_ids") or not hasattr(model, "plan"):
        raise ValidationError(f"{type(model).__name__} does not take LoRA adapters",
                              "enable_lora")
