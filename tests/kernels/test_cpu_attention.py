"""The compiled CPU backend's paged attention (kernels/cpu/attention) against the numpy backend,
and its float16 <-> float32 conversions against numpy's `astype`, bit for bit.

Tolerances: outputs are convex combinations of unit-normal values; float32 caches must match
numpy within atol 2e-5 (rtol 1e-5). A float16 cache is compared against numpy attending over
the same float16-rounded K/V, within atol 2e-3 (in practice both differ only by float32
rounding, ~1e-6). Plans are built for 2 threads whatever the machine has, so the split-context
(flash-decoding) path and the parallel entry points run everywhere.

Sliding windows and soft-capping (Gemma 2/3) run the same comparisons; the cache is poisoned
(NaN) before each request's first window too, so a kernel that reads a key no row can see
fails, and the reference is checked to differ from plain attention (the option mattered).
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_actors.kernels.cpu import attention as cpu
from vllm_actors.kernels.cpu.attention_kernels import K0, K1, KVH0, KVH1, POS0
from vllm_actors.kernels.cpu.attention_math import f32_to_half, half_to_f32, read_half, write_half
from vllm_actors.kernels.cpu.attention_plan import SPLIT_KEYS
from vllm_actors.kernels.cpu.intrinsics import HARDWARE_HALF
from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.kernels.ops import AttentionMetadata

ATOL = {"float32": 2e-5, "float16": 2e-3}


@kernel
def _halves_to_f32(bits, out, hardware):
    for i in range(bits.shape[0]):
        out[i] = read_half(bits[i]) if hardware else half_to_f32(bits[i])


@kernel
def _f32_to_halves(x, out, written):
    for i in range(x.shape[0]):
        out[i] = f32_to_half(x[i])
        written[i] = write_half(x[i])


ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def test_half_to_f32_bit_exact_on_all_65536_values():
    ref = ALL_HALVES.view(np.float16).astype(np.float32).view(np.uint32)
    out = np.empty(1 << 16, np.float32)
    _halves_to_f32(ALL_HALVES, out, False)
    np.testing.assert_array_equal(out.view(np.uint32), ref)     # NaN payloads included


def test_cache_reads_match_numpy_on_all_65536_values():
    """What the kernels use to read a float16 cache (F16C where present): exact on every
    value; a signaling NaN may come back quieted, still a NaN of the same sign."""
    ref = ALL_HALVES.view(np.float16).astype(np.float32)
    out = np.empty(1 << 16, np.float32)
    _halves_to_f32(ALL_HALVES, out, True)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(out.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    assert np.isnan(out[nan]).all()
    np.testing.assert_array_equal(np.signbit(out[nan]), np.signbit(ref[nan]))
    if not HARDWARE_HALF:
        np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


def _edge_floats() -> np.ndarray:
    halves = ALL_HALVES.view(np.float16)
    finite = np.sort(np.unique(halves[np.isfinite(halves)].astype(np.float64)))
    mids = (finite[:-1] + finite[1:]) / 2            # exact ties: round half to even
    near = np.concatenate([np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
                           np.nextafter(mids.astype(np.float32), np.float32(-np.inf))])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.996, 65520.0, 65536.0,
                         1e10, -1e10, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -26,
                         2.0 ** -14, 2.0 ** -14 - 2.0 ** -25, 1e-30, -1e-30, 1e-45,
                         np.finfo(np.float32).max], np.float64)
    return np.concatenate([mids.astype(np.float32), near, specials.astype(np.float32),
                           -specials.astype(np.float32), finite.astype(np.float32)])


def test_f32_to_half_bit_exact_on_edges_and_random_bits():
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([_edge_floats(), random_bits.view(np.float32)])
    out, written = np.empty(len(x), np.uint16), np.empty(len(x), np.uint16)
    _f32_to_halves(x, out, written)
    np.testing.assert_array_equal(written, out)      # the cache writes' form (F16C), NaNs too
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(out[~nan], ref[~nan])
    quiet = nan & ((x.view(np.uint32) & 0x400000) != 0)
    assert quiet.sum() > 100
    np.testing.assert_array_equal(out[quiet], ref[quiet])
    assert np.isnan(out[nan].view(np.float16)).all()
    np.testing.assert_array_equal(out[nan] >> 15, ref[nan] >> 15)


def _step(q_lens, cached, block_size, num_kv_heads, head_dim, rng, spare_blocks=3):
    """Metadata with shuffled (non-contiguous) block tables and the number of blocks."""
    seq = np.array(cached) + np.array(q_lens)
    nblocks = -(-seq // block_size)
    total = int(nblocks.sum()) + 1 + spare_blocks
    ids = rng.permutation(np.arange(1, total))
    tables = np.zeros((len(seq), int(nblocks.max()) + 2), np.int32)    # padded with block 0
    starts = np.cumsum(nblocks) - nblocks
    for b in range(len(seq)):
        tables[b, :nblocks[b]] = ids[starts[b]:starts[b] + nblocks[b]]
    slots = np.concatenate([tables[b, pos // block_size] * block_size + pos % block_size
                            for b, pos in enumerate(np.arange(c, c + n)
                                                    for c, n in zip(cached, q_lens))])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return AttentionMetadata(qsl, seq.astype(np.int32), tables, slots.astype(np.int64),
                             block_size), total


def _poison_unread(cache, meta, dtype, window=0):
    """NaN wherever attention must not read: the null block, spare blocks, the slots past
    each sequence's end in its last block and, under a sliding window, the keys before the
    window of the request's first query token."""
    nan = np.array(np.nan, np.float32)
    nan = nan.astype(np.float16).view(np.uint16) if dtype == "float16" else nan
    block_size = meta.block_size
    used = np.zeros(cache[0].shape[0], bool)
    for b, length in enumerate(meta.seq_lens):
        blocks = meta.block_tables[b, :-(-length // block_size)]
        used[blocks] = True
        for part in cache:
            part[blocks[-1], length - (len(blocks) - 1) * block_size:] = nan
        first = length - (meta.query_start_loc[b + 1] - meta.query_start_loc[b])
        for pos in range(max(first - window + 1, 0) if window else 0):
            for part in cache:
                part[blocks[pos // block_size], pos % block_size] = nan
    for part in cache:
        part[~used] = nan


def _compare(q_lens, cached, heads, kv_heads, head_dim, block_size, dtype, seed=0, threads=2,
             window=0, softcap=0.0, q_gain=1.0, window_plan=True):
    """window_plan=False: the kernels run under a window on the plan built for none, whose
    split items may lie wholly before the window (empty partial states)."""
    rng = np.random.default_rng(seed)
    meta, total = _step(q_lens, cached, block_size, kv_heads, head_dim, rng)
    tokens = int(sum(q_lens))
    # q, k, v as views of one fused projection, as models hand them over
    qkv = rng.standard_normal((tokens, (heads + 2 * kv_heads) * head_dim), dtype=np.float32)
    q = qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads,
                                                                        head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(tokens, kv_heads, head_dim)
    q *= np.float32(q_gain)        # large scores, for soft-capping to matter
    # earlier context, already in the cache
    shape = (total, block_size, kv_heads, head_dim)
    prior_k = rng.standard_normal(shape, dtype=np.float32)
    prior_v = rng.standard_normal(shape, dtype=np.float32)
    cache = cpu.allocate_kv_cache(2, total, block_size, kv_heads, head_dim, dtype)[1]
    ref_cache = NumpyBackend().allocate_kv_cache(1, total, block_size, kv_heads, head_dim)[0]
    if dtype == "float16":
        for mine, ref, prior in zip(cache, ref_cache, (prior_k, prior_v)):
            mine[...] = prior.astype(np.float16).view(np.uint16)
            ref[...] = prior.astype(np.float16).astype(np.float32)
        k_ref = k.astype(np.float16).astype(np.float32)
        v_ref = v.astype(np.float16).astype(np.float32)
    else:
        for mine, ref, prior in zip(cache, ref_cache, (prior_k, prior_v)):
            mine[...] = prior
            ref[...] = prior
        k_ref, v_ref = k, v
    backend = NumpyBackend()
    ref_attn = backend.prepare_attention(meta)
    backend.reshape_and_cache(k_ref, v_ref, ref_cache, ref_attn)
    scale = head_dim ** -0.5
    expected = backend.paged_attention(np.ascontiguousarray(q), ref_cache, ref_attn, scale,
                                       window, softcap)
    if window or softcap:
        plain = backend.paged_attention(np.ascontiguousarray(q), ref_cache, ref_attn, scale)
        assert np.abs(plain - expected).max() > 1e-2

    attn = cpu.prepare(meta, threads=threads)
    if not window_plan:
        attn.plans[(kv_heads, heads // kv_heads, head_dim, window)] = \
            attn.plan(kv_heads, heads // kv_heads, head_dim)
    cpu.write_kv(k, v, cache, attn)
    written = cache[0].reshape(-1, kv_heads, head_dim)[meta.slot_mapping]
    if dtype == "float16":
        np.testing.assert_array_equal(written, k.astype(np.float16).view(np.uint16))
    else:
        np.testing.assert_array_equal(written, k)
    _poison_unread(cache, meta, dtype, window)
    got = cpu.paged_attention(q, cache, attn, scale, window=window, softcap=softcap)
    np.testing.assert_allclose(got, expected, atol=ATOL[dtype], rtol=1e-5)
    return attn, got


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (9, 3, 64, 16),       # SmolLM2: g = 3
    (4, 4, 80, 1),        # g = 1, odd head dim, one token per block
    (8, 2, 128, 32),      # g = 4
    (6, 2, 66, 4),        # head dim not a multiple of 4: prefill rows take the decode path
])
def test_mixed_decode_and_prefill_chunks(dtype, heads, kv_heads, head_dim, block_size):
    # decodes, a first prefill chunk, a later chunk after cached context, a 2-token chunk
    _compare([1, 37, 1, 70, 2, 1], [40, 0, 300, 129, 7, 0], heads, kv_heads, head_dim,
             block_size, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decode_only_batch(dtype):
    _compare([1] * 9, [3, 17, 64, 100, 255, 31, 1, 0, 500], 9, 3, 64, 16, dtype, seed=1)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_prefill_only(dtype):
    _compare([400, 33], [0, 0], 9, 3, 64, 16, dtype, seed=2)


def test_head_dim_256_and_32k_context():
    _compare([1, 9], [50, 20], 4, 2, 256, 16, "float32", seed=7)
    attn, _ = _compare([1], [32767], 2, 1, 64, 32, "float16", seed=8)
    assert attn.plan(1, 2, 64).num_parts >= 8


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_long_context_and_split_decode(dtype):
    """A sequence spanning ~190 blocks and a long single decode: its context is split across
    threads and the partial softmax states merged."""
    attn, _ = _compare([1], [3001], 8, 2, 128, 16, dtype, seed=3)
    assert attn.plan(2, 4, 128).num_parts > 1
    _compare([40, 1], [2960, 2999], 9, 3, 64, 16, dtype, seed=4)


def test_plan_does_not_depend_on_threads_and_out_argument():
    (one, _), (two, _) = (_compare([1, 5], [700, 600], 9, 3, 64, 16, "float32", seed=5,
                                   threads=threads) for threads in (1, 2))
    plans = [a.plan(3, 3, 64) for a in (one, two)]
    assert plans[0].num_parts > 0 and plans[0].lanes == 1 and plans[1].lanes == 2
    assert np.array_equal(plans[0].items, plans[1].items)
    assert np.array_equal(plans[0].merges, plans[1].merges)
    rng = np.random.default_rng(6)
    meta, total = _step([3], [4], 16, 1, 64, rng)
    cache = cpu.allocate_kv_cache(1, total, 16, 1, 64)[0]
    attn = cpu.prepare(meta, 2, 1, 64)
    x = rng.standard_normal((3, 1, 64), dtype=np.float32)
    cpu.write_kv(x, x, cache, attn)
    out = np.full((3, 2, 64), np.nan, np.float32)
    assert cpu.paged_attention(rng.standard_normal((3, 2, 64), dtype=np.float32), cache, attn,
                               0.125, out=out) is out
    assert np.isfinite(out).all()


@pytest.mark.parametrize("cached", [300, 700])
def test_a_lone_decode_runs_each_kv_head_as_an_item(cached):
    """One decode request of many keys on 2 threads: each KV head an item of its own (split
    along its keys past SPLIT_KEYS as before), the same floats as the whole unit on one."""
    runs = [_compare([1], [cached], 9, 3, 64, 16, "float16", seed=9, threads=threads)
            for threads in (1, 2)]
    (one, got_one), (two, got_two) = runs
    whole, by_head = one.plan(3, 3, 64), two.plan(3, 3, 64)
    assert by_head.lanes == 2 and len(by_head.items) == 3 * len(whole.items)
    assert (by_head.items[:, KVH1] - by_head.items[:, KVH0] == 1).all()
    assert np.array_equal(got_one.view(np.uint32), got_two.view(np.uint32))


def test_a_steps_layers_keep_their_own_call_terms():
    """A step's calls keep their terms (plan, scale, window, soft-cap) in its plans, keyed by
    all of them: layers that differ (Gemma's local and global ones) each get their own, as
    on a freshly prepared step."""
    rng = np.random.default_rng(7)
    meta, total = _step([1, 4], [40, 30], 16, 2, 64, rng)
    cache = cpu.allocate_kv_cache(1, total, 16, 2, 64)[0]
    x = rng.standard_normal((5, 2, 64), dtype=np.float32)
    q = rng.standard_normal((5, 4, 64), dtype=np.float32)
    cpu.write_kv(x, x, cache, cpu.prepare(meta))
    terms = [(0.125, 0, 0.0), (0.125, 8, 0.0), (0.2, 0, 0.0), (0.125, 0, 5.0), (0.125, 0, 0.0)]

    def prepared():
        cpu._last[0] = None          # no layout to share plans with
        return cpu.prepare(meta)
    expected = [cpu.paged_attention(q, cache, prepared(), s, window=w, softcap=c)
                for s, w, c in terms]
    attn = prepared()
    for (s, w, c), want in zip(terms, expected):
        assert np.array_equal(cpu.paged_attention(q, cache, attn, s, window=w, softcap=c), want)
    assert all(not np.array_equal(expected[0], e) for e in expected[1:4])
    # the same lengths in blocks of 32 share the layout's plans (a model's other KV group,
    # or another model): its own block size still reaches the kernel
    meta32, total32 = _step([1, 4], [40, 30], 32, 2, 64, np.random.default_rng(7))
    cache32 = cpu.allocate_kv_cache(1, total32, 32, 2, 64)[0]
    cpu.write_kv(x, x, cache32, cpu.prepare(meta32))
    shared = cpu.prepare(meta32)
    assert shared.plans is attn.plans
    assert np.array_equal(cpu.paged_attention(q, cache32, shared, 0.125), expected[0])


WINDOWS = [0, 1, 5, 16, 100]
SOFTCAPS = [0.0, 30.0]


def _gain(softcap):
    """q scaled up under a soft cap: scores of ~10 (std), which a cap of 30 bends (plain
    attention keeps unit scores: large ones only magnify float32 rounding)."""
    return 10.0 if softcap else 1.0


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (9, 3, 64, 16),       # g = 3
    (4, 4, 80, 1),        # g = 1, one token per block
    (6, 2, 66, 4),        # head dim not a multiple of 4: prefill rows take the decode path
])
def test_window_and_softcap_mixed_steps(dtype, window, softcap, heads, kv_heads, head_dim,
                                        block_size):
    _compare([1, 37, 1, 70, 2, 1], [40, 0, 300, 129, 7, 0], heads, kv_heads, head_dim,
             block_size, dtype, seed=10, window=window, softcap=softcap, q_gain=_gain(softcap))


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_window_and_softcap_decode_and_prefill(dtype, window, softcap):
    _compare([1] * 9, [3, 17, 64, 100, 255, 31, 1, 0, 500], 8, 2, 128, 16, dtype, seed=11,
             window=window, softcap=softcap, q_gain=_gain(softcap))
    _compare([400, 33], [0, 0], 9, 3, 64, 16, dtype, seed=12, window=window, softcap=softcap,
             q_gain=_gain(softcap))


@pytest.mark.parametrize("window_plan", [True, False])
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", [5, 100, 1000])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_window_and_softcap_split_contexts(dtype, window, softcap, window_plan):
    """Long contexts split across threads; on the window-less plan (window_plan=False) most
    parts lie before the window and must come out empty for the merge to skip."""
    attn, _ = _compare([1], [3001], 8, 2, 128, 16, dtype, seed=13, window=window,
                       softcap=softcap, q_gain=_gain(softcap), window_plan=window_plan)
    parts = attn.plan(2, 4, 128, window if window_plan else 0).num_parts
    if not window_plan:
        assert parts > 1              # most of them wholly before the window
    elif window <= SPLIT_KEYS:
        assert parts == 0             # only the window's keys are planned: no split
    _compare([40, 1, 300], [2960, 2999, 1800], 9, 3, 64, 16, dtype, seed=14, window=window,
             softcap=softcap, q_gain=_gain(softcap), window_plan=window_plan)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_softcap_far_past_the_cap(dtype):
    """Scores in the hundreds under a cap of 30: the softmax's running max must be taken
    after the cap (the uncapped one would underflow every probability)."""
    _compare([400, 33, 1], [0, 0, 700], 9, 3, 64, 16, dtype, seed=16, softcap=30.0,
             q_gain=300.0)


def test_window_plan_splits_only_the_window():
    rng = np.random.default_rng(15)
    attn = cpu.prepare(_step([1], [8000], 16, 2, 128, rng)[0], threads=2)
    plain, windowed = attn.plan(2, 4, 128), attn.plan(2, 4, 128, 1024)
    assert plain.num_parts > windowed.num_parts > 1
    assert (windowed.items[:, K0] >= 8000 - 1024 + 1).all()
    attn = cpu.prepare(_step([1, 64], [8000, 6000], 16, 2, 128, rng)[0], threads=2)
    items = attn.plan(2, 4, 128, 1024).items
    assert (items[:, K0] >= items[:, POS0] - 1024 + 1).all()   # from the first row's window
    assert (items[:, K1] - items[:, K0] <= 1024 + 64).all()


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        cpu.allocate_kv_cache(1, 4, 12, 1, 64)
    with pytest.raises(ValueError):
        cpu.allocate_kv_cache(1, 4, 16, 1, 64, "bfloat16")


def test_kv_cache_groups_of_a_step_share_work_partitions():
    """Metas with equal query_start_loc and seq_lens (one step's KV cache groups, which
    differ only in block tables) share their partitions; another layout gets its own."""
    qsl, seq_lens = np.array([0, 1, 4], np.int32), np.array([40, 9], np.int32)
    tables = [np.arange(20, dtype=np.int32).reshape(2, 10) + offset for offset in (1, 30)]
    metas = [AttentionMetadata(qsl.copy(), seq_lens.copy(), t, np.arange(4, dtype=np.int64), 4)
             for t in tables]
    first, second = cpu.prepare(metas[0]), cpu.prepare(metas[1])
    assert first.plans is second.plans and second.block_tables[0, 0] == 30
    assert first.plan(2, 2, 16, 8) is second.plan(2, 2, 16, 8)
    other = cpu.prepare(AttentionMetadata(qsl, np.array([41, 9], np.int32), tables[0],
                                          np.arange(4, dtype=np.int64), 4))
    assert other.plans is not first.plans
