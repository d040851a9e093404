"""The decoder-only transformer every family builds on, its block layout chosen by `ModelArgs`.

Per layer: [norm] -> fused QKV (+ biases) -> [q/k norm] -> RoPE -> paged attention (GQA,
per-layer sliding window, optional soft-capping) -> output projection -> [post-norm] ->
residual; then [norm] -> MLP (gated SiLU/GELU, or ungated) -> [post-norm] -> residual.
`norm_placement` ("pre", "sandwich", "post") and `norm_type` pick the norms; embedding,
residual and logit multipliers and the final soft-cap cover gemma and granite.

RoPE pairing follows the weights: llama.cpp stores llama Q/K rows for adjacent-pair rotation.
Under the exact semantics they are put back in NeoX order at load (q.k is unchanged by a
permutation of both); under llama.cpp's semantics they stay in its order, as do its other
float choices (`ggml`, `query_scale`).

A tensor-parallel rank holds its shard (`models/sharding.py`: one all-reduce after attention
and one after the MLP); a pipeline stage (`PipelineStage`) holds its slice of the layers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from vllm_actors.errors import ModelFormatError, ValidationError
from vllm_actors.kernels.ops import AttentionMetadata, Backend, RopeTables, ggml_rope_tables
from vllm_actors.loaders.weights import RawTensor, WeightSet
from vllm_actors.models.base import (ModelArgs, ParallelGroup, PipelineStage, SingleRank,
                                     rope_attention_factor, rope_cos_sin, rope_inv_freq,
                                     rope_kind)
from vllm_actors.models.experts import ExpertLoRA, Experts, load_experts, run_experts
from vllm_actors.models.kv_layout import kv_cache_groups, layer_slots
from vllm_actors.models.lora import LoRABatch, linear
from vllm_actors.models.sharding import ShardPlan

# the GGUF architectures whose llama.cpp graph scales Q before attention (`query_scale`)
_QUERY_PRESCALED = frozenset({"gemma", "gemma2", "gemma3", "phi2", "phi3"})


@dataclass
class Norm:
    weight: Any
    bias: Any = None


@dataclass
class DenseMlp:
    gate_up: Any           # gate and up fused (gated), or up alone
    gate_up_bias: Any
    down: Any
    down_bias: Any         # on rank 0 only


@dataclass
class Layer:
    attn_norm: Norm | None
    qkv: Any
    qkv_bias: Any
    q_norm: Any
    k_norm: Any
    attn_out: Any
    attn_out_bias: Any
    post_attn_norm: Norm | None
    ffn_norm: Norm | None
    mlp: DenseMlp | Experts
    post_ffn_norm: Norm | None
    window: int
    local_rope: bool
    sinks: Any = None          # this rank's heads' attention sink logits (gpt_oss)
    # what selects this layer's kernels: its tensors' types and shapes, window, rope, experts
    kind: tuple = ()


class DecoderLM:
    """Implements `models.base.CausalLM` for every decoder family on any backend.

    Raises:
        ValidationError: the model does not divide among `tp.world_size` ranks, or a feature
            does not shard (full-width q/k norm).
        ModelFormatError: a tensor is missing or shaped unlike the config.
    """

    def __init__(self, args: ModelArgs, weights: WeightSet, backend: Backend,
                 tp: ParallelGroup | None = None, stage: PipelineStage | None = None) -> None:
        self.args = args
        self.backend = backend
        self.tp = tp or SingleRank()
        self.stage = stage or PipelineStage()
        self.layer_ids = self.stage.layers(args.num_layers)
        # llama.cpp's float order where it is the oracle (the quantized GGUF semantics)
        self.ggml = weights.activations == "quantized"
        self.plan = ShardPlan.build(args, self.tp.rank, self.tp.world_size,
                                    gathered=self.ggml)
        if self.plan.sharded and args.qk_norm_full:
            raise ValidationError(f"{args.architecture}: q/k norms over all heads do not "
                                  "shard; use --tensor-parallel-size 1", "tensor_parallel_size")
        self.local_args = self.plan.local_args
        self.scale = args.attn_scale or 1.0 / float(np.sqrt(args.head_dim))
        self.first_rank = self.tp.rank == 0
        # llama.cpp's graphs of these families scale Q by 1.0f / sqrtf(base) in float32
        # before attention (which rounds Q to float16, and small values lose bits there);
        # under its semantics ours do the same and attend with scale 1
        self.query_scale = (np.float32(1.0) / np.sqrt(np.float32(round(self.scale ** -2)))
                            if self.ggml and args.architecture in _QUERY_PRESCALED else None)
        embed = weights.require("token_embd.weight")
        head = weights.get("output.weight") if self.stage.last else None
        if self.plan.sharded:
            embed = self.plan.vocab_table(embed)
            head = None if head is None else head.row_slice(*self.plan.vocab)
        self.embed = backend.upload_table(embed) if self.stage.first else None
        self.head = (backend.upload_lm_head(embed if head is None else head)
                     if self.stage.last else None)
        # Within-head row order that turns adjacent-pair RoPE rows into NeoX halves; under
        # llama.cpp's semantics the rows stay in its order (a dot's lanes follow the order)
        # and RoPE rotates adjacent pairs.
        rot = args.rotary_dim
        self._neox_order = (np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2),
                                            np.arange(rot, args.head_dim)])
                            if args.rope_interleaved and not self.ggml else None)
        self.final_norm = self._norm(weights, "output_norm") if self.stage.last else None
        self.layers = [self._load_layer(weights, i) for i in self.layer_ids]
        group_of = layer_slots(kv_cache_groups(args))[0]   # KV cache group per layer
        self.layer_group = [group_of[i] for i in self.layer_ids]
        freq_factors = weights.get("rope_freqs.weight")
        factors = None if freq_factors is None else freq_factors.to_float32()
        self._pairs = bool(args.rope_interleaved and self.ggml)
        self.rope = self._rope_tables(args, factors, weights)
        self.rope_local = (self._rope_tables(replace(args, rope_theta=args.rope_local_theta,
                                                     rope_scaling={}), None, weights)
                           if args.rope_local_theta else None)

    def _rope_tables(self, args: ModelArgs, factors: np.ndarray | None,
                     weights: WeightSet) -> RopeTables:
        """cos/sin of the model's RoPE: as ggml computes them under the quantized GGUF
        semantics where ggml's plain cache covers the scaling (none, linear, GGUF frequency
        factors), else as transformers does (`rope_inv_freq`)."""
        b = self.backend
        ggml = self.ggml
        kind = rope_kind(args)
        if ggml and kind in ("default", "none", "linear"):
            scale = 1.0 / float(args.rope_scaling["factor"]) if kind == "linear" else 1.0
            cos, sin = ggml_rope_tables(args.max_position_embeddings, args.rotary_dim,
                                        args.rope_theta, factors, scale)
            return RopeTables(b.upload_array(cos), b.upload_array(sin), args.rotary_dim,
                              interleaved=self._pairs, fused=True)
        cos, sin = rope_cos_sin(rope_inv_freq(args, factors, weights.path),
                                args.max_position_embeddings)
        attention_factor = rope_attention_factor(args)
        if attention_factor != 1.0:
            cos *= np.float32(attention_factor)
            sin *= np.float32(attention_factor)
        return RopeTables(b.upload_array(cos), b.upload_array(sin), args.rotary_dim,
                          interleaved=self._pairs, fused=ggml)

    # -- loading -------------------------------------------------------------------------
    def _norm(self, weights: WeightSet, name: str, neox: bool = False) -> Norm:
        b = self.backend
        weight = weights.require(name + ".weight")
        if neox:
            weight = self._neox(weight, 0)
        bias = weights.require(name + ".bias") if self.args.norm_bias else None
        return Norm(b.upload_vector(weight), None if bias is None else b.upload_vector(bias))

    def _neox(self, tensor: RawTensor, num_heads: int) -> RawTensor:
        """Q/K rows (or a per-dim norm weight when num_heads is 0) in NeoX order."""
        if self._neox_order is None:
            return tensor
        dh = self.args.head_dim
        order = (self._neox_order if num_heads == 0 else
                 (np.arange(num_heads)[:, None] * dh + self._neox_order[None, :]).reshape(-1))
        return replace(tensor, data=np.ascontiguousarray(tensor.data[order]))

    def _qkv_shard(self, q: RawTensor, k: RawTensor, v: RawTensor) -> list[RawTensor]:
        """Q/K rows in NeoX order, then this rank's heads of q, k and v (weights or biases)."""
        a, plan, dh = self.args, self.plan, self.args.head_dim
        q, k = self._neox(q, a.num_heads), self._neox(k, a.num_kv_heads)
        if not plan.sharded:
            return [q, k, v]
        return [plan.q_rows(q, dh), plan.kv_rows(k, dh), plan.kv_rows(v, dh)]

    def _row_bias(self, weights: WeightSet, name: str, wanted: bool) -> Any:
        """A row-parallel layer's bias: on rank 0 only (added once before the all-reduce),
        or each rank's rows where the layer is split by output (`ShardPlan.gathered`)."""
        if not wanted:
            return None
        bias = weights.require(name)
        if self.plan.gathered:
            return self.backend.upload_vector(bias.row_slice(*self.plan.hidden))
        return self.backend.upload_vector(bias) if self.first_rank else None

    def _load_layer(self, weights: WeightSet, i: int) -> Layer:
        b, p = self.backend, f"blk.{i}."
        a, plan = self.args, self.plan
        qkv = [weights.require(p + n) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]
        if qkv[0].shape[0] != a.q_size or qkv[1].shape[0] != a.kv_size:
            raise ModelFormatError(weights.path, f"{p}attn_q/attn_k shapes {qkv[0].shape}, "
                                                 f"{qkv[1].shape} do not match the config")
        qkv = self._qkv_shard(*qkv)
        qkv_bias = None
        if a.attention_bias:
            biases = self._qkv_shard(*(weights.require(p + n) for n in (
                "attn_q.bias", "attn_k.bias", "attn_v.bias")))
            qkv_bias = b.upload_array(np.concatenate([t.to_float32() for t in biases]))
        q_norm = k_norm = None
        if a.qk_norm or a.qk_norm_full:
            heads = (a.num_heads, a.num_kv_heads) if a.qk_norm_full else (0, 0)
            q_norm = b.upload_vector(self._neox(weights.require(p + "attn_q_norm.weight"),
                                                heads[0]))
            k_norm = b.upload_vector(self._neox(weights.require(p + "attn_k_norm.weight"),
                                                heads[1]))
        attn_out = weights.require(p + "attn_output.weight")
        if plan.sharded:
            attn_out = plan.o_shard(attn_out, a.head_dim)
        pre = a.norm_placement != "post"
        post = a.norm_placement != "pre"
        window = a.window(i)
        return Layer(
            attn_norm=self._norm(weights, p + "attn_norm") if pre else None,
            qkv=b.upload_linear(qkv), qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm,
            attn_out=b.upload_linear([attn_out]),
            attn_out_bias=self._row_bias(weights, p + "attn_output.bias", a.attn_out_bias),
            post_attn_norm=self._norm(weights, p + "post_attention_norm") if post else None,
            ffn_norm=self._norm(weights, p + "ffn_norm") if pre else None,
            mlp=(load_experts(weights, i, a, self.plan, b) if a.is_sparse(i)
                 else self._load_dense_mlp(weights, i)),
            post_ffn_norm=self._norm(weights, p + "post_ffw_norm") if post else None,
            window=window, local_rope=bool(window and a.rope_local_theta),
            sinks=self._sinks(weights, p) if a.attn_sinks else None,
            kind=(window, bool(window and a.rope_local_theta), a.is_sparse(i),
                  tuple(sorted((n[len(p):], t.qtype, t.shape) for n, t in
                               weights.tensors.items() if n.startswith(p)))),
        )

    def _sinks(self, weights: WeightSet, p: str) -> Any:
        sinks = weights.require(p + "attn_sinks.weight")
        if sinks.shape != (self.args.num_heads,):
            raise ModelFormatError(weights.path, f"{p}attn_sinks has shape {sinks.shape}, "
                                                 f"want ({self.args.num_heads},)")
        return self.backend.upload_vector(self.plan.q_rows(sinks, 1) if self.plan.sharded
                                          else sinks)

    def _load_dense_mlp(self, weights: WeightSet, i: int) -> DenseMlp:
        b, p, a, plan = self.backend, f"blk.{i}.", self.args, self.plan
        names = ("ffn_gate", "ffn_up") if a.gated_mlp else ("ffn_up",)
        gate_up = [weights.require(p + n + ".weight") for n in names]
        gate_up_bias = ([weights.require(p + n + ".bias") for n in names]
                        if a.mlp_bias else [])
        down = weights.require(p + "ffn_down.weight")
        if plan.sharded:
            gate_up = [plan.ffn_rows(t) for t in gate_up]
            gate_up_bias = [plan.ffn_rows(t) for t in gate_up_bias]
            down = plan.down_shard(down)
        return DenseMlp(
            gate_up=b.upload_linear(gate_up),
            gate_up_bias=(b.upload_array(np.concatenate([t.to_float32() for t in gate_up_bias]))
                          if gate_up_bias else None),
            down=b.upload_linear([down]),
            down_bias=self._row_bias(weights, p + "ffn_down.bias", a.mlp_bias))

    # -- compute -------------------------------------------------------------------------
    def _apply_norm(self, x: Any, norm: Norm) -> Any:
        b, eps = self.backend, self.args.rms_norm_eps
        if self.args.norm_type == "layer":
            return b.layer_norm(x, norm.weight, norm.bias, eps)
        return b.rms_norm(x, norm.weight, eps)

    def _add_norm(self, h: Any, delta: Any, norm: Norm | None) -> tuple[Any, Any]:
        """h + delta (the residual), and the next sublayer's input: norm(h), or h itself
        where the family has no pre-norm."""
        b = self.backend
        if self.args.residual_scale != 1.0:
            delta = b.scale(delta, self.args.residual_scale)
        if norm is None:
            h = b.add(h, delta)
            return h, h
        if self.args.norm_type == "rms":
            return b.add_rms_norm(h, delta, norm.weight, self.args.rms_norm_eps)
        h = b.add(h, delta)
        return h, self._apply_norm(h, norm)

    def _rope_and_cache(self, layer: Layer, qkv: Any, rope: Any, kv_cache: Any, attn: Any
                        ) -> Any:
        """q [T, H, Dh] normed and rotated, with k normed, rotated and v in the cache: one
        backend op, but where the q/k norm spans all heads at once (`qk_norm_full`)."""
        b, a, eps = self.backend, self.local_args, self.args.rms_norm_eps
        if layer.q_norm is None or not self.args.qk_norm_full:
            norms = None if layer.q_norm is None else (layer.q_norm, layer.k_norm, eps)
            return b.rope_and_cache(qkv, a.num_heads, a.num_kv_heads, a.head_dim, rope,
                                    kv_cache, attn, norms)
        t, dh = len(qkv), a.head_dim

        def across_heads(x: Any, weight: Any, heads: int) -> Any:
            return b.rms_norm(x.reshape(t, heads * dh), weight, eps).reshape(t, heads, dh)
        q, k, v = b.split_qkv(qkv, a.num_heads, a.num_kv_heads, dh)
        q = b.rope(across_heads(q, layer.q_norm, a.num_heads), rope)
        k = b.rope(across_heads(k, layer.k_norm, a.num_kv_heads), rope)
        b.reshape_and_cache(k, v, kv_cache, attn)
        return q

    def _attention(self, layer: Layer, x: Any, ropes: tuple[Any, Any], attn: Any,
                   kv_cache: Any, lora: LoRABatch | None = None, layer_id: int = 0) -> Any:
        b, a = self.backend, self.local_args
        num_tokens = len(x)
        qkv = linear(b, x, layer.qkv, layer.qkv_bias, lora, layer_id, "qkv", self.ggml)
        q = self._rope_and_cache(layer, qkv, ropes[1] if layer.local_rope else ropes[0],
                                 kv_cache, attn)
        scale = self.scale
        if self.query_scale is not None:
            q, scale = b.scale(q, self.query_scale), 1.0
        out = b.paged_attention(q, kv_cache, attn, scale, layer.window,
                                self.args.attn_logit_softcap, layer.sinks)
        out = self._row_parallel(out.reshape(num_tokens, a.q_size), a.q_size, layer.attn_out,
                                 layer.attn_out_bias, lora, layer_id, "attn_out")
        return out if layer.post_attn_norm is None else self._apply_norm(out,
                                                                         layer.post_attn_norm)

    def _row_parallel(self, x: Any, width: int, weight: Any, bias: Any,
                      lora: LoRABatch | None, layer_id: int, name: str) -> Any:
        """o_proj or down on this rank's part of its input (`width` columns a rank), summed
        over the ranks; where the layer is split by output (`ShardPlan.gathered`), on the
        whole input, gathered first, and the ranks' outputs gathered after."""
        if not self.plan.gathered:
            return self.tp.all_reduce(linear(self.backend, x, weight, bias, lora, layer_id,
                                             name, self.ggml))
        x = self.tp.all_gather_columns(x, self.plan.input_widths(width))
        y = linear(self.backend, x, weight, bias, lora, layer_id, name, self.ggml)
        return self.tp.all_gather_columns(y, list(self.plan.hidden_widths))

    def _mlp(self, layer: Layer, x: Any, lora: LoRABatch | None = None,
             layer_id: int = 0) -> Any:
        b, act, mlp = self.backend, self.args.hidden_act, layer.mlp
        if isinstance(mlp, Experts):
            out = self.tp.all_reduce(run_experts(mlp, x, self.args, b,
                                                 ExpertLoRA(lora, layer_id, self.ggml)))
        else:
            up = linear(b, x, mlp.gate_up, mlp.gate_up_bias, lora, layer_id, "gate_up",
                        self.ggml)
            if not self.args.gated_mlp:
                hidden = b.gelu(up, act == "gelu_tanh")
            elif act == "silu":
                hidden = b.silu_mul(up, self.ggml)
            else:
                hidden = b.gelu_mul(up, act == "gelu_tanh", self.ggml)
            out = self._row_parallel(hidden, self.local_args.intermediate_size, mlp.down,
                                     mlp.down_bias, lora, layer_id, "down")
        return out if layer.post_ffn_norm is None else self._apply_norm(out, layer.post_ffn_norm)

    def _embed(self, token_ids: np.ndarray) -> Any:
        b = self.backend
        if not self.plan.sharded:
            h = b.embedding(self.embed, token_ids)
        else:
            h = self.tp.all_reduce(b.embedding(self.embed, self.plan.local_ids(token_ids)))
        return h if self.args.embed_scale == 1.0 else b.scale(h, self.args.embed_scale)

    def forward(self, token_ids: np.ndarray, positions: np.ndarray,
                meta: AttentionMetadata | Sequence[AttentionMetadata],
                kv_caches: list[Any], hidden_in: Any = None,
                lora: LoRABatch | None = None) -> Any:
        """`meta`: one layout for every layer, or one per KV cache group of
        `kv_cache_groups(args)` (the runner's hybrid layout); `kv_caches`: one per layer of
        this stage; `lora`: the step's adapters and their token rows (`models/lora.py`).
        The last stage returns the final-normed hidden states, an earlier one the residual
        stream for the next (`hidden_in` there)."""
        b = self.backend
        if isinstance(meta, AttentionMetadata):
            layer_attn = [b.prepare_attention(meta)] * len(self.layers)
        else:
            group_attn = [b.prepare_attention(m) for m in meta]
            layer_attn = [group_attn[g] for g in self.layer_group]
        ropes = (b.prepare_rope(positions, self.rope),
                 None if self.rope_local is None else b.prepare_rope(positions, self.rope_local))
        if self.stage.first:
            h = self._embed(token_ids)
        elif hidden_in is None:
            raise ValueError("a pipeline stage after the first needs the previous stage's "
                             "hidden states")
        else:
            h = hidden_in
        first = self.layers[0].attn_norm
        x = h if first is None else self._apply_norm(h, first)
        # the last layer of an earlier stage adds its residual and stops (norm None)
        next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.final_norm]
        for layer, layer_id, attn, kv_cache, next_norm in zip(
                self.layers, self.layer_ids, layer_attn, kv_caches, next_norms):
            # each residual add is fused with the norm that follows it
            h, x = self._add_norm(h, self._attention(layer, x, ropes, attn, kv_cache, lora,
                                                     layer_id), layer.ffn_norm)
            h, x = self._add_norm(h, self._mlp(layer, x, lora, layer_id), next_norm)
        return x if self.stage.last else h

    def warm_up_view(self, kv_caches: list[Any]) -> tuple["DecoderLM", list[Any]]:
        """This model cut to the first layer of each kind, with those layers' KV caches: it
        takes every kernel path of the whole model (the kernels depend on types and shapes,
        not on which layer) at a fraction of a step's cost, so warming a large model up
        compiles what it will run without computing dozens of layers."""
        first: dict[tuple, int] = {}
        for index, layer in enumerate(self.layers):
            first.setdefault(layer.kind, index)
        keep = sorted(first.values())
        view = copy.copy(self)
        view.layers = [self.layers[i] for i in keep]
        view.layer_group = [self.layer_group[i] for i in keep]
        view.layer_ids = [self.layer_ids[i] for i in keep]
        return view, [kv_caches[i] for i in keep]

    def _finish_logits(self, logits: np.ndarray) -> np.ndarray:
        """The family's logit multiplier and soft-cap, on host float32 logits."""
        a = self.args
        if a.logit_scale != 1.0:
            logits *= np.float32(a.logit_scale)
        if a.final_logit_softcap:
            cap = np.float32(a.final_logit_softcap)
            logits /= cap
            np.tanh(logits, out=logits)
            logits *= cap
        return logits

    def compute_logits(self, hidden: Any, rows: np.ndarray, on_device: bool = False) -> Any:
        """On-device logits are for argmax only (`ops.Backend.lm_head`), which the positive
        multiplier and the monotone soft-cap leave unchanged, so they skip both."""
        if not self.plan.sharded:
            logits = self.backend.lm_head(hidden, self.head, rows, on_device)
            return logits if on_device else self._finish_logits(logits)
        width = self.plan.vocab_widths[self.tp.rank]   # drops the tied table's zero row
        local = self.backend.lm_head(hidden, self.head, rows)[:, :width]
        gathered = self.tp.gather_columns(np.ascontiguousarray(local), self.plan.vocab_widths)
        return None if gathered is None else self._finish_logits(gathered)
