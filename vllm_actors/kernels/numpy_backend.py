"""The numpy backend: float32 reference for every other backend, and the CPU path.

Weights are dequantized once at upload (float32 matmuls run on BLAS; float16 or per-step
dequantization would be ~100x slower here). Linear weights are stored transposed, `[in, out]`,
so a step's `x @ W` reads them contiguously.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from vllm_actors.kernels import quant
from vllm_actors.kernels.ops import AttentionMetadata, RopeTables, WeightLike


def _float32(weight: WeightLike) -> np.ndarray:
    return quant.dequantize(weight.data, weight.qtype, weight.shape)


class NumpyBackend:
    """Implements `kernels.ops.Backend` with numpy on the host."""

    name = "numpy"

    # -- weights and buffers -------------------------------------------------------------
    def upload_linear(self, parts: Sequence[WeightLike]) -> np.ndarray:
        weight = np.concatenate([_float32(p) for p in parts], axis=0) if len(parts) > 1 \
            else _float32(parts[0])
        return np.ascontiguousarray(weight.T)  # [in, out]

    def upload_table(self, weight: WeightLike) -> np.ndarray:
        return np.ascontiguousarray(_float32(weight))  # [V, D]

    def upload_vector(self, weight: WeightLike) -> np.ndarray:
        return np.ascontiguousarray(_float32(weight).reshape(-1))

    def upload_array(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array, dtype=np.float32)

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int) -> list[tuple[np.ndarray, np.ndarray]]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return [(np.zeros(shape, np.float32), np.zeros(shape, np.float32))
                for _ in range(num_layers)]

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    # -- compute ------------------------------------------------------------------------
    def embedding(self, table: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        return table[token_ids]

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None
               ) -> np.ndarray:
        y = x @ weight
        if bias is not None:
            y += bias
        return y

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        variance = np.mean(np.square(x), axis=-1, keepdims=True)
        return (x / np.sqrt(variance + np.float32(eps))) * weight

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x + y

    def silu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        gate, up = np.split(gate_up, 2, axis=-1)
        return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def rope(self, x: np.ndarray, positions: np.ndarray, tables: RopeTables) -> np.ndarray:
        cos = tables.cos[positions][:, None, :]  # [T, 1, rotary_dim / 2]
        sin = tables.sin[positions][:, None, :]
        rot = x[..., :tables.rotary_dim]
        if tables.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = np.split(rot, 2, axis=-1)
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        out = x.copy()
        if tables.interleaved:
            out[..., 0:tables.rotary_dim:2] = r1
            out[..., 1:tables.rotary_dim:2] = r2
        else:
            half = tables.rotary_dim // 2
            out[..., :half] = r1
            out[..., half:tables.rotary_dim] = r2
        return out

    def reshape_and_cache(self, k: np.ndarray, v: np.ndarray,
                          kv_cache: tuple[np.ndarray, np.ndarray],
                          slot_mapping: np.ndarray) -> None:
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[2:]
        k_cache.reshape(-1, num_kv_heads, head_dim)[slot_mapping] = k
        v_cache.reshape(-1, num_kv_heads, head_dim)[slot_mapping] = v

    def paged_attention(self, q: np.ndarray, kv_cache: tuple[np.ndarray, np.ndarray],
                        meta: AttentionMetadata, scale: float) -> np.ndarray:
        k_cache, v_cache = kv_cache
        num_tokens, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        num_reqs = len(meta.seq_lens)
        num_blocks = -(-meta.max_seq_len // block_size)
        ctx = num_blocks * block_size
        tables = meta.block_tables[:, :num_blocks]
        # [B, Hk, Dh, L] and [B, Hk, L, Dh]
        keys = k_cache[tables].reshape(num_reqs, ctx, num_kv_heads, head_dim).transpose(0, 2, 3, 1)
        values = v_cache[tables].reshape(num_reqs, ctx, num_kv_heads, head_dim).transpose(0, 2, 1, 3)

        q_lens = np.diff(meta.query_start_loc)
        max_q = meta.max_query_len
        rows = np.repeat(np.arange(num_reqs), q_lens)
        cols = np.arange(num_tokens) - meta.query_start_loc[rows]
        padded = np.zeros((num_reqs, max_q, num_heads, head_dim), np.float32)
        padded[rows, cols] = q
        # [B, Hk, max_q * group, Dh]: query head h = kv_head * group + g
        qh = padded.reshape(num_reqs, max_q, num_kv_heads, group, head_dim)
        qh = qh.transpose(0, 2, 1, 3, 4).reshape(num_reqs, num_kv_heads, max_q * group, head_dim)

        scores = (qh @ keys).reshape(num_reqs, num_kv_heads, max_q, group, ctx)
        scores *= np.float32(scale)
        q_pos = (meta.seq_lens - q_lens)[:, None] + np.arange(max_q)[None, :]   # [B, max_q]
        visible = np.arange(ctx)[None, None, :] <= q_pos[:, :, None]            # [B, max_q, L]
        scores = np.where(visible[:, None, :, None, :], scores, np.float32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores, out=scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = probs.reshape(num_reqs, num_kv_heads, max_q * group, ctx) @ values
        out = out.reshape(num_reqs, num_kv_heads, max_q, group, head_dim).transpose(0, 2, 1, 3, 4)
        return out.reshape(num_reqs, max_q, num_heads, head_dim)[rows, cols]

    def lm_head(self, hidden: np.ndarray, table: np.ndarray) -> np.ndarray:
        return hidden @ table.T
