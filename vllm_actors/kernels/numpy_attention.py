"""Paged attention on numpy, batched across requests with no per-request loop per layer.

A step's requests are split once per step into groups that are each computed with one set of
batched matmuls: all decode rows (one query token each) together, and prompt rows bucketed by
query length so that one long prompt chunk does not pad many short ones (a bucket holds rows
at least half as long as its longest). Keys and values are gathered from the paged cache
through each group's block tables; the causal/length masks are built once per step. Long
query runs are cut into chunks of QUERY_CHUNK rows, each reading only the keys it can see.
"""

from __future__ import annotations

from collections.abc import Callable

from dataclasses import dataclass, replace

import numpy as np

from vllm_actors.kernels.kv_quant import QuantizedKV
from vllm_actors.kernels.ops import AttentionMetadata


# Query rows per attention chunk: a chunk's scores ([b, Hk, rows, g, ctx] float32) stay small
# enough to be cache-friendly, and each chunk reads only the keys up to its last position
# (causal), which halves the work of a long prompt.
QUERY_CHUNK = 64


@dataclass(frozen=True)
class AttentionChunk:
    """Query rows [q0, q1) of a group, attending to its first `ctx` keys. Keys before `lo` are
    visible to every row; `mask` ([b, 1, q1 - q0, 1, ctx - lo] float32: 0 where a key is
    visible, -inf elsewhere) covers the rest."""

    q0: int
    q1: int
    lo: int
    ctx: int
    mask: np.ndarray


@dataclass(frozen=True)
class AttentionGroup:
    """Requests attended together.

    Attributes:
        token_index: [n] positions of the group's query tokens in the step.
        covers_all: the group holds every token of the step, in step order.
        block_tables: [b, num_blocks] only the blocks the longest context needs.
        rows / cols: [n] place of each query token in the padded [b, max_q] layout.
        max_q: query rows of the longest request in the group.
        q_pos: [b, max_q] position of each padded query row (for sliding windows).
        chunks: the query axis cut into `AttentionChunk`s.
    """

    token_index: np.ndarray
    covers_all: bool
    block_tables: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    max_q: int
    q_pos: np.ndarray
    chunks: tuple[AttentionChunk, ...]


def _group(meta: AttentionMetadata, q_lens: np.ndarray, members: np.ndarray,
           num_tokens: int) -> AttentionGroup:
    lens = q_lens[members]
    rows = np.repeat(np.arange(len(members)), lens)
    cols = np.arange(len(rows)) - np.repeat(np.cumsum(lens) - lens, lens)
    token_index = meta.query_start_loc[members][rows] + cols
    seq_lens = meta.seq_lens[members]
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // meta.block_size)
    max_q = int(lens.max())
    q_pos = (seq_lens - lens)[:, None] + np.arange(max_q)[None, :]   # [b, max_q]
    chunks = []
    for q0 in range(0, max_q, QUERY_CHUNK):
        q1 = min(max_q, q0 + QUERY_CHUNK)
        ctx = min(max_len, int(q_pos[:, q1 - 1].max()) + 1)
        lo = max(0, min(ctx, int(q_pos[:, q0].min()) + 1))
        visible = np.arange(lo, ctx)[None, None, :] <= q_pos[:, q0:q1, None]   # [b, rows, ·]
        mask = np.where(visible, np.float32(0), np.float32(-np.inf))[:, None, :, None, :]
        chunks.append(AttentionChunk(q0, q1, lo, ctx, mask))
    return AttentionGroup(token_index, len(token_index) == num_tokens,
                          meta.block_tables[members, :num_blocks], rows, cols, max_q, q_pos,
                          tuple(chunks))


def _prompt_buckets(q_lens: np.ndarray, members: np.ndarray) -> list[np.ndarray]:
    order = members[np.argsort(-q_lens[members], kind="stable")]
    buckets = []
    while len(order):
        keep = q_lens[order] * 2 > q_lens[order[0]]
        buckets.append(np.sort(order[keep]))
        order = order[~keep]
    return buckets


@dataclass(frozen=True)
class NumpyAttention:
    """The numpy backend's per-step attention layout."""

    slot_mapping: np.ndarray
    groups: list[AttentionGroup]
    meta: AttentionMetadata            # as given (the llama.cpp-order attention reads it)

    @classmethod
    def build(cls, meta: AttentionMetadata) -> "NumpyAttention":
        q_lens = np.diff(meta.query_start_loc)
        num_tokens = int(meta.query_start_loc[-1])
        decode = np.flatnonzero(q_lens == 1)
        member_sets = ([decode] if len(decode) else []) + \
            _prompt_buckets(q_lens, np.flatnonzero(q_lens > 1))
        return cls(meta.slot_mapping, [_group(meta, q_lens, m, num_tokens) for m in member_sets],
                   meta)


def _window_mask(group: AttentionGroup, chunk: AttentionChunk, window: int) -> np.ndarray:
    """[b, 1, rows, 1, ctx] additive mask hiding keys at or before q_pos - window (padded
    rows are clamped to the chunk's last key so that none is left with no visible key)."""
    q_pos = np.minimum(group.q_pos[:, chunk.q0:chunk.q1], chunk.ctx - 1)
    visible = np.arange(chunk.ctx)[None, None, :] > q_pos[:, :, None] - window
    return np.where(visible, np.float32(0), np.float32(-np.inf))[:, None, :, None, :]


def decoded_group(kv_cache, group: AttentionGroup) -> tuple[tuple, AttentionGroup]:
    """(K, V) the group reads, and the group: a float32 cache as it is; a quantized one
    (`kv_quant.QuantizedKV`) as float32 copies of only the group's blocks, the group's block
    tables renumbered into them."""
    if not isinstance(kv_cache, QuantizedKV):
        return kv_cache, group
    blocks, tables = np.unique(group.block_tables, return_inverse=True)
    return kv_cache.read(blocks), replace(group,
                                          block_tables=tables.reshape(group.block_tables.shape))


def attend(q: np.ndarray, kv_cache: tuple[np.ndarray, np.ndarray], group: AttentionGroup,
           scale: float, window: int = 0, softcap: float = 0.0,
           sinks: np.ndarray | None = None,
           round16: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """q [n, H, Dh] of the group's tokens -> attention output [n, H, Dh] (see
    `ops.Backend.paged_attention` for `window`, `softcap` and `sinks`). `round16`: the
    cache's 16-bit rounding under `KVFormat.ggml_products` (Q rounded before Q.K, the scale
    applied to the scores, P normalized and rounded before P.V)."""
    k_cache, v_cache = kv_cache
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_heads = q.shape[1]
    g = num_heads // num_kv_heads
    b, max_q = len(group.block_tables), group.max_q
    ctx = group.block_tables.shape[1] * block_size
    keys = k_cache[group.block_tables].reshape(b, ctx, num_kv_heads, head_dim).transpose(0, 2, 3, 1)
    if max_q > 1:   # long query runs: contiguous [b, Hk, Dh, ctx] makes the QK^T GEMMs faster
        keys = np.ascontiguousarray(keys)
    values = v_cache[group.block_tables].reshape(b, ctx, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    q = round16(q) if round16 is not None else q * np.float32(scale)
    if max_q == 1:
        qh = q.reshape(b, num_kv_heads, 1, g, head_dim)
    else:
        padded = np.zeros((b, max_q, num_heads, head_dim), np.float32)
        padded[group.rows, group.cols] = q
        qh = padded.reshape(b, max_q, num_kv_heads, g, head_dim).transpose(0, 2, 1, 3, 4)
    out = np.empty((b, num_kv_heads, max_q, g, head_dim), np.float32)
    for chunk in group.chunks:
        rows = (chunk.q1 - chunk.q0) * g      # query head = kv_head * g + i
        qc = qh[:, :, chunk.q0:chunk.q1].reshape(b, num_kv_heads, rows, head_dim)
        scores = (qc @ keys[..., :chunk.ctx]).reshape(b, num_kv_heads, chunk.q1 - chunk.q0, g,
                                                      chunk.ctx)
        if round16 is not None:
            scores *= np.float32(scale)
        if softcap > 0:
            scores *= np.float32(1.0 / softcap)
            np.tanh(scores, out=scores)
            scores *= np.float32(softcap)
        scores[..., chunk.lo:] += chunk.mask
        if window > 0:
            scores += _window_mask(group, chunk, window)
        sink = None if sinks is None else sinks.reshape(1, num_kv_heads, 1, g)
        part = _softmax_values(scores, sink, values[:, :, :chunk.ctx], round16)
        out[:, :, chunk.q0:chunk.q1] = part.reshape(b, num_kv_heads, chunk.q1 - chunk.q0, g,
                                                    head_dim)
    if max_q == 1:
        return out.reshape(b, num_heads, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(b, max_q, num_heads, head_dim)
    return out[group.rows, group.cols]


def _softmax_values(scores: np.ndarray, sink: np.ndarray | None, values: np.ndarray,
                    round16: Callable[[np.ndarray], np.ndarray] | None) -> np.ndarray:
    """softmax(scores [b, Hk, q, g, ctx], with an optional sink column [1, Hk, 1, g]) @
    values [b, Hk, ctx, Dh] -> [b, Hk, q * g, Dh]. With `round16` as ggml's soft_max and
    mul_mat: the probabilities scaled by float32(1 / sum), the sum in float64, then rounded
    to the cache's type."""
    b, hk, nq, g, ctx = scores.shape
    top = scores.max(axis=-1)                                  # [b, Hk, q, g]
    if sink is not None:      # one more softmax column per head, with no value
        top = np.maximum(top, sink)
    scores -= top[..., None]
    np.exp(scores, out=scores)
    denom = scores.sum(axis=-1, dtype=np.float64 if round16 is not None else None)
    if sink is not None:
        denom += np.exp(sink - top)
    if round16 is None:
        part = scores.reshape(b, hk, nq * g, ctx) @ values
        part /= denom.reshape(b, hk, nq * g, 1)
        return part
    scores *= (1.0 / denom).astype(np.float32)[..., None]
    return round16(scores).reshape(b, hk, nq * g, ctx) @ values


def encoder_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bounds: np.ndarray,
                      scale: float) -> np.ndarray:
    """Bidirectional attention of q, k, v [T, H, Dh] within each request's tokens
    (`bounds`: the step's query_start_loc) -> [T, H * Dh]; an encoder's, with no cache and
    no mask. Requests of one length are computed in one set of batched matmuls."""
    t, heads, dh = q.shape
    out = np.empty((t, heads, dh), np.float32)
    starts, lengths = bounds[:-1], np.diff(bounds)
    for n in np.unique(lengths).tolist():
        first = starts[lengths == n]
        rows = (first[:, None] + np.arange(n)[None, :]).reshape(-1)          # [b * n]
        shape = (len(first), n, heads, dh)
        qb = q[rows].reshape(shape).transpose(0, 2, 1, 3)                    # [b, H, n, Dh]
        kb = k[rows].reshape(shape).transpose(0, 2, 3, 1)                    # [b, H, Dh, n]
        vb = v[rows].reshape(shape).transpose(0, 2, 1, 3)
        scores = np.matmul(qb, kb)
        scores *= np.float32(scale)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[rows] = np.matmul(scores, vb).transpose(0, 2, 1, 3).reshape(-1, heads, dh)
    return out.reshape(t, heads * dh)
