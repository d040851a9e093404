"""The llama family: llama, mistral, qwen2 (q/k/v biases), qwen3 (q/k RMSNorm), smollm.

RMSNorm -> fused QKV -> RoPE -> paged attention (GQA) -> output projection, then RMSNorm ->
fused gate/up -> SwiGLU -> down projection; tied or separate LM head.
RoPE pairing follows the weights: llama.cpp stores llama Q/K rows permuted for adjacent-pair
rotation (HF checkpoints and GGUF qwen use NeoX halves). At load we put such rows back in NeoX
order within each head: q.k is unchanged by a permutation applied to both, and every step then
rotates contiguous halves instead of strided pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vllm_actors.errors import ModelFormatError
from vllm_actors.kernels.ops import AttentionMetadata, Backend, RopeTables
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.weights import RawTensor, WeightSet
from vllm_actors.models.base import (ModelArgs, ParallelGroup, SingleRank, rope_cos_sin,
                                     rope_inv_freq)
from vllm_actors.models.sharding import ShardPlan

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                    "Qwen3ForCausalLM")
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# GGUF architectures whose Q/K rows llama.cpp's converter permutes for adjacent-pair RoPE.
_GGUF_INTERLEAVED_ROPE = {"llama", "mistral"}
_HF_TO_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _rope_params(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from either transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` keys."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return float(params.get("rope_theta", 10000.0)), scaling
    return float(config.get("rope_theta", 10000.0)), dict(config.get("rope_scaling") or {})


def args_from_hf(config: dict[str, Any]) -> ModelArgs:
    arch = config["architectures"][0]
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    theta, scaling = _rope_params(config)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    return ModelArgs(
        architecture=_HF_TO_GGUF_ARCH[arch],
        hidden_size=hidden, num_layers=int(config["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
        intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        rotary_dim=int(head_dim * float(config.get("partial_rotary_factor", 1.0))),
        rope_interleaved=False, rope_scaling=scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", is_qwen2)),
        qk_norm=arch == "Qwen3ForCausalLM",
    )


def args_from_gguf(gguf: GGUFFile) -> ModelArgs:
    arch = gguf.architecture
    get = gguf.arch_get
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    scaling: dict[str, Any] = {}
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0)),
                   "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    vocab = get("vocab_size") or len(gguf.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        vocab = gguf.tensors["token_embd.weight"].shape[0]
    return ModelArgs(
        architecture=arch, hidden_size=hidden, num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim, intermediate_size=int(get("feed_forward_length")),
        vocab_size=int(vocab), rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        rotary_dim=int(get("rope.dimension_count", head_dim)),
        rope_interleaved=arch in _GGUF_INTERLEAVED_ROPE, rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
    )


@dataclass
class _Layer:
    attn_norm: Any
    qkv: Any
    qkv_bias: Any
    q_norm: Any
    k_norm: Any
    attn_out: Any
    ffn_norm: Any
    gate_up: Any
    down: Any


class LlamaForCausalLM:
    """Implements `models.base.CausalLM` for the llama family on any backend.

    With a `tp` group of several ranks this is one rank's shard (`models/sharding.py`): its
    heads and MLP slice, one all-reduce after attention and one after the MLP, a vocab-split
    embedding (all-reduced) and LM head (gathered to rank 0).

    Raises:
        ValidationError: the model does not divide among `tp.world_size` ranks.
    """

    def __init__(self, args: ModelArgs, weights: WeightSet, backend: Backend,
                 tp: ParallelGroup | None = None) -> None:
        self.args = args
        self.backend = backend
        self.tp = tp or SingleRank()
        self.plan = ShardPlan.build(args, self.tp.rank, self.tp.world_size)
        self.local_args = self.plan.local_args
        self.scale = 1.0 / float(np.sqrt(args.head_dim))
        embed = weights.require("token_embd.weight")
        head = weights.get("output.weight")
        if self.plan.sharded:
            embed = self.plan.vocab_table(embed)
            head = None if head is None else head.row_slice(*self.plan.vocab)
        self.embed = backend.upload_table(embed)
        self.head = backend.upload_lm_head(embed if head is None else head)
        # Within-head row order that turns adjacent-pair RoPE rows into NeoX halves.
        rot = args.rotary_dim
        self._neox_order = (np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2),
                                            np.arange(rot, args.head_dim)])
                            if args.rope_interleaved else None)
        self.final_norm = backend.upload_vector(weights.require("output_norm.weight"))
        self.layers = [self._load_layer(weights, i) for i in range(args.num_layers)]
        freq_factors = weights.get("rope_freqs.weight")
        inv_freq = rope_inv_freq(args, None if freq_factors is None else
                                 freq_factors.to_float32(), weights.path)
        cos, sin = rope_cos_sin(inv_freq, args.max_position_embeddings)
        self.rope = RopeTables(backend.upload_array(cos), backend.upload_array(sin),
                               args.rotary_dim, interleaved=False)

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

    def _load_layer(self, weights: WeightSet, i: int) -> _Layer:
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
        if a.qk_norm:
            q_norm = b.upload_vector(self._neox(weights.require(p + "attn_q_norm.weight"), 0))
            k_norm = b.upload_vector(self._neox(weights.require(p + "attn_k_norm.weight"), 0))
        attn_out = weights.require(p + "attn_output.weight")
        gate, up, down = (weights.require(p + n) for n in ("ffn_gate.weight", "ffn_up.weight",
                                                            "ffn_down.weight"))
        if plan.sharded:
            attn_out = plan.o_cols(attn_out, a.head_dim)
            gate, up, down = plan.ffn_rows(gate), plan.ffn_rows(up), plan.ffn_cols(down)
        return _Layer(
            attn_norm=b.upload_vector(weights.require(p + "attn_norm.weight")),
            qkv=b.upload_linear(qkv), qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm,
            attn_out=b.upload_linear([attn_out]),
            ffn_norm=b.upload_vector(weights.require(p + "ffn_norm.weight")),
            gate_up=b.upload_linear([gate, up]), down=b.upload_linear([down]),
        )

    def _attention(self, layer: _Layer, x: Any, rope: Any, attn: Any, kv_cache: Any) -> Any:
        b, a = self.backend, self.local_args
        num_tokens = len(x)
        qkv = b.linear(x, layer.qkv, layer.qkv_bias)
        q, k, v = b.split_qkv(qkv, a.num_heads, a.num_kv_heads, a.head_dim)
        if layer.q_norm is not None:
            q = b.rms_norm(q, layer.q_norm, a.rms_norm_eps)
            k = b.rms_norm(k, layer.k_norm, a.rms_norm_eps)
        q = b.rope(q, rope)
        k = b.rope(k, rope)
        b.reshape_and_cache(k, v, kv_cache, attn)
        out = b.paged_attention(q, kv_cache, attn, self.scale)
        return self.tp.all_reduce(b.linear(out.reshape(num_tokens, a.q_size), layer.attn_out))

    def _embed(self, token_ids: np.ndarray) -> Any:
        if not self.plan.sharded:
            return self.backend.embedding(self.embed, token_ids)
        return self.tp.all_reduce(self.backend.embedding(self.embed,
                                                         self.plan.local_ids(token_ids)))

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata,
                kv_caches: list[Any]) -> Any:
        b, eps, tp = self.backend, self.args.rms_norm_eps, self.tp
        attn = b.prepare_attention(meta)
        rope = b.prepare_rope(positions, self.rope)
        h = self._embed(token_ids)
        x = b.rms_norm(h, self.layers[0].attn_norm, eps)
        next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.final_norm]
        for layer, kv_cache, next_norm in zip(self.layers, kv_caches, next_norms):
            # each residual add is fused with the norm that follows it
            h, x = b.add_rms_norm(h, self._attention(layer, x, rope, attn, kv_cache),
                                  layer.ffn_norm, eps)
            mlp = b.linear(b.silu_mul(b.linear(x, layer.gate_up)), layer.down)
            h, x = b.add_rms_norm(h, tp.all_reduce(mlp), next_norm, eps)
        return x

    def compute_logits(self, hidden: Any, rows: np.ndarray, on_device: bool = False) -> Any:
        if not self.plan.sharded:
            return self.backend.lm_head(hidden, self.head, rows, on_device)
        width = self.plan.vocab_widths[self.tp.rank]   # drops the tied table's zero row
        local = self.backend.lm_head(hidden, self.head, rows)[:, :width]
        return self.tp.gather_columns(np.ascontiguousarray(local), self.plan.vocab_widths)
