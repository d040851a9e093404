"""Block pool and KV cache manager with exact block ids, plus property tests."""

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_actors.enginecore.block_hash import extend_block_hashes, hash_block_tokens
from vllm_actors.enginecore.block_pool import BlockPool
from vllm_actors.enginecore.kv_cache_manager import KVCacheManager
from vllm_actors.enginecore.request import Request
from vllm_actors.protocol.engine import EngineCoreRequest
from vllm_actors.sampling_params import SamplingParams


def req(req_id: str, tokens: list[int], salt: str | None = None) -> Request:
    core = EngineCoreRequest(req_id, tokens, SamplingParams(temperature=0), [2], 0.0,
                             cache_salt=salt)
    return Request(core, max_model_len=1000, block_size=4)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def one(groups):
    """The only group's blocks of a model with one attention type."""
    assert len(groups) == 1
    return groups[0]


def test_null_block_and_free_order():
    """Freed blocks that hold no cached hash are handed out again first, in the order their
    request held them: their memory is the most recently touched (vLLM queues them behind
    blocks never used)."""
    pool = BlockPool(6)
    assert pool.null_block.block_id == 0 and pool.num_free_blocks == 5
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3] and all(b.ref_cnt == 1 for b in a)
    pool.free_blocks(reversed(a))
    assert ids(pool.free_queue) == [1, 2, 3, 4, 5]
    assert ids(pool.get_new_blocks(2)) == [1, 2]


def test_free_list_middle_removal():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks(blocks)
    pool.touch([blocks[2]])                       # a prefix hit pulls it out of the middle
    assert ids(pool.free_queue) == [5, 4, 2, 1] and blocks[2].ref_cnt == 1
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 2


def test_block_hashes_chain_and_salt():
    tokens = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 4)
    assert len(hashes) == 2                       # the partial third block is not hashed
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens, 4, cache_salt="user-1")
    assert salted[0] != hashes[0] and salted[1] != hashes[1]
    other: list[bytes] = []
    extend_block_hashes(other, [9] + tokens[1:], 4)
    assert other[1] != hashes[1]                  # same tokens, different prefix


def test_prefix_hit_lengths_leave_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(12)))                 # 3 full blocks
    assert ids(one(kv.allocate_slots(a, 12))) == [1, 2, 3]
    a.num_computed_tokens = 12
    kv.free(a)
    same = req("b", list(range(12)))              # all 12 cached, but the last token is recomputed
    hits, n = kv.get_computed_blocks(same)
    assert ids(one(hits)) == [1, 2] and n == 8
    longer = req("c", list(range(14)))
    hits, n = kv.get_computed_blocks(longer)
    assert ids(one(hits)) == [1, 2, 3] and n == 12
    diverging = req("d", list(range(6)) + [99] * 6)
    assert kv.get_computed_blocks(diverging)[1] == 4
    salted = req("e", list(range(14)), salt="x")
    assert kv.get_computed_blocks(salted)[1] == 0
    assert kv.take_prefix_stats() == (12 + 14 + 12 + 14, 8 + 12 + 4)


def test_allocation_with_hits_and_lru_eviction_order():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)                       # blocks 1, 2 (cached: both full)
    b = req("b", [50 + i for i in range(8)])
    kv.allocate_slots(b, 8)                       # blocks 3, 4
    kv.free(a)
    kv.free(b)
    assert ids(kv.pool.free_queue) == [5, 6, 2, 1, 4, 3]
    c = req("c", list(range(8)) + [7, 7, 7])      # hits a's first two blocks
    hits, n = kv.get_computed_blocks(c)
    assert ids(one(hits)) == [1, 2] and n == 8
    new = kv.allocate_slots(c, 3, hits)
    assert ids(one(new)) == [1, 2, 5] and kv.get_block_ids("c") == [[1, 2, 5]]
    d = req("d", [200 + i for i in range(12)])    # 3 blocks: 6, then evicts 4, 3 (b's, LRU)
    assert ids(one(kv.allocate_slots(d, 12))) == [6, 4, 3]
    assert kv.get_computed_blocks(req("x", [50 + i for i in range(9)]))[1] == 0
    assert kv.allocate_slots(req("e", list(range(300, 304))), 4) is None  # none free
    assert "e" not in kv.req_blocks


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0


@st.composite
def operations(draw):
    return draw(st.lists(st.tuples(st.sampled_from(["alloc", "free", "grow"]),
                                   st.integers(0, 5), st.integers(1, 12), st.integers(0, 3)),
                         max_size=60))


@settings(max_examples=150, deadline=None)
@given(operations())
def test_pool_invariants(ops):
    """A block is free exactly when unreferenced; ref counts never go negative; every cached
    hash maps to a block whose tokens produce that hash; the null block is untouched."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    live: dict[str, Request] = {}
    tokens_of_hash: dict[bytes, tuple] = {}
    for op, slot, length, prefix in ops:
        name = f"r{slot}"
        if op == "alloc" and name not in live:
            r = req(name, [prefix] * 4 + list(range(slot, slot + length)))
            hits, n = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - n, hits) is not None:
                r.num_computed_tokens = r.num_tokens
                live[name] = r
        elif op == "grow" and name in live:
            r = live[name]
            r.append_output_token(length)
            if kv.allocate_slots(r, 1) is not None:
                r.num_computed_tokens += 1
        elif op == "free" and name in live:
            kv.free(live.pop(name))
        for r in live.values():
            for i, h in enumerate(r.block_hashes):
                tokens_of_hash.setdefault(h, tuple(r.all_token_ids[:(i + 1) * 4]))
        free = set(ids(kv.pool.free_queue))
        assert 0 not in free and kv.pool.null_block.ref_cnt == 0
        for block in kv.pool.blocks[1:]:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in free)
        held = {b.block_id for r in live.values()
                for b in one(kv.req_blocks.get(r.request_id, [[]]))}
        assert held == {b.block_id for b in kv.pool.blocks[1:] if b.ref_cnt > 0}
        for h, node in kv.pool.index.nodes.items():
            assert node.block.block_hash == h
            expected: list[bytes] = []
            extend_block_hashes(expected, list(tokens_of_hash[h]), 4)
            assert expected[-1] == h
