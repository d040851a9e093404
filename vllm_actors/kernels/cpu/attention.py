"""Paged attention and KV-cache writes of the compiled CPU backend.

A layer's cache is a pair (K, V) of `[num_blocks, block_size, Hk, Dh]` arrays, float32, or
float16 as its uint16 bits (numba has no CPU float16; `attention_math` converts). Keys and
values are read in place through each request's block table, with an online softmax, decode
and chunked-prefill rows in one call, and a KV head's g query heads computed together.

Modules: `attention_plan` (work items, their balance over threads), `attention_kernels`
(parallel entries, decode items, merges, cache writes), `attention_tiles` (decode tiles),
`attention_prefill` (register-blocked prefill items), `attention_math` (float16, exp2,
cache-dtype dispatch), `intrinsics` (shared with the matmuls).

    attn = prepare(meta)                          # once per step
    write_kv(k, v, kv_cache[layer], attn)         # per layer
    out = paged_attention(q, kv_cache[layer], attn, scale)   # window=, softcap= (Gemma 2/3)

Sliding windows: an item starts at its first row's window start (a decode reads only its last
`window` keys) and the plan, built per window, splits only the keys in the windows; rows of a
tile are masked by position. Soft-capping applies tanh to a tile's scores before its softmax
step, in the kernels' base-2 domain (cap = softcap * log2 e); without it no tanh runs.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import numba
import numpy as np

from vllm_actors.kernels import ggml_attention, kv_quant
from vllm_actors.kernels.cpu.attention_kernels import (
    lane_callback,
    merge_range,
    run_items,
    run_one_lane,
    write_kv_rows,
    write_qkv_normed_rows,
    write_qkv_rows,
)
from vllm_actors.kernels.cpu.attention_kv import encode_rows
from vllm_actors.kernels.cpu.attention_plan import Plan, build_plan
from vllm_actors.kernels.ops import AttentionMetadata

CACHE_DTYPES = {"float32": np.float32, "float16": np.uint16}
_LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 40       # the window the kernels get for "none": past any context
_NO_CAP = np.float32(0.0)
_NO_SINKS = np.zeros(0, np.float32)
_NO_LUT, _NO_LAYOUT = np.zeros(0, np.float32), np.zeros(0, np.int64)   # a float cache's


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: str = "float32",
                      kv_format: kv_quant.KVFormat | None = None) -> list:
    """Per layer a (K, V) pair of zeroed `[num_blocks, block_size, Hk, Dh]` arrays: float32,
    or uint16 holding float16 bits for dtype "float16"; a `kv_format` other than those: a
    `kv_quant.QuantizedKV` per layer."""
    if kv_format is not None:
        if ggml_attention.reads(kv_format, head_dim):
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            return [ggml_attention.GgmlCache(np.zeros(shape, np.uint16),
                                             np.zeros(shape, np.uint16))
                    for _ in range(num_layers)]
        if kv_format.kind in (kv_quant.FLOAT32, kv_quant.FLOAT16):
            dtype = kv_format.name
        else:
            if block_size < 1 or block_size & (block_size - 1):
                raise ValueError(f"block_size must be a power of two, not {block_size}")
            return kv_quant.allocate_kv_cache(kv_format, num_layers, num_blocks, block_size,
                                              num_kv_heads, head_dim)
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"KV cache dtype must be one of {sorted(CACHE_DTYPES)}, not {dtype!r}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, not {block_size}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    np_dtype = CACHE_DTYPES[dtype]
    return [(np.zeros(shape, np_dtype), np.zeros(shape, np_dtype)) for _ in range(num_layers)]


@dataclass(frozen=True)
class CpuAttention:
    """One step's attention layout, in the integer types the kernels take.

    Attributes:
        query_start_loc: [B + 1] int64 token offsets of each request.
        seq_lens: [B] int64 context length of each request after this step.
        block_tables: [B, max_blocks] int32 KV block ids (C-contiguous).
        slot_mapping: [T] int64 flat KV slot of each token (negative: not written).
        block_size: tokens per KV block.
        threads: threads the work is partitioned for (numba's count at `prepare`).
        prompt_lens: [B] int64 prompt tokens of each request, or None (`AttentionMetadata`).
        plans: the work partition per (num_kv_heads, g, head_dim, window), built on the
            step's first attention call (every layer of a model, or of a window size, shares
            it); also llama.cpp-order attention's layout per ("ggml", num_kv_heads).
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    block_size: int
    threads: int
    prompt_lens: np.ndarray | None = None
    plans: dict = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def plan(self, num_kv_heads: int, g: int, head_dim: int, window: int = 0) -> Plan:
        key = (num_kv_heads, g, head_dim, window)
        found = self.plans.get(key)
        if found is None:
            with self._lock:
                found = self.plans.get(key)
                if found is None:
                    found = build_plan(self.query_start_loc, self.seq_lens, num_kv_heads, g,
                                       head_dim, self.threads, window)
                    self.plans[key] = found
        return found


# The last layout prepared: (threads, its CpuAttention). A step's KV cache groups
# (models/kv_layout.py) hand in metas with equal query_start_loc and seq_lens that differ only
# in block tables; the work partitions depend on nothing else, so they are built once.
_last: list = [None]


def prepare(meta: AttentionMetadata, num_heads: int | None = None,
            num_kv_heads: int | None = None, head_dim: int | None = None,
            threads: int | None = None) -> CpuAttention:
    """The step's layout; given the head shape the work partition is built now, else on the
    first `paged_attention` call. `threads` defaults to numba's thread count. A meta with the
    previous one's query_start_loc and seq_lens shares its partitions."""
    threads = int(threads or numba.get_num_threads())
    query_start_loc = np.array(meta.query_start_loc, np.int64)     # copies: kept in _last
    seq_lens = np.array(meta.seq_lens, np.int64)
    prompt_lens = None if meta.prompt_lens is None else np.array(meta.prompt_lens, np.int64)
    last = _last[0]
    same = (last is not None and last[0] == threads
            and np.array_equal(last[1].query_start_loc, query_start_loc)
            and np.array_equal(last[1].seq_lens, seq_lens)
            and _same_prompts(last[1].prompt_lens, prompt_lens))
    attn = CpuAttention(
        query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=np.ascontiguousarray(meta.block_tables, np.int32),
        slot_mapping=np.ascontiguousarray(meta.slot_mapping, np.int64),
        block_size=int(meta.block_size), threads=threads, prompt_lens=prompt_lens,
        plans=last[1].plans if same else {}, _lock=last[1]._lock if same else threading.Lock())
    if not same:
        _last[0] = (threads, attn)
    if num_heads and num_kv_heads and head_dim:
        attn.plan(num_kv_heads, num_heads // num_kv_heads, head_dim)
    return attn


def _same_prompts(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Whether two steps' prompt lengths are the same (the llama.cpp-order attention's
    layout depends on them)."""
    return a is b or (a is not None and b is not None and np.array_equal(a, b))


def _float32_view(x: np.ndarray, name: str) -> np.ndarray:
    if x.dtype != np.float32:
        raise TypeError(f"{name} must be float32, not {x.dtype}")
    return x


def write_kv(k: np.ndarray, v: np.ndarray, kv_cache: tuple[np.ndarray, np.ndarray],
             attn: CpuAttention) -> None:
    """Write k, v float32 [T, Hk, Dh] (any strides, e.g. views of a fused QKV output) into the
    cache at the step's slot mapping, rounding to float16 for a float16 cache."""
    if isinstance(kv_cache, kv_quant.QuantizedKV):
        _write_quantized(_float32_view(k, "k"), _float32_view(v, "v"), kv_cache, attn)
        return
    k_cache, v_cache = kv_cache
    k = _float32_view(k, "k")
    v = _float32_view(v, "v")
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or k.shape[0] != attn.num_tokens:
        raise ValueError(f"k {k.shape} / v {v.shape} do not fit the cache {k_cache.shape} "
                         f"and {attn.num_tokens} tokens")
    write_kv_rows(k, v, k_cache, v_cache, attn.slot_mapping)


def write_qkv(qkv: np.ndarray, num_heads: int, head_dim: int, positions: np.ndarray,
              cos: np.ndarray, sin: np.ndarray, rotary_dim: int, interleaved: bool,
              fused: bool, kv_cache: tuple[np.ndarray, np.ndarray], attn: CpuAttention,
              norms: tuple[np.ndarray, np.ndarray, float] | None = None) -> np.ndarray:
    """A fused projection qkv float32 [T, (H + 2 Hk) * Dh] -> q [T, H, Dh] rotated by RoPE
    (`elementwise.rope`'s arguments), with k rotated and v written into a float32 or float16
    cache at the step's slot mapping: `rope` on q and k and `write_kv`, bit for bit; with
    `norms` (q weight, k weight, eps), each head's q and k through `elementwise.rms_norm`
    first, one row at a time (as it norms fewer than `PARALLEL_ROWS` rows)."""
    k_cache, v_cache = kv_cache
    t, hk = len(qkv), k_cache.shape[2]
    if qkv.shape[1:] != ((num_heads + 2 * hk) * head_dim,) or k_cache.shape[3] != head_dim \
            or t != attn.num_tokens:
        raise ValueError(f"qkv {qkv.shape} does not fit {num_heads} heads, the cache "
                         f"{k_cache.shape} and {attn.num_tokens} tokens")
    q = np.empty((t, num_heads, head_dim), np.float32)
    qkv = np.ascontiguousarray(_float32_view(qkv, "qkv"))
    if norms is None:
        write_qkv_rows(qkv, q, k_cache, v_cache, attn.slot_mapping, positions, cos, sin,
                       rotary_dim, interleaved, fused)
    else:
        write_qkv_normed_rows(qkv, q, k_cache, v_cache, attn.slot_mapping, positions, cos,
                              sin, rotary_dim, interleaved, fused,
                              _norm_weight(norms[0], head_dim), _norm_weight(norms[1], head_dim),
                              float(norms[2]))
    return q


_NONE_F32 = np.zeros(0, np.float32)
_NONE_F64 = np.zeros(0, np.float64)


def _norm_weight(weight: np.ndarray, head_dim: int) -> np.ndarray:
    if weight.shape != (head_dim,):
        raise ValueError(f"a q/k norm weight {weight.shape} does not fit heads of {head_dim}")
    return np.ascontiguousarray(weight, np.float32)


def _encoder_tables(cache: kv_quant.QuantizedKV) -> tuple:
    """(fp8 values table float64, high midpoints, low midpoints, codebooks float64) for
    `encode_rows`, built once per format and head dim."""
    fmt, d = cache.fmt, cache.head_dim
    key = ("encode", d)
    found = fmt._cache.get(key)
    if found is None:
        table, mids_high, mids_low, books = _NONE_F64, _NONE_F32, _NONE_F32, _NONE_F64
        if fmt.kind == kv_quant.FP8:
            values = fmt.lut(d) / np.float32(fmt.k_scale)      # unscaled positive values
            finite = values[:128][np.isfinite(values[:128])]
            table = finite.astype(np.float64)
        elif fmt.kind == kv_quant.TURBOQUANT:
            _, high, low = fmt.split(d)
            hb, lb = kv_quant.codebook(high, d), kv_quant.codebook(low, d)
            mids_high, mids_low = (hb[1:] + hb[:-1]) / 2, (lb[1:] + lb[:-1]) / 2
            books = np.concatenate([hb, lb]).astype(np.float64)
        found = (table, mids_high, mids_low, books)
        fmt._cache[key] = found
    return found


def _write_quantized(k: np.ndarray, v: np.ndarray, cache: kv_quant.QuantizedKV,
                     attn: CpuAttention) -> None:
    if k.shape != v.shape or k.shape[0] != attn.num_tokens or \
            k.shape[1:] != (cache.k.shape[2], cache.head_dim):
        raise ValueError(f"k {k.shape} / v {v.shape} do not fit the cache {cache.k.shape} "
                         f"and {attn.num_tokens} tokens")
    fmt, layout = cache.fmt, cache.layout
    table, mids_high, mids_low, books = _encoder_tables(cache)
    for x, data, scale in ((k, cache.k, fmt.k_scale), (v, cache.v, fmt.v_scale)):
        x = np.ascontiguousarray(cache.rotate(x), np.float32)
        encode_rows(x, attn.slot_mapping, data.reshape(-1), int(layout[1]), int(layout[0]),
                    np.float32(1.0 / scale), table, mids_high, mids_low, books, layout)


def _lane_caches(kv_cache, k_cache: np.ndarray, v_cache: np.ndarray) -> tuple:  # type: ignore[no-untyped-def]
    """K and V as the lane callback takes them: flat data, table and layout each (the last two
    empty for a float32 or float16 cache)."""
    kc, vc = k_cache.reshape(-1), v_cache.reshape(-1)
    if isinstance(kv_cache, kv_quant.QuantizedKV):
        return kc, kv_cache.k_lut, kv_cache.layout, vc, kv_cache.v_lut, kv_cache.layout
    return kc, _NO_LUT, _NO_LAYOUT, vc, _NO_LUT, _NO_LAYOUT


def _call_terms(attn: CpuAttention, num_kv_heads: int, g: int, head_dim: int, window: int,
                scale: float, softcap: float, sinks: np.ndarray | None, dtype: np.dtype,
                quantized: bool) -> tuple:
    """(plan, the blocked and row lane callbacks' addresses (0 where no item takes one), block
    shift, scale, window, soft-cap and sinks as the kernels take them) of a call: the same
    for every layer of a step, so kept in the step's plans (a small model's one-token call
    spent much of its time building them: docs/BENCHMARKS.md). Sinks are per layer, so a
    call with them builds its own."""
    key = ("call", num_kv_heads, g, head_dim, window, scale, softcap, dtype, quantized,
           attn.block_size)    # layouts of equal lengths share plans across block sizes
    found = attn.plans.get(key) if sinks is None else None
    if found is not None:
        return found
    sk = (np.ascontiguousarray(sinks, np.float32) * np.float32(_LOG2E) if sinks is not None
          else _NO_SINKS)
    if len(sk) not in (0, num_kv_heads * g):
        raise ValueError(f"{len(sk)} sink logits for {num_kv_heads * g} heads")
    plan = attn.plan(num_kv_heads, g, head_dim, window)
    lanes = (_lane_address(dtype, quantized, True) if plan.blocked else 0,
             _lane_address(dtype, quantized, False) if plan.blocked < len(plan.items) else 0)
    found = (plan, lanes, attn.block_size.bit_length() - 1, np.float32(scale * _LOG2E),
             int(window) if window else NO_WINDOW,
             np.float32(softcap * _LOG2E) if softcap > 0 else _NO_CAP, sk)
    if sinks is None:
        attn.plans[key] = found
    return found


def _partials(plan: Plan, head_dim: int, attn: CpuAttention) -> tuple:
    """Scratch for the partial states (max, sum, rows) of the items split over key parts;
    with no split item nothing writes them, so one set serves every call of the step."""
    if plan.num_parts:
        return (np.empty((plan.num_parts, plan.rows_max), np.float32),
                np.empty((plan.num_parts, plan.rows_max), np.float32),
                np.empty((plan.num_parts, plan.rows_max, head_dim), np.float32))
    key = ("unsplit", plan.rows_max, head_dim)
    found = attn.plans.get(key)
    if found is None:
        found = attn.plans[key] = (np.empty((1, plan.rows_max), np.float32),
                                   np.empty((1, plan.rows_max), np.float32),
                                   np.empty((1, plan.rows_max, head_dim), np.float32))
    return found


@functools.cache
def _lane_address(dtype: np.dtype, quantized: bool, blocked: bool) -> int:
    """A lane callback's address for a cache of `dtype`, looked up by the dtype itself (its
    name is slow to get)."""
    return lane_callback(dtype.name, quantized, blocked).address


def blocked_lane_of(kv_cache) -> str:  # type: ignore[no-untyped-def]
    """The blocked lane (`attention_kernels.blocked_lane`) that steps of several tokens run
    over `kv_cache`, as `compile_blocked_lane` takes it ("dtype:0", "dtype:1" for a quantized
    cache), or "" where they take no such lane (a head dim not a multiple of 4)."""
    if isinstance(kv_cache, kv_quant.QuantizedKV):
        data, head_dim, quantized = kv_cache.k, kv_cache.head_dim, True
    else:
        data, head_dim, quantized = kv_cache[0], kv_cache[0].shape[3], False
    return f"{data.dtype.name}:{int(quantized)}" if head_dim % 4 == 0 else ""


def compile_blocked_lane(spec: str) -> None:
    """Compile (or load from the cache) the blocked lane `blocked_lane_of` named and, for a
    float32 or float16 cache, the parallel entry that steps of several tokens run it through
    (`run_items`)."""
    dtype, quantized = spec.split(":")
    lane_callback(dtype, quantized == "1", True).address   # noqa: B018
    if quantized == "0":
        _two_prompts("float16" if dtype == "uint16" else dtype)


def _two_prompts(dtype: str) -> None:
    """Attention of two 3-token prompts over a one-block cache of `dtype`, planned for two
    threads: blocked items only, so `run_items` compiles with the argument types a step's
    call gives it, and the row lane does not compile."""
    block = 16
    cache = allocate_kv_cache(1, 2, block, 1, 64, dtype)[0]
    meta = AttentionMetadata(np.array([0, 3, 6], np.int32), np.array([3, 3], np.int32),
                             np.ones((2, 1), np.int32), np.full(6, -1, np.int64), block)
    paged_attention(np.zeros((6, 1, 64), np.float32), cache, prepare(meta, threads=2), 1.0)


def paged_attention(q: np.ndarray, kv_cache: tuple[np.ndarray, np.ndarray],
                    attn: CpuAttention, scale: float, out: np.ndarray | None = None,
                    window: int = 0, softcap: float = 0.0,
                    sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal attention of q float32 [T, H, Dh] over each request's cached context -> [T, H, Dh]
    float32 (into `out` when given, which must be C-contiguous). A strided q (a view of a fused
    QKV output) is copied first: the kernels are compiled for C-contiguous queries only.
    `window` > 0: a query at position p sees keys p - window < k <= p; `softcap` > 0: scores
    s become softcap * tanh(s / softcap); `sinks` [H]: per-head sink logits (see
    `ops.Backend.paged_attention`)."""
    quantized = isinstance(kv_cache, kv_quant.QuantizedKV)
    if quantized:   # turboquant: attend in the rotated space, rotate the output back
        k_cache, v_cache = kv_cache.k, kv_cache.v
        q = kv_cache.rotate(_float32_view(q, "q"))
        row_dim = kv_cache.head_dim
    else:
        k_cache, v_cache = kv_cache
        row_dim = k_cache.shape[3]
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("the KV cache must be C-contiguous (as allocate_kv_cache makes it)")
    q = np.ascontiguousarray(_float32_view(q, "q"))
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or row_dim != head_dim or \
            num_tokens != attn.num_tokens or k_cache.shape[1] != attn.block_size:
        raise ValueError(f"q {q.shape} does not fit the cache {k_cache.shape} "
                         f"(block size {attn.block_size}, {attn.num_tokens} tokens)")
    if out is None:
        out = np.empty((num_tokens, num_heads, head_dim), np.float32)
    elif out.shape != q.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError("out must be a C-contiguous float32 array shaped like q")
    if num_tokens == 0:
        return out
    g = num_heads // num_kv_heads
    plan, lanes, shift, qscale, wnd, cap, sk = _call_terms(
        attn, num_kv_heads, g, head_dim, max(0, window), scale, softcap, sinks,
        k_cache.dtype, quantized)
    pm, pl, pacc = _partials(plan, head_dim, attn)
    caches = _lane_caches(kv_cache, k_cache, v_cache)
    args = (q, *caches, attn.block_tables, shift, num_kv_heads, plan.items, g, plan.rows_max,
            qscale, wnd, cap, sk, out, pm, pl, pacc)
    if plan.lanes > 1:
        run_items(*lanes, plan.blocked, plan.lanes, *args)
    else:   # one item (or one thread): no parallel region to start
        run_one_lane(*lanes, plan.blocked, *args)
    if len(plan.merges):
        merge_range(plan.merges, 0, len(plan.merges), g, pm, pl, pacc, out, sk)
    if quantized and kv_cache.rotation is not None:
        out[...] = kv_cache.unrotate(out)
    return out


__all__ = ["CACHE_DTYPES", "CpuAttention", "allocate_kv_cache", "blocked_lane_of",
           "compile_blocked_lane", "paged_attention", "prepare", "write_kv"]
