"""The data parallel router: prefix affinity within the load bound, the shadow caches' LRU,
salts, and dead cores."""

import random

import pytest

from vllm_actors.frontend.router import MIN_SLACK, PrefixRouter, prompt_block_hashes


def test_block_hashes_chain_and_salt():
    a = prompt_block_hashes(list(range(40)), 16)
    assert len(a) == 2                                   # full blocks only
    assert prompt_block_hashes(list(range(35)), 16) == a
    b = prompt_block_hashes([0] * 16 + list(range(16, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]                 # the chain carries the first block
    assert prompt_block_hashes(list(range(40)), 16, "tenant") != a
    assert prompt_block_hashes(list(range(10)), 16) == []


def test_affinity_wins_within_the_bound_and_load_beyond_it():
    router = PrefixRouter(2, capacity_blocks=100)
    family = prompt_block_hashes(list(range(64)), 16)
    router.record(1, family)
    assert router.choose(family, [0, 0], [True, True]) == 1
    assert router.choose(family, [0, MIN_SLACK], [True, True]) == 1
    assert router.choose(family, [0, MIN_SLACK + 1], [True, True]) == 0
    # with many requests in flight the bound grows with the load
    assert router.choose(family, [100, 124], [True, True]) == 1
    assert router.choose(family, [100, 126], [True, True]) == 0
    # no match anywhere: the least loaded, then the lower index
    other = prompt_block_hashes(list(range(100, 164)), 16)
    assert router.choose(other, [3, 2], [True, True]) == 1
    assert router.choose(other, [2, 2], [True, True]) == 0
    # a partial match counts by its length
    router.record(0, family[:2])
    assert router.choose(family, [0, 0], [True, True]) == 1


def test_dead_cores_are_skipped_and_forgotten():
    router = PrefixRouter(3, capacity_blocks=100)
    hashes = prompt_block_hashes(list(range(32)), 16)
    router.record(2, hashes)
    assert router.choose(hashes, [0, 0, 0], [True, True, False]) == 0
    router.forget(2)
    assert router.matched_blocks(2, hashes) == 0
    with pytest.raises(ValueError, match="no engine core is alive"):
        router.choose(hashes, [0, 0, 0], [False, False, False])


def test_shadow_is_an_lru_of_the_core_capacity():
    router = PrefixRouter(1, capacity_blocks=4)
    first = prompt_block_hashes(list(range(48)), 16)          # 3 blocks
    second = prompt_block_hashes(list(range(100, 148)), 16)   # 3 more: evicts 2 of first
    router.record(0, first)
    router.record(0, second)
    assert router.matched_blocks(0, second) == 3
    assert router.matched_blocks(0, first) == 0               # its first block went first
    assert len(router.shadows[0]) == 4


def test_random_arrivals_keep_the_load_bound_and_mostly_the_families():
    """64 requests of 8 families in random order on 2 cores, none finishing: no routing
    decision puts a core more than the slack above the other, and most requests find their
    family's prefix where they land."""
    rng = random.Random(0)
    prefixes = [prompt_block_hashes(list(range(f * 1000, f * 1000 + 160)), 16)
                for f in range(8)]
    router = PrefixRouter(2, capacity_blocks=10_000)
    loads, hits = [0, 0], 0
    order = [f for f in range(8) for _ in range(8)]
    rng.shuffle(order)
    for family in order:
        engine = router.choose(prefixes[family], loads, [True, True])
        hits += router.matched_blocks(engine, prefixes[family]) == 10
        router.record(engine, prefixes[family])
        loads[engine] += 1
        assert abs(loads[0] - loads[1]) <= router.slack(min(loads)) + 1
    print("loads", loads, "prefix hits", hits, "of 56 possible")
    assert hits >= 48
