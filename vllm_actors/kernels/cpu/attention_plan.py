"""The work partition of one step's paged attention, computed once per step and head shape
(a small serial kernel: a few microseconds, where the same in numpy calls costs ~0.2 ms).

Units of work:
- a decode request (one query token) is one unit over all its KV heads, so each KV block is
  read front to back once (the cache is [block, offset, head, dim]); a step of fewer
  requests than threads makes each KV head of its decodes a unit (`HEAD_ITEM_KEYS`), so a
  lone stream's attention runs on every thread;
- a prefill chunk is cut into query tiles of about TILE_FLOATS / Dh rows (tile tokens x g
  query heads), one unit per (tile, KV head), so each key/value row is read once for the g
  query heads sharing it.

Balance: a unit of more than SPLIT_KEYS keys is split along its keys into equal parts of at
most SPLIT_KEYS (flash-decoding style; `merge_parts` combines them in order), so long decodes
keep every core busy. The split depends on the unit's keys alone, never on the thread count
or the rest of the batch, so a request's attention gives the same floats on any number of
threads and in any batch (a KV head's rows are the same floats alone or beside the others).
Threads take items, largest first, from a shared counter (one for each kind of item).

Sliding window: a unit's keys start at its first row's window start (p - window + 1); costs
and splits count only the keys from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_actors.kernels.cpu.attention_kernels import (
    ITEM_COLS,
    K0,
    K1,
    KVH0,
    KVH1,
    NQ,
    PART,
    POS0,
    REQ,
    TOK0,
)
from vllm_actors.kernels.cpu.attention_tiles import TK
from vllm_actors.kernels.cpu.jit import kernel

TILE_FLOATS = 4096        # a prefill tile's query rows x head dim (its accumulator: 16 KiB)
SPLIT_KEYS = 512          # a unit with more keys is split into parts of at most this many
LOAD_COST = 4.0           # cost of loading a key (and value) row, in row x key units
HEAD_ITEM_KEYS = 192      # a lone decode's KV heads are items of their own from this many keys


@dataclass(frozen=True)
class Plan:
    """Work items ([n, ITEM_COLS] int64, columns named in attention_kernels): the `blocked`
    first (several query tokens of one KV head, head dim a multiple of 4:
    `attention_kernels.blocked_lane`), then the others, each kind largest first; threads to
    run them on, the merges of split items ([m, 6]) and the partial-state slots they need,
    and the most rows an item has."""

    items: np.ndarray
    blocked: int
    lanes: int
    merges: np.ndarray
    num_parts: int
    rows_max: int


@kernel(inline=True)      # a kernel of its own compiled once per literal argument: 4 times
def _put(units, u, tok0, nq, pos0, kend, kvh0, kvh1, req, window):
    units[u, 0] = tok0
    units[u, 1] = nq
    units[u, 2] = pos0
    units[u, 3] = kend
    units[u, 4] = kvh0
    units[u, 5] = kvh1
    units[u, 6] = req
    units[u, 7] = max(pos0 - window + 1, 0) if window > 0 else 0


@kernel
def _units(qsl, seq_lens, hk, g, tile_tokens, window, by_head):
    """[U, 8] int64 (tok0, nq, pos0, key_end, kvh0, kvh1, req, key_start) and cost of each
    unit (window 0: none); `by_head`: a decode request is one unit per KV head."""
    per_decode = hk if by_head else 1
    heads = hk // per_decode          # a decode unit's KV heads
    count = 0
    for b in range(seq_lens.shape[0]):
        ql = qsl[b + 1] - qsl[b]
        count += per_decode if ql == 1 else (ql + tile_tokens - 1) // tile_tokens * hk
    units = np.empty((count, 8), np.int64)
    cost = np.empty(count, np.float64)
    u = 0
    for b in range(seq_lens.shape[0]):
        ql = qsl[b + 1] - qsl[b]
        start = seq_lens[b] - ql
        if ql == 1:
            for h in range(per_decode):
                _put(units, u, qsl[b], 1, start, start + 1, h * heads, h * heads + heads, b,
                     window)
                cost[u] = heads * (g + LOAD_COST) * (start + 1 - units[u, 7])
                u += 1
            continue
        for i0 in range(0, ql, tile_tokens):
            nq = min(tile_tokens, ql - i0)
            kend = start + i0 + nq
            for h in range(hk):
                _put(units, u, qsl[b] + i0, nq, start + i0, kend, h, h + 1, b, window)
                seen = kend - (nq - 1) / 2.0          # keys a row sees, on average
                if window > 0:
                    seen = min(seen, float(window))
                cost[u] = nq * g * seen + LOAD_COST * (kend - units[u, 7])
                u += 1
    return units, cost


@kernel
def _plan(qsl, seq_lens, hk, g, tile_tokens, window, by_head):
    units, cost = _units(qsl, seq_lens, hk, g, tile_tokens, window, by_head)
    n_units = units.shape[0]
    splits = np.ones(n_units, np.int64)
    chunk = np.empty(n_units, np.int64)
    for u in range(n_units):
        keys = units[u, 3] - units[u, 7]
        s = max((keys + SPLIT_KEYS - 1) // SPLIT_KEYS, 1)
        c = max((((keys + s - 1) // s + TK - 1) // TK) * TK, TK)
        chunk[u] = c
        splits[u] = max((keys + c - 1) // c, 1)
    n_items = splits.sum()
    n_merges = 0
    for u in range(n_units):
        n_merges += 1 if splits[u] > 1 else 0
    items = np.empty((n_items, ITEM_COLS), np.int64)
    item_cost = np.empty(n_items, np.float64)
    merges = np.empty((n_merges, 6), np.int64)
    it = 0
    part = 0
    mi = 0
    rows_max = 1
    for u in range(n_units):
        tok0 = units[u, 0]
        nq = units[u, 1]
        kend = units[u, 3]
        kstart = units[u, 7]
        kvh0 = units[u, 4]
        kvh1 = units[u, 5]
        rows_max = max(rows_max, nq * g * (kvh1 - kvh0))
        s = splits[u]
        if s > 1:
            merges[mi, 0] = tok0
            merges[mi, 1] = nq
            merges[mi, 2] = kvh0
            merges[mi, 3] = kvh1
            merges[mi, 4] = part
            merges[mi, 5] = s
            mi += 1
        for j in range(s):
            k0 = kstart + j * chunk[u]
            k1 = min(kend, k0 + chunk[u])
            items[it, TOK0] = tok0
            items[it, NQ] = nq
            items[it, POS0] = units[u, 2]
            items[it, KVH0] = kvh0
            items[it, KVH1] = kvh1
            items[it, K0] = k0
            items[it, K1] = k1
            items[it, REQ] = units[u, 6]
            items[it, PART] = part if s > 1 else -1
            part += 1 if s > 1 else 0
            item_cost[it] = cost[u] * (k1 - k0) / max(kend - kstart, 1)
            it += 1
    return items, item_cost, merges, part, rows_max


def _by_head(seq_lens: np.ndarray, num_kv_heads: int, threads: int, window: int) -> bool:
    """Whether a decode request's KV heads are items of their own: where the step has fewer
    requests than threads and enough keys to pay for a parallel region (each head's floats
    are the same either way)."""
    keys = int(seq_lens.max(initial=0))
    return 1 < num_kv_heads and len(seq_lens) < threads and \
        (min(keys, window) if window > 0 else keys) >= HEAD_ITEM_KEYS


def build_plan(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_kv_heads: int, g: int,
               head_dim: int, threads: int, window: int = 0) -> Plan:
    """The items of a step for `num_kv_heads` KV heads of `g` query heads each
    (query_start_loc and seq_lens as int64), for a sliding window (0: none)."""
    tile_tokens = max(1, max(16, TILE_FLOATS // head_dim) // g)
    items, cost, merges, parts, rows_max = _plan(query_start_loc, seq_lens, num_kv_heads, g,
                                                 tile_tokens, int(window),
                                                 _by_head(seq_lens, num_kv_heads, threads,
                                                          int(window)))
    blocked = (items[:, NQ] > 1) & (items[:, KVH1] - items[:, KVH0] == 1) & \
        (head_dim % 4 == 0)
    if len(items) > 1:
        items = items[np.lexsort((-cost, ~blocked))]      # stable: ties keep the plan's order
    return Plan(items, int(blocked.sum()), max(1, min(threads, len(items))), merges,
                int(parts), int(rows_max))
