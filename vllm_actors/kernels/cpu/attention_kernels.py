"""The parallel entry points of paged attention: run each thread's list of work items, merge
split-context partial states, and write new keys and values into the paged cache.

A work item (a row of `items`, see `attention_plan`) is the query tokens tok0..tok0+nq-1 of one
request under one KV head, over keys k0..k1-1. Threads (`prange` over lanes) take the items the
plan balanced onto them; each thread keeps its own tiles, allocated once per call.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.attention_math import exp2, from_f32
from vllm_actors.kernels.cpu.attention_tiles import (
    NEG_INF, TK, attend_item, finish_rows, load_queries)
from vllm_actors.kernels.cpu.jit import kernel

# columns of a work item
TOK0, NQ, POS0, KVH, K0, K1, PART, REQ = range(8)
ITEM_COLS = 8


@kernel(parallel=True)
def run_lanes(q, kc, vc, block_tables, shift, items, lane_start, g, rows_max, qscale, out, pm,
              pl, pacc):
    """Every item of every lane; lane i runs items lane_start[i]..lane_start[i + 1] - 1.
    `shift` is log2 of the block size."""
    dh = q.shape[2]
    for lane in prange(lane_start.shape[0] - 1):
        qt = np.empty((rows_max, dh), np.float32)
        acc = np.empty((rows_max, dh), np.float32)
        s = np.empty((rows_max, TK), np.float32)
        m = np.empty(rows_max, np.float32)
        l = np.empty(rows_max, np.float32)
        kbuf = np.empty((TK, dh), np.float32)
        vbuf = np.empty((TK, dh), np.float32)
        for it in range(lane_start[lane], lane_start[lane + 1]):
            tok0 = items[it, TOK0]
            nq = items[it, NQ]
            kvh = items[it, KVH]
            load_queries(q, tok0, nq, kvh, g, qscale, qt)
            attend_item(kc, vc, block_tables[items[it, REQ]], shift, items[it, POS0], nq, g, kvh,
                        items[it, K0], items[it, K1], qt, kbuf, vbuf, s, m, l, acc)
            finish_rows(tok0, nq, kvh, g, m, l, acc, items[it, PART], out, pm, pl, pacc)


@kernel(parallel=True)
def merge_parts(merges, g, pm, pl, pacc, out):
    """Combine the partial states of split items: merges rows are (tok0, nq, kvh, part0,
    nparts); row r of every part is query token tok0 + r // g, head kvh * g + r % g."""
    dh = pacc.shape[2]
    for i in prange(merges.shape[0]):
        tok0 = merges[i, 0]
        nq = merges[i, 1]
        kvh = merges[i, 2]
        p0 = merges[i, 3]
        p1 = p0 + merges[i, 4]
        for r in range(nq * g):
            mx = NEG_INF
            for p in range(p0, p1):
                mx = max(mx, pm[p, r])
            tot = np.float32(0.0)
            o = out[tok0 + r // g, kvh * g + r % g]
            for d in range(dh):
                o[d] = 0.0
            for p in range(p0, p1):
                w = exp2(pm[p, r] - mx)
                if w == 0.0:
                    continue
                tot += w * pl[p, r]
                for d in range(dh):
                    o[d] += w * pacc[p, r, d]
            inv = np.float32(1.0) / tot
            for d in range(dh):
                o[d] *= inv


@kernel
def write_rows(k, v, kc, vc, slots, lo, hi):
    """Tokens lo..hi-1 of k, v [T, Hk, Dh] into the caches at their slots (skip slot < 0)."""
    block_size = kc.shape[1]
    hk = kc.shape[2]
    dh = kc.shape[3]
    for t in range(lo, hi):
        slot = slots[t]
        if slot < 0:
            continue
        blk = slot // block_size
        off = slot - blk * block_size
        for h in range(hk):
            for d in range(dh):
                kc[blk, off, h, d] = from_f32(k[t, h, d], kc[0, 0, 0, 0])
                vc[blk, off, h, d] = from_f32(v[t, h, d], vc[0, 0, 0, 0])


@kernel
def write_kv_serial(k, v, kc, vc, slots):
    write_rows(k, v, kc, vc, slots, 0, slots.shape[0])


@kernel(parallel=True)
def write_kv_parallel(k, v, kc, vc, slots, chunks):
    n = slots.shape[0]
    per = (n + chunks - 1) // chunks
    for c in prange(chunks):
        write_rows(k, v, kc, vc, slots, c * per, min(n, (c + 1) * per))
