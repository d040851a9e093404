"""The entry points of paged attention: run the step's work items (in parallel), merge
split-context partial states, and write new keys and values into the paged cache.

A work item (a row of `items`, see `attention_plan`) is the query tokens tok0..tok0+nq-1 of one
request under KV heads kvh0..kvh1-1, over keys k0..k1-1. Its rows are head-major: row
(h - kvh0) * nq * g + i * g + j is query token tok0 + i, query head h * g + j. Each thread
(`prange` over lanes) keeps its own tiles and takes the next item from a shared atomic
counter, so a thread slowed by anything (a long item, another process on its core) takes
fewer items instead of holding the step up; items come sorted by decreasing cost.

Items with many query rows of one KV head (prefill) run `attention_prefill.attend_prefill`
(register-blocked, transposed: `blocked_lane`); the others (decode: one token, all KV heads)
`attend_item` (dot products over `attention_tiles`: `row_lane`). The plan puts the blocked
items first.

A thread's loop of each kind, with those inlined, is compiled once per cache variant as a C
callback (`lane_callback`) that the parallel entry and the one-thread entry call by address;
a step whose items are all of one kind never compiles the other.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import carray, prange, types

from vllm_actors.kernels.cpu.attention_math import (
    exp2,
    sink_scale,
    from_f32,
    row_source,
    stage_rows,
)
from vllm_actors.kernels.cpu.attention_prefill import PK, attend_prefill, finish_prefill
from vllm_actors.kernels.cpu.attention_tiles import (
    NEG_INF,
    TK,
    ZERO,
    prefetch_rows,
    softcap_rows,
    softmax_rows,
    tile_pv,
    tile_scores,
)
from vllm_actors.kernels.cpu.elementwise import rms_row, rope_row
from vllm_actors.kernels.cpu.intrinsics import call_address, data_pointer, fetch_add
from vllm_actors.kernels.cpu.jit import Callback, callback, kernel

# columns of a work item
TOK0, NQ, POS0, KVH0, KVH1, K0, K1, PART, REQ = range(9)
ITEM_COLS = 9
# columns of a merge: (tok0, nq, kvh0, kvh1, first partial slot, partial slots)
M_TOK0, M_NQ, M_KVH0, M_KVH1, M_PART0, M_PARTS = range(6)


@kernel(inline=True)
def attend_item(q, kc, vc, table, shift, hk, tok0, pos0, nq, g, kvh0, kvh1, k0, k1, qscale,
                window, cap, qt, kbuf, vbuf, offs, s, m, l, acc):
    """The item's rows over keys k0..k1-1, causal (query token i sits at position pos0 + i)
    within the sliding `window`, scores soft-capped at `cap` (base 2; 0: none); leaves the
    unnormalized state in m, l, acc (rows head-major; m = -inf, l = 0 for a row that saw no
    key). kc, vc: flat caches."""
    dh = acc.shape[1]
    rows = nq * g
    for h in range(kvh0, kvh1):
        for i in range(nq):
            for j in range(g):
                r = (h - kvh0) * rows + i * g + j
                for d in range(dh):
                    qt[r, d] = q[tok0 + i, h * g + j, d] * qscale
                    acc[r, d] = ZERO
                m[r] = NEG_INF
                l[r] = ZERO
    ksrc = row_source(kc, kbuf)
    vsrc = row_source(vc, vbuf)
    end = min(k1, pos0 + nq)
    for t0 in range(max(k0, pos0 - window + 1), end, TK):   # from the first row's window
        n = min(TK, end - t0)
        ahead = min(TK, end - t0 - n)
        prefetch_rows(kc, table, shift, hk, dh, kvh0, kvh1, t0 + n, ahead)
        prefetch_rows(vc, table, shift, hk, dh, kvh0, kvh1, t0 + n, ahead)
        for h in range(kvh0, kvh1):
            r0 = (h - kvh0) * rows
            stage_rows(kc, table, shift, hk, h, t0, n, kbuf, offs)
            tile_scores(qt, r0, rows, ksrc, offs, n, s)
            if cap > ZERO:
                softcap_rows(s, r0, rows, n, cap)
            softmax_rows(s, r0, nq, g, pos0, t0, n, window, m, l, acc)
            stage_rows(vc, table, shift, hk, h, t0, n, vbuf, offs)
            tile_pv(s, r0, rows, vsrc, offs, n, acc)


@kernel(inline=True)
def finish_rows(tok0, nq, g, kvh0, kvh1, m, l, acc, part, out, pm, pl, pacc, sinks):
    """Normalized rows into `out` (sinks as in `sink_scale`), or the raw state into partial
    slot `part` (the merge adds the sinks)."""
    dh = acc.shape[1]
    rows = nq * g
    for h in range(kvh0, kvh1):
        for i in range(nq):
            for j in range(g):
                r = (h - kvh0) * rows + i * g + j
                if part < 0:
                    inv = sink_scale(sinks, h * g + j, m[r], l[r])
                    for d in range(dh):
                        out[tok0 + i, h * g + j, d] = acc[r, d] * inv
                else:
                    pm[part, r] = m[r]
                    pl[part, r] = l[r]
                    for d in range(dh):
                        pacc[part, r, d] = acc[r, d]


@kernel(inline=True)
def _staging(tile, dh):  # type: ignore[no-untyped-def]
    """A lane's buffers for `tile` key and value rows staged as float32, and their offsets."""
    return (np.empty(tile * dh, np.float32), np.empty(tile * dh, np.float32),
            np.empty(tile, np.uint64))


@kernel(inline=True)
def row_lane(q, kc, vc, block_tables, shift, hk, items, counter, g, rows_max, qscale, window,
             cap, sinks, out, pm, pl, pacc):
    """One thread's share of the items `attend_item` runs, taken in order from the shared
    `counter` until none is left. kc, vc: the caches flattened; `shift` is log2 of the block
    size, hk the KV heads; window and cap as in `attend_item`; sinks: per-head logits, base 2
    (empty: none)."""
    dh = q.shape[2]
    qt = np.empty((rows_max, dh), np.float32)
    acc = np.empty((rows_max, dh), np.float32)
    s = np.empty((rows_max, TK), np.float32)
    m = np.empty(rows_max, np.float32)
    l = np.empty(rows_max, np.float32)
    kbuf, vbuf, offs = _staging(TK, dh)
    it = fetch_add(counter, 1)
    while it < items.shape[0]:
        tok0 = items[it, TOK0]
        nq = items[it, NQ]
        kvh0 = items[it, KVH0]
        kvh1 = items[it, KVH1]
        attend_item(q, kc, vc, block_tables[items[it, REQ]], shift, hk, tok0, items[it, POS0],
                    nq, g, kvh0, kvh1, items[it, K0], items[it, K1], qscale, window, cap, qt,
                    kbuf, vbuf, offs, s, m, l, acc)
        finish_rows(tok0, nq, g, kvh0, kvh1, m, l, acc, items[it, PART], out, pm, pl, pacc,
                    sinks)
        it = fetch_add(counter, 1)


@kernel(inline=True)
def blocked_lane(q, kc, vc, block_tables, shift, hk, items, counter, g, rows_max, qscale,
                 window, cap, sinks, out, pm, pl, pacc):
    """`row_lane` for the items `attend_prefill` runs (several query tokens of one KV head,
    the head dim a multiple of 4: `attention_plan.Plan.blocked`)."""
    dh = q.shape[2]
    ldp = (rows_max + 15) // 16 * 16          # rows, padded for the 16-row blocks
    qT = np.empty((dh, ldp), np.float32)
    accT = np.empty((dh, ldp), np.float32)
    sT = np.empty((PK, ldp), np.float32)
    m = np.empty(ldp, np.float32)
    l = np.empty(ldp, np.float32)
    mref = np.empty(ldp, np.float32)
    kbuf, vbuf, offs = _staging(max(TK, PK), dh)
    it = fetch_add(counter, 1)
    while it < items.shape[0]:
        tok0 = items[it, TOK0]
        nq = items[it, NQ]
        kvh0 = items[it, KVH0]
        attend_prefill(q, kc, vc, block_tables[items[it, REQ]], shift, hk, tok0,
                       items[it, POS0], nq, g, kvh0, items[it, K0], items[it, K1], qscale,
                       window, cap, qT, accT, sT, m, l, mref, kbuf, vbuf, offs)
        finish_prefill(tok0, nq, g, kvh0, m, l, accT, items[it, PART], out, pm, pl, pacc,
                       sinks)
        it = fetch_add(counter, 1)


_F32P, _I64P, _I64, _F32 = (types.CPointer(types.float32), types.CPointer(types.int64),
                            types.int64, types.float32)


@kernel(inline=True)
def _lane(run, q_p, t, heads, dh, kc, vc, tab_p, reqs, width, shift, hk, items_p, n_items,
          counter_p, g, rows_max, qscale, window, cap, sinks_p, n_sinks, out_p, pm_p, pl_p,
          pacc_p, parts):  # type: ignore[no-untyped-def]
    """The lane `run` (`row_lane` or `blocked_lane`) on arrays made from the callback's
    pointers and shapes."""
    run(carray(q_p, (t, heads, dh)), kc, vc, carray(tab_p, (reqs, width)), shift, hk,
        carray(items_p, (n_items, ITEM_COLS)), carray(counter_p, (1,)), g, rows_max, qscale,
        window, cap, carray(sinks_p, (n_sinks,)), carray(out_p, (t, heads, dh)),
        carray(pm_p, (parts, rows_max)), carray(pl_p, (parts, rows_max)),
        carray(pacc_p, (parts, rows_max, dh)))


@kernel(inline=True)
def _coded_cache(d_p, nd, lut_p, nlut, lay_p, nlay):  # type: ignore[no-untyped-def]
    """A quantized cache as the lanes take it: (data, lut, layout), see `attention_kv`."""
    return carray(d_p, (nd,)), carray(lut_p, (nlut,)), carray(lay_p, (nlay,))


# The four callbacks: module functions, not closures (a closure over a dispatcher missed
# numba's cache every start), one per cache kind and lane; numba's C callbacks take no
# *args. A float32 or float16 cache comes as flat arrays (no tables).
def _flat_rows(q_p, t, heads, dh, k_p, nk, kl_p, nkl, ky_p, nky, v_p, nv, vl_p, nvl, vy_p, nvy,
               tab_p, reqs, width, shift, hk, items_p, n_items, counter_p, g, rows_max, qscale,
               window, cap, sinks_p, n_sinks, out_p, pm_p, pl_p, pacc_p, parts):
    _lane(row_lane, q_p, t, heads, dh, carray(k_p, (nk,)), carray(v_p, (nv,)), tab_p, reqs,
          width, shift, hk, items_p, n_items, counter_p, g, rows_max, qscale, window, cap,
          sinks_p, n_sinks, out_p, pm_p, pl_p, pacc_p, parts)


def _flat_blocked(q_p, t, heads, dh, k_p, nk, kl_p, nkl, ky_p, nky, v_p, nv, vl_p, nvl, vy_p,
                  nvy, tab_p, reqs, width, shift, hk, items_p, n_items, counter_p, g, rows_max,
                  qscale, window, cap, sinks_p, n_sinks, out_p, pm_p, pl_p, pacc_p, parts):
    _lane(blocked_lane, q_p, t, heads, dh, carray(k_p, (nk,)), carray(v_p, (nv,)), tab_p,
          reqs, width, shift, hk, items_p, n_items, counter_p, g, rows_max, qscale, window, cap,
          sinks_p, n_sinks, out_p, pm_p, pl_p, pacc_p, parts)


def _coded_rows(q_p, t, heads, dh, k_p, nk, kl_p, nkl, ky_p, nky, v_p, nv, vl_p, nvl, vy_p, nvy,
                tab_p, reqs, width, shift, hk, items_p, n_items, counter_p, g, rows_max, qscale,
                window, cap, sinks_p, n_sinks, out_p, pm_p, pl_p, pacc_p, parts):
    _lane(row_lane, q_p, t, heads, dh, _coded_cache(k_p, nk, kl_p, nkl, ky_p, nky),
          _coded_cache(v_p, nv, vl_p, nvl, vy_p, nvy), tab_p, reqs, width, shift, hk, items_p,
          n_items, counter_p, g, rows_max, qscale, window, cap, sinks_p, n_sinks, out_p, pm_p,
          pl_p, pacc_p, parts)


def _coded_blocked(q_p, t, heads, dh, k_p, nk, kl_p, nkl, ky_p, nky, v_p, nv, vl_p, nvl, vy_p,
                   nvy, tab_p, reqs, width, shift, hk, items_p, n_items, counter_p, g, rows_max,
                   qscale, window, cap, sinks_p, n_sinks, out_p, pm_p, pl_p, pacc_p, parts):
    _lane(blocked_lane, q_p, t, heads, dh, _coded_cache(k_p, nk, kl_p, nkl, ky_p, nky),
          _coded_cache(v_p, nv, vl_p, nvl, vy_p, nvy), tab_p, reqs, width, shift, hk, items_p,
          n_items, counter_p, g, rows_max, qscale, window, cap, sinks_p, n_sinks, out_p, pm_p,
          pl_p, pacc_p, parts)


_LANES = {(False, False): _flat_rows, (False, True): _flat_blocked,
          (True, False): _coded_rows, (True, True): _coded_blocked}


@functools.cache
def lane_callback(cache_dtype: str, quantized: bool, blocked: bool) -> Callback:
    """`row_lane` or (`blocked`) `blocked_lane` as a C callback for caches of `cache_dtype`
    (float32, uint16 for float16 bits; uint8 or uint16 when `quantized`, with a float32 table
    and an int64 layout): one compile serves the parallel entry and the one-thread call, where
    a parallel kernel calling a lane compiled its body again (docs/BENCHMARKS.md, "Cold
    start"). Two lanes, so that a process compiles only the items its steps run: the
    cold-start helper of `workers.warm_up` compiles the blocked lane while the engine runs its
    one-token step."""
    cache = (types.CPointer(getattr(types, cache_dtype)), _I64, _F32P, _I64, _I64P, _I64)
    return callback(_F32P, _I64, _I64, _I64, *cache, *cache, types.CPointer(types.int32), _I64,
                    _I64, _I64, _I64, _I64P, _I64, _I64P, _I64, _I64, _F32, _I64, _F32, _F32P,
                    _I64, _F32P, _F32P, _F32P, _F32P, _I64)(_LANES[quantized, blocked])


@kernel(inline=True)
def _call_lane(lane, q, kd, klut, klay, vd, vlut, vlay, tables, shift, hk, items, counter, g,
               rows_max, qscale, window, cap, sinks, out, pm, pl, pacc):  # type: ignore[no-untyped-def]
    """One thread's lane through the callback at `lane` (`lane_callback`)."""
    t, heads, dh = q.shape
    call_address(lane, (
        data_pointer(q), t, heads, dh,
        data_pointer(kd), kd.shape[0], data_pointer(klut), klut.shape[0], data_pointer(klay),
        klay.shape[0], data_pointer(vd), vd.shape[0], data_pointer(vlut), vlut.shape[0],
        data_pointer(vlay), vlay.shape[0], data_pointer(tables), tables.shape[0],
        tables.shape[1], shift, hk, data_pointer(items), items.shape[0], data_pointer(counter),
        g, rows_max, qscale, window, cap, data_pointer(sinks), sinks.shape[0],
        data_pointer(out), data_pointer(pm), data_pointer(pl), data_pointer(pacc),
        pm.shape[0]))


@kernel(inline=True)
def _both_lanes(blocked, rows, n_blocked, counter, q, kd, klut, klay, vd, vlut, vlay, tables,
                shift, hk, items, g, rows_max, qscale, window, cap, sinks, out, pm, pl, pacc):  # type: ignore[no-untyped-def]
    """The blocked lane's callback at `blocked` over the first `n_blocked` items, then the row
    lane's at `rows` over the rest, each with its own counter (`lane_callback`; an address
    is 0 where no item takes it)."""
    if n_blocked:
        _call_lane(blocked, q, kd, klut, klay, vd, vlut, vlay, tables, shift, hk,
                   items[:n_blocked], counter[:1], g, rows_max, qscale, window, cap, sinks, out,
                   pm, pl, pacc)
    if n_blocked < items.shape[0]:
        _call_lane(rows, q, kd, klut, klay, vd, vlut, vlay, tables, shift, hk,
                   items[n_blocked:], counter[1:], g, rows_max, qscale, window, cap, sinks, out,
                   pm, pl, pacc)


@kernel(parallel=True)
def run_items(blocked, rows, n_blocked, lanes, q, kd, klut, klay, vd, vlut, vlay, tables, shift,
              hk, items, g, rows_max, qscale, window, cap, sinks, out, pm, pl, pacc):  # type: ignore[no-untyped-def]
    """Every item, on `lanes` threads sharing the counters (`_both_lanes`). A cache is its
    data, table and layout (empty but for a quantized cache)."""
    counter = np.zeros(2, np.int64)
    for _lane in prange(lanes):
        _both_lanes(blocked, rows, n_blocked, counter, q, kd, klut, klay, vd, vlut, vlay,
                    tables, shift, hk, items, g, rows_max, qscale, window, cap, sinks, out, pm,
                    pl, pacc)


@kernel
def run_one_lane(blocked, rows, n_blocked, q, kd, klut, klay, vd, vlut, vlay, tables, shift,
                 hk, items, g, rows_max, qscale, window, cap, sinks, out, pm, pl, pacc):  # type: ignore[no-untyped-def]
    """Every item on the calling thread (one item, or one thread): no parallel region."""
    _both_lanes(blocked, rows, n_blocked, np.zeros(2, np.int64), q, kd, klut, klay, vd, vlut,
                vlay, tables, shift, hk, items, g, rows_max, qscale, window, cap, sinks, out,
                pm, pl, pacc)


@kernel
def merge_range(merges, lo, hi, g, pm, pl, pacc, out, sinks):
    """Combine the partial states of split items lo..hi-1 (rows laid out as in
    `finish_rows`; a part where a row saw no key, m = -inf, counts for nothing). On one
    thread: a few rows x Dh per split item."""
    dh = pacc.shape[2]
    for i in range(lo, hi):
        tok0 = merges[i, M_TOK0]
        nq = merges[i, M_NQ]
        kvh0 = merges[i, M_KVH0]
        p0 = merges[i, M_PART0]
        p1 = p0 + merges[i, M_PARTS]
        rows = nq * g
        for r in range((merges[i, M_KVH1] - kvh0) * rows):
            mx = NEG_INF
            for p in range(p0, p1):
                mx = max(mx, pm[p, r])
            tok = tok0 + (r % rows) // g
            head = (kvh0 + r // rows) * g + r % g
            for d in range(dh):
                out[tok, head, d] = ZERO
            tot = ZERO
            for p in range(p0, p1):
                w = exp2(pm[p, r] - mx)
                if w == 0.0:
                    continue
                tot += w * pl[p, r]
                for d in range(dh):
                    out[tok, head, d] += w * pacc[p, r, d]
            inv = sink_scale(sinks, head, mx, tot)
            for d in range(dh):
                out[tok, head, d] *= inv


@kernel
def write_kv_rows(k, v, kc, vc, slots):
    """k, v [T, Hk, Dh] into the caches at their slots (skip slot < 0). One thread: a step
    writes T x Hk x Dh values, microseconds next to its attention."""
    block_size = kc.shape[1]
    hk = kc.shape[2]
    dh = kc.shape[3]
    like = kc[0, 0, 0, 0]
    for t in range(slots.shape[0]):
        slot = slots[t]
        if slot < 0:
            continue
        blk = slot // block_size
        off = slot - blk * block_size
        for h in range(hk):
            for d in range(dh):
                kc[blk, off, h, d] = from_f32(k[t, h, d], like)
                vc[blk, off, h, d] = from_f32(v[t, h, d], like)


@kernel(exact=True)
def write_qkv_rows(qkv, q, kc, vc, slots, positions, cos, sin, rotary_dim, interleaved,
                   fused):
    """A fused projection qkv [T, (H + 2 Hk) * Dh] split in one pass: q [T, H, Dh] rotated,
    k rotated and v written into the caches at their slots (skip slot < 0). `rope_row` and
    the write of each token's parts in one call: a decode step's layer makes one call
    instead of four (`write_kv_rows`)."""
    k = np.empty((kc.shape[2], q.shape[2]), np.float32)
    for t in range(qkv.shape[0]):
        row, p = qkv[t], positions[t]
        _take_heads(row, 0, q[t])
        rope_row(q[t], cos[p], sin[p], rotary_dim, interleaved, fused)
        if slots[t] >= 0:
            _take_heads(row, q.shape[1] * q.shape[2], k)
            rope_row(k, cos[p], sin[p], rotary_dim, interleaved, fused)
            _store_kv(kc, vc, slots[t], k, row)


@kernel(exact=True)
def write_qkv_normed_rows(qkv, q, kc, vc, slots, positions, cos, sin, rotary_dim,
                          interleaved, fused, q_norm, k_norm, eps):
    """`write_qkv_rows` with each head of q and k RMS-normed first (`rms_row` by q_norm and
    k_norm [Dh], in place), as `rms_norm` norms few rows: Gemma's and Qwen3's layers."""
    k = np.empty((kc.shape[2], q.shape[2]), np.float32)
    for t in range(qkv.shape[0]):
        row, p = qkv[t], positions[t]
        _take_heads(row, 0, q[t])
        for h in range(q.shape[1]):
            rms_row(q[t, h], q_norm, eps, q[t, h])
        rope_row(q[t], cos[p], sin[p], rotary_dim, interleaved, fused)
        if slots[t] >= 0:
            _take_heads(row, q.shape[1] * q.shape[2], k)
            for h in range(k.shape[0]):
                rms_row(k[h], k_norm, eps, k[h])
            rope_row(k, cos[p], sin[p], rotary_dim, interleaved, fused)
            _store_kv(kc, vc, slots[t], k, row)


@kernel(exact=True)
def _take_heads(row, at, out):  # type: ignore[no-untyped-def]
    """out [H, Dh] = row[at : at + H * Dh], head by head."""
    dh = out.shape[1]
    for h in range(out.shape[0]):
        for d in range(dh):
            out[h, d] = row[at + h * dh + d]


@kernel(exact=True)
def _store_kv(kc, vc, slot, k, row):  # type: ignore[no-untyped-def]
    """k [Hk, Dh] and the token's v (the last Hk * Dh values of its fused row) into the
    caches' cell `slot`, in the caches' dtype."""
    like = kc[0, 0, 0, 0]
    blk = slot // kc.shape[1]
    off = slot - blk * kc.shape[1]
    hk, dh = k.shape
    v_at = row.shape[0] - hk * dh
    for h in range(hk):
        for d in range(dh):
            kc[blk, off, h, d] = from_f32(k[h, d], like)
            vc[blk, off, h, d] = from_f32(row[v_at + h * dh + d], like)
