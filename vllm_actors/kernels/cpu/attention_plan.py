"""The work partition of one step's paged attention, computed once per step and head shape.

Units of work: each decode request (one query token) is one unit; each prefill chunk is cut
into query tiles of about TILE_FLOATS / Dh rows (tile tokens x g query heads per KV head). Every
unit is repeated for each KV head, so the g query heads that share a KV head are computed
together and each key/value row is read once for all of them.

Balance: a unit whose cost is large next to the step's total over the threads is split along
its keys (flash-decoding style: each split keeps its own softmax max/sum/accumulator and
`merge_parts` combines them), down to MIN_SPLIT_KEYS keys a split. This is what keeps both
cores busy at decode batch 1, where there are only Hk units. Items are then cut into one
contiguous run per thread by cumulative cost (items stay ordered by request, KV head, query
tile, so the tiles of one head that read the same keys run back to back on one thread).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_actors.kernels.cpu.attention_kernels import ITEM_COLS, K0, K1, KVH, NQ, PART, POS0, REQ, TOK0
from vllm_actors.kernels.cpu.attention_tiles import TK

TILE_FLOATS = 4096        # a prefill tile's query rows x head dim (its accumulator: 16 KiB)
MIN_SPLIT_KEYS = 128      # a key split never has fewer keys than this (a multiple of TK)
SPLITS_PER_THREAD = 8     # aim: no item costs more than total / (threads * this)
ROW_COST, LOAD_COST = 1.0, 4.0   # per row x key, and per key loaded into a tile (x Dh)


@dataclass(frozen=True)
class Plan:
    """Work items ([n, ITEM_COLS] int64, columns named in attention_kernels), thread runs
    (`lane_start` [lanes + 1]), the merges of split items ([m, 5]: tok0, nq, kvh, part0,
    nparts) and the partial-state slots they need."""

    items: np.ndarray
    lane_start: np.ndarray
    merges: np.ndarray
    num_parts: int
    rows_max: int


def _units(query_start_loc: np.ndarray, seq_lens: np.ndarray, tile_tokens: int
           ) -> np.ndarray:
    """[U, 5] int64: tok0, nq, pos0, key_end, req of each query tile, in request order."""
    qsl = query_start_loc.astype(np.int64)
    q_lens = np.diff(qsl)
    lens = seq_lens.astype(np.int64)
    tiles = np.where(q_lens > 0, -(-q_lens // tile_tokens), 0)
    tiles[q_lens == 1] = 1
    req = np.repeat(np.arange(len(q_lens)), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    i0 = (np.arange(len(req)) - first) * tile_tokens
    nq = np.minimum(tile_tokens, q_lens[req] - i0)
    pos0 = lens[req] - q_lens[req] + i0
    return np.stack([qsl[req] + i0, nq, pos0, pos0 + nq, req], axis=1)


def build_plan(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_kv_heads: int, g: int,
               head_dim: int, threads: int) -> Plan:
    """The items of a step for `num_kv_heads` KV heads of `g` query heads each."""
    tile_tokens = max(1, max(16, TILE_FLOATS // head_dim) // g)
    units = _units(query_start_loc, seq_lens, tile_tokens)
    tok0, nq, pos0, kend, req = units.T
    visible = kend - (nq - 1) / 2.0          # mean keys a row of the tile sees
    cost = ROW_COST * nq * g * visible + LOAD_COST * kend
    total = float(cost.sum()) * num_kv_heads
    splits = np.ones(len(units), np.int64)
    if threads > 1 and len(units):
        target = total / (threads * SPLITS_PER_THREAD)
        splits = np.clip(np.ceil(cost / max(target, 1.0)).astype(np.int64), 1,
                         np.maximum(kend // MIN_SPLIT_KEYS, 1))
    chunk = -(-(-(-kend // splits)) // TK) * TK           # keys a split, a multiple of TK
    splits = np.maximum(-(-kend // chunk), 1)
    # expand: unit -> KV heads -> splits (in that order)
    uh = np.repeat(np.arange(len(units)), num_kv_heads)
    head = np.tile(np.arange(num_kv_heads), len(units))
    s_uh = splits[uh]
    u = np.repeat(uh, s_uh)
    j = np.arange(len(u)) - np.repeat(np.cumsum(s_uh) - s_uh, s_uh)
    items = np.empty((len(u), ITEM_COLS), np.int64)
    items[:, TOK0] = tok0[u]
    items[:, NQ] = nq[u]
    items[:, POS0] = pos0[u]
    items[:, KVH] = np.repeat(head, s_uh)
    items[:, K0] = j * chunk[u]
    items[:, K1] = np.minimum(kend[u], (j + 1) * chunk[u])
    items[:, REQ] = req[u]
    split = s_uh > 1
    is_part = np.repeat(split, s_uh)
    items[:, PART] = np.where(is_part, np.cumsum(is_part) - 1, -1)
    part0 = np.cumsum(np.where(split, s_uh, 0)) - np.where(split, s_uh, 0)
    merges = np.stack([tok0[uh], nq[uh], head, part0, s_uh], axis=1)[split]
    item_cost = (cost[u] * (items[:, K1] - items[:, K0]) / kend[u]) if len(u) else cost[u]
    lanes = max(1, min(threads, len(items)))
    ends = np.cumsum(item_cost)
    mids = ends - item_cost / 2
    share = ends[-1] / lanes if len(ends) else 1.0
    lane_of = np.minimum((mids / max(share, 1e-30)).astype(np.int64), lanes - 1)
    lane_start = np.searchsorted(lane_of, np.arange(lanes + 1), side="left").astype(np.int64)
    return Plan(items, lane_start, np.ascontiguousarray(merges, np.int64),
                int(is_part.sum()), int(tile_tokens * g if (nq > 1).any() else g))
