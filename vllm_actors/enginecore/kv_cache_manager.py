"""KVCacheManager: per-request block lists over the BlockPool, prefix-cache lookups and stats.

A model's layers come in KV cache groups (`models/kv_layout.py`, vLLM's hybrid allocator):
each group has its own block list per request, all drawn from one pool. A full-attention
group keeps a block for every position. A sliding-window group gives back the blocks its
window can no longer see: they become the null block in the request's list (and stay
prefix-cached until evicted), so a long request holds only a window of blocks there.

Block lists are append-only as the worker sees them, so workers only ever receive new block
ids; the freed entries are never read again (attention skips keys behind the window).
A prefix hit never covers the last prompt token: that token is recomputed so its logits exist.
A hit must hold in every group: a prefix in the full-attention groups and, in each sliding
group, the blocks the window sees at the hit's end.
"""

from __future__ import annotations

from typing import Sequence

from vllm_actors.enginecore.block_hash import BlockHash
from vllm_actors.enginecore.block_pool import BlockPool, KVBlock
from vllm_actors.enginecore.request import Request

GroupBlocks = list[list[KVBlock]]   # one list per KV cache group


class KVCacheManager:
    """Args:
        num_blocks: usable blocks (the null block comes on top).
        block_size: tokens per block.
        enable_caching: automatic prefix caching.
        group_windows: each KV cache group's sliding window (0: full attention); one full
            group by default.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 group_windows: Sequence[int] = (0,)) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = list(group_windows) or [0]
        self.pool = BlockPool(num_blocks + 1, enable_caching, self.windows)
        self.null_block = self.pool.null_block
        self.req_blocks: dict[str, GroupBlocks] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    def take_prefix_stats(self) -> tuple[int, int]:
        """(queried tokens, hit tokens) since the last call."""
        stats = (self.prefix_cache_queries, self.prefix_cache_hits)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return stats

    def _hittable_hashes(self, request: Request) -> list[BlockHash]:
        return request.block_hashes[:(request.num_tokens - 1) // self.block_size]

    def _first_visible_block(self, num_tokens: int, window: int) -> int:
        """The first block a sliding window still sees when the next token's position is
        `num_tokens` (it sees positions > num_tokens - window)."""
        return max(0, num_tokens - window + 1) // self.block_size

    def _window_hit(self, hashes: list[BlockHash], length: int, window: int, group: int) -> int:
        """Longest hit of at most `length` blocks for a sliding group: the blocks its window
        sees at the hit's end must be cached in the group (vLLM's right-to-left scan)."""
        need = -(-(window - 1) // self.block_size)
        if need == 0:
            return length
        run = 0
        for i in range(length - 1, -1, -1):
            if self.pool.cached_block(hashes[i], group) is None:
                run = 0
                continue
            run += 1
            if run >= need:
                return i + need
        return run   # a cached run from block 0, shorter than the window

    def _find_hit(self, request: Request) -> tuple[GroupBlocks, int]:
        """The blocks of the longest prefix cached in every group, and its length in blocks."""
        hashes = self._hittable_hashes(request)
        length = len(hashes)
        for group, window in enumerate(self.windows):
            if not window:
                length = len(self.pool.lookup(hashes[:length], group))
        changed = True
        while changed:   # a shorter hit in one sliding group may end outside another's run
            changed = False
            for group, window in enumerate(self.windows):
                if window and length:
                    n = self._window_hit(hashes, length, window, group)
                    changed, length = changed or n < length, min(length, n)
        hits: GroupBlocks = []
        for group, window in enumerate(self.windows):
            if not window:
                hits.append(self.pool.lookup(hashes[:length], group))
                continue
            first = self._first_visible_block(length * self.block_size, window)
            hits.append([self.null_block] * first + [
                self.pool.cached_block(h, group) for h in hashes[first:length]])
        return hits, length

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's longest cached prefix (no stats, no references taken),
        for ranking waiting requests (lpm). With a full-attention group this is its radix
        match, an upper bound that sliding groups may shorten at admission: ranking up to
        64 waiting requests per admission must not scan every sliding group of each."""
        if not self.enable_caching:
            return 0
        if 0 in self.windows:
            hashes = self._hittable_hashes(request)
            return self.pool.indexes[self.windows.index(0)].match_length(hashes) \
                * self.block_size
        return self._find_hit(request)[1] * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The request's cached prefix blocks per group and their token count; counted in
        the stats."""
        if not self.enable_caching:
            return [[] for _ in self.windows], 0
        hits, length = self._find_hit(request)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += length * self.block_size
        return hits, length * self.block_size

    def _free_behind_windows(self, request: Request, blocks: GroupBlocks) -> None:
        """Give back the blocks no sliding window sees any more, oldest first; they stay
        prefix-cached until evicted."""
        for window, group_blocks in zip(self.windows, blocks):
            if not window:
                continue
            first = self._first_visible_block(request.num_computed_tokens, window)
            removed = []
            for i in range(min(first, len(group_blocks)) - 1, -1, -1):
                if group_blocks[i] is self.null_block:
                    break
                removed.append(group_blocks[i])
                group_blocks[i] = self.null_block
            self.pool.free_blocks(reversed(removed))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: GroupBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> GroupBlocks | None:
        """Reserve blocks for `num_new_tokens` more tokens after the computed ones (and after
        `new_computed_blocks`, prefix hits being added now, per group), and for
        `num_lookahead_tokens` after those (a draft model's own drafts; never cached).

        Returns the blocks appended to the request's lists (hits first), per group, or None
        when the free list cannot cover them; only blocks behind a window are given back in
        that case.
        """
        hits = new_computed_blocks or [[] for _ in self.windows]
        blocks = self.req_blocks.get(request.request_id)
        if blocks is not None:
            self._free_behind_windows(request, blocks)
        current = blocks or [[] for _ in self.windows]
        num_computed = request.num_computed_tokens + len(hits[0]) * self.block_size
        total = num_computed + num_new_tokens
        num_full = -(-(total + num_lookahead_tokens) // self.block_size)
        num_needed = [max(num_full - len(b) - len(h), 0) for b, h in zip(current, hits)]
        num_evictable_hits = sum(1 for h in hits for b in h
                                 if b.ref_cnt == 0 and b is not self.null_block)
        if sum(num_needed) + num_evictable_hits > self.pool.num_free_blocks:
            return None
        self.req_blocks[request.request_id] = current
        for group_hits in hits:   # every group's hits first: a later group's may be free
            self.pool.touch(group_hits)     # where an earlier group's new blocks come from
        new_blocks = []
        for group_blocks, group_hits, n in zip(current, hits, num_needed):
            new = group_hits + self.pool.get_new_blocks(n)
            group_blocks.extend(new)
            new_blocks.append(new)
        if self.enable_caching:
            num_cacheable = min(total, request.num_tokens) // self.block_size
            start = self.num_cached_blocks.get(request.request_id, 0)
            for group, group_blocks in enumerate(current):
                self.pool.cache_full_blocks(group_blocks, request.block_hashes, start,
                                            num_cacheable, group)
            self.num_cached_blocks[request.request_id] = max(start, num_cacheable)
        return new_blocks

    def free(self, request: Request) -> None:
        """Return the request's blocks, last block first in each group (deepest evicted
        first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        for group_blocks in blocks:
            self.pool.free_blocks(reversed(group_blocks))

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group (0: the null block)."""
        return [[b.block_id for b in group_blocks]
                for group_blocks in self.req_blocks.get(request_id, [[] for _ in self.windows])]

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Blocks the request holds per group (null placeholders not counted)."""
        return [sum(1 for b in group_blocks if b is not self.null_block)
                for group_blocks in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
