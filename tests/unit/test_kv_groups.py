"""KV cache groups (vLLM's hybrid allocator): how layers are grouped, and how the KV cache
manager frees the blocks a sliding window no longer sees while prefix caching stays right.

The Gemma-3-shaped count at the end is the issue's check: an 8k-token request on Gemma 3
270M's layer pattern (5 sliding layers of window 512 per global layer) holds full-length KV
only in the global layers' group."""

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_actors.config import SchedulerConfig
from vllm_actors.enginecore.kv_cache_manager import KVCacheManager
from vllm_actors.enginecore.request import Request
from vllm_actors.enginecore.scheduler import Scheduler
from vllm_actors.models.base import ModelArgs
from vllm_actors.models.kv_layout import (blocks_per_request, kv_cache_groups, layer_slots,
                                          num_slots)
from vllm_actors.protocol.engine import EngineCoreRequest
from vllm_actors.protocol.step import StepOutput
from vllm_actors.sampling_params import SamplingParams


def args_with(windows: tuple[int, ...]) -> ModelArgs:
    return ModelArgs("test", 64, len(windows), 4, 2, 16, 96, 256, 1e-6, 1e4, 32768, 16,
                     layer_windows=windows)


def gemma3_windows(num_layers: int, window: int = 512) -> tuple[int, ...]:
    """Gemma 3: every sixth layer global, the rest sliding."""
    return tuple(0 if (i + 1) % 6 == 0 else window for i in range(num_layers))


def test_gemma3_270m_layers_form_one_full_and_five_sliding_groups():
    groups = kv_cache_groups(args_with(gemma3_windows(18)))
    assert [(g.window, g.layers) for g in groups] == [
        (0, (5, 11, 17)), (512, (0, 1, 2)), (512, (3, 4, 6)), (512, (7, 8, 9)),
        (512, (10, 12, 13)), (512, (14, 15, 16))]
    assert num_slots(groups) == 3
    group_of, slot_of = layer_slots(groups)
    assert group_of[5] == 0 and slot_of[5] == 0 and group_of[4] == 2 and slot_of[4] == 1


def test_group_shapes():
    one_type = kv_cache_groups(args_with((0,) * 4))
    assert [(g.window, g.layers) for g in one_type] == [(0, (0, 1, 2, 3))]   # the old layout
    mistral = kv_cache_groups(args_with((4096,) * 4))
    assert [(g.window, g.layers) for g in mistral] == [(4096, (0, 1, 2, 3))]
    gemma2 = kv_cache_groups(args_with((4096, 0) * 13))
    assert [(g.window, len(g.layers)) for g in gemma2] == [(0, 13), (4096, 13)]
    # 7 sliding + 3 full: padding to groups of 3 would waste 2 of 10 layers -> groups of 1
    odd = kv_cache_groups(args_with((8,) * 7 + (0,) * 3))
    assert len(odd) == 10 and num_slots(odd) == 1
    for windows in [gemma3_windows(26), gemma3_windows(34), (8, 0) * 5, (8, 16, 0) * 4]:
        groups = kv_cache_groups(args_with(windows))
        layers = sorted(i for g in groups for i in g.layers)
        assert layers == list(range(len(windows)))
        assert all(windows[i] == g.window for g in groups for i in g.layers)
        assert all(len(g.layers) <= num_slots(groups) for g in groups)


def test_blocks_per_request_bounds_sliding_groups_by_window_and_chunk():
    groups = kv_cache_groups(args_with(gemma3_windows(18)))
    # full group: 8192 / 16 blocks; sliding: (511 + 2048) tokens + one boundary block
    assert blocks_per_request(groups, 8192, 16, 2048) == 512 + 5 * (160 + 1)
    assert blocks_per_request(groups, 256, 16, 2048) == 6 * 16   # shorter than the window


def make_request(req_id: str, tokens: list[int], block_size: int = 4) -> Request:
    core = EngineCoreRequest(req_id, tokens, SamplingParams(temperature=0, max_tokens=64,
                                                            ignore_eos=True), [2], 0.0)
    return Request(core, max_model_len=20000, block_size=block_size)


def run_prefill(kv: KVCacheManager, request: Request, chunk: int, hits=None) -> list[list[int]]:
    """Allocate and 'compute' the request's prompt in chunks; the held blocks after each."""
    held = []
    num_hit = len(hits[0]) * kv.block_size if hits else 0
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens - num_hit)
        assert kv.allocate_slots(request, n, hits) is not None
        request.num_computed_tokens += n + num_hit
        hits, num_hit = None, 0
        held.append(kv.num_held_blocks(request.request_id))
    return held


def test_sliding_group_frees_blocks_behind_the_window():
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(0, 8))
    request = make_request("a", list(range(100, 180)))          # 80 tokens = 20 blocks
    held = run_prefill(kv, request, chunk=8)
    # full group: every block so far; sliding: the 8-token window behind the chunk + the chunk
    assert [h[0] for h in held] == [2 * (i + 1) for i in range(10)]
    assert max(h[1] for h in held[1:]) <= 2 + 2 + 1
    blocks = kv.req_blocks["a"]
    assert sum(b is kv.null_block for b in blocks[1]) >= 15
    assert kv.pool.num_free_blocks == 64 - sum(kv.num_held_blocks("a"))
    request.append_output_token(7)                     # a decode step frees one more
    kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    assert kv.num_held_blocks("a")[1] <= 3
    kv.free(request)
    assert kv.pool.num_free_blocks == 64


def prefilled_and_freed(num_blocks: int, prompt: list[int]) -> KVCacheManager:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, group_windows=(0, 8))
    a = make_request("a", prompt)
    run_prefill(kv, a, chunk=8)
    kv.free(a)
    return kv


PROMPT = list(range(100, 180))                         # 20 blocks of 4


def test_window_hit_needs_only_the_window_blocks():
    kv = prefilled_and_freed(40, PROMPT)
    hits, n = kv.get_computed_blocks(make_request("b", PROMPT + [5]))
    assert n == 80 and len(hits[0]) == 20 and len(hits[1]) == 20
    assert sum(b is kv.null_block for b in hits[1]) == 18   # the window sees two blocks
    # another request takes 16 blocks from the front of the LRU list: the sliding group's
    # earliest-freed blocks; the hit needs only the window's, which are still cached
    other = make_request("c", list(range(500, 532)))
    assert kv.allocate_slots(other, 32) is not None
    assert kv.pool.cached_block(make_request("x", PROMPT).block_hashes[0], 1) is None
    assert kv.get_computed_blocks(make_request("d", PROMPT + [5]))[1] == 80


def test_hits_of_every_group_are_taken_before_new_blocks():
    """A later group's hit may sit in the free list where an earlier group's new blocks are
    taken from: it must be held first, or the same block becomes both (found by a shadow of
    every KV slot's content in a sliding-window engine test: a prefilled request then read
    another layer's KV)."""
    kv = prefilled_and_freed(40, PROMPT)
    kv.pool.get_new_blocks(16)          # another request holds the 16 blocks in front
    b = make_request("b", PROMPT + [5])
    hits, n = kv.get_computed_blocks(b)
    # past the full group's own hits, the free list's front is a hit of the sliding group
    assert n == 80 and next(blk for blk in kv.pool.free_queue if blk not in hits[0]) \
        is hits[1][-1]
    assert kv.allocate_slots(b, 1, hits) is not None
    held = [blk.block_id for g in kv.req_blocks["b"] for blk in g if blk is not kv.null_block]
    assert len(held) == len(set(held)) == 20 + 2 + 2
    for group, blocks in enumerate(hits):
        for i, block in enumerate(blocks):
            if block is not kv.null_block:
                assert block.block_hash == b.block_hashes[i] and block.group == group

def test_window_hit_shrinks_when_its_tail_is_evicted():
    kv = prefilled_and_freed(64, PROMPT)
    hashes = make_request("x", PROMPT).block_hashes
    for h in hashes[18:20]:                            # the sliding group's last two blocks
        kv.pool.indexes[1].remove(h)
    hits, n = kv.get_computed_blocks(make_request("e", PROMPT + [5]))
    assert n == 72                                     # blocks 16, 17 end a window run
    assert all(b is kv.null_block for b in hits[1][:16])
    assert [b.block_hash for b in hits[1][16:]] == hashes[16:18]
    assert [b.block_hash for b in hits[0]] == hashes[:18]


@st.composite
def operations(draw):
    return draw(st.lists(st.tuples(st.sampled_from(["alloc", "free", "grow"]),
                                   st.integers(0, 4), st.integers(1, 30), st.integers(0, 2)),
                         max_size=50))


@settings(max_examples=120, deadline=None)
@given(operations())
def test_hybrid_pool_invariants(ops):
    """With a full and a sliding group: a block is free exactly when unreferenced; held
    blocks are exactly the referenced ones, none twice in one request; every hit block of every group holds the hash of
    its position; a sliding group holds no block its window cannot see."""
    window, bs = 6, 4
    kv = KVCacheManager(num_blocks=24, block_size=bs, group_windows=(0, window))
    live: dict[str, Request] = {}
    step_start: dict[str, int] = {}      # computed tokens before each request's last step
    for op, slot, length, prefix in ops:
        name = f"r{slot}"
        if op == "alloc" and name not in live:
            r = make_request(name, [prefix] * 8 + list(range(slot, slot + length)))
            hits, n = kv.get_computed_blocks(r)
            for group, blocks in enumerate(hits):
                assert len(blocks) * bs == n
                for i, block in enumerate(blocks):
                    if block is not kv.null_block:
                        assert block.block_hash == r.block_hashes[i] and block.group == group
            if kv.allocate_slots(r, r.num_tokens - n, hits) is not None:
                step_start[name] = n
                r.num_computed_tokens = r.num_tokens
                live[name] = r
        elif op == "grow" and name in live:
            r = live[name]
            r.append_output_token(length)
            # the blocks behind the window go back even when the new block does not fit
            step_start[name] = r.num_computed_tokens
            if kv.allocate_slots(r, 1) is not None:
                r.num_computed_tokens += 1
        elif op == "free" and name in live:
            kv.free(live.pop(name))
        free = {b.block_id for b in kv.pool.free_queue}
        assert 0 not in free and kv.pool.null_block.ref_cnt == 0
        for block in kv.pool.blocks[1:]:
            assert (block.ref_cnt == 0) == (block.block_id in free)
        held = [b.block_id for r in live.values() for g in kv.req_blocks[r.request_id]
                for b in g if b is not kv.null_block]
        assert sorted(held) == sorted(b.block_id for b in kv.pool.blocks[1:] for _ in
                                      range(b.ref_cnt))
        for name, r in live.items():
            own = [b.block_id for g in kv.req_blocks[name] for b in g if b is not kv.null_block]
            assert len(own) == len(set(own))       # no block in two places of one request
            sliding = kv.req_blocks[name][1]
            first = max(0, step_start[name] - window + 1) // bs
            assert all(b is kv.null_block for b in sliding[:first])
            assert all(b is not kv.null_block for b in sliding[first:])
        for group, index in enumerate(kv.pool.indexes):
            for h, node in index.nodes.items() if group == 0 else index.blocks.items():
                block = node.block if group == 0 else node
                assert block.block_hash == h and block.group == group


def test_gemma3_shaped_8k_request_holds_window_blocks_on_local_layers():
    groups = kv_cache_groups(args_with(gemma3_windows(18)))
    windows = [g.window for g in groups]
    bs, budget = 16, 2048
    kv = KVCacheManager(num_blocks=4000, block_size=bs, group_windows=windows)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4)
    scheduler = Scheduler(config, kv, max_model_len=16384)
    prompt = [(i * 7919) % 30000 + 3 for i in range(8192)]
    request = make_request("long", prompt, block_size=bs)
    scheduler.add_request(request)
    for step_index in range(4 + 8):                # 4 prefill chunks of 2048, 8 decode steps
        step = scheduler.schedule()
        sampled = [[11]] if request.num_computed_tokens >= request.num_tokens else [[]]
        scheduler.update_from_output(step, StepOutput(["long"], sampled))
        held = kv.num_held_blocks("long")
        assert held[0] == -(-request.num_computed_tokens // bs)
        assert all(h <= -(-(512 - 1 + budget) // bs) + 1 for h in held[1:])
    held = kv.num_held_blocks("long")
    assert request.num_computed_tokens == 8192 + 8
    assert held[0] == 513                          # global layers: every position
    assert all(h <= 33 for h in held[1:]), held   # local layers: the 512-token window
    with_groups = 3 * sum(held)                    # layer-blocks: 3 layers per group
    without = 18 * held[0]
    assert with_groups < without / 4


def test_lpm_ranking_uses_the_full_groups_prefix():
    """cached_prefix_tokens (lpm's ranking) is the full group's radix match, an upper bound
    of the admitted hit; a model with sliding groups only gets the exact hit."""
    kv = prefilled_and_freed(64, PROMPT)
    for h in make_request("x", PROMPT).block_hashes[18:20]:
        kv.pool.indexes[1].remove(h)
    request = make_request("e", PROMPT + [5])
    assert kv.cached_prefix_tokens(request) == 80
    assert kv.get_computed_blocks(request)[1] == 72
    sliding_only = KVCacheManager(num_blocks=64, block_size=4, group_windows=(8,))
    a = make_request("a", PROMPT)
    run_prefill(sliding_only, a, chunk=8)
    sliding_only.free(a)
    assert sliding_only.cached_prefix_tokens(make_request("b", PROMPT + [5])) == 80
