"""KVCacheManager: per-request block lists over the BlockPool, prefix-cache lookups and stats.

Block lists are append-only while a request runs, so workers only ever receive new block ids.
A prefix hit never covers the last prompt token: that token is recomputed so its logits exist.
"""

from __future__ import annotations

from vllm_actors.enginecore.block_pool import BlockPool, KVBlock
from vllm_actors.enginecore.request import Request


class KVCacheManager:
    """Args:
        num_blocks: usable blocks (the null block comes on top).
        block_size: tokens per block.
        enable_caching: automatic prefix caching.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks + 1, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
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

    def _hittable_hashes(self, request: Request) -> list[bytes]:
        return request.block_hashes[:(request.num_tokens - 1) // self.block_size]

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's longest cached prefix (no stats, no references taken)."""
        if not self.enable_caching:
            return 0
        return self.pool.index.match_length(self._hittable_hashes(request)) * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The request's cached prefix blocks and their token count; counted in the stats."""
        if not self.enable_caching:
            return [], 0
        blocks = self.pool.lookup(self._hittable_hashes(request))
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Reserve blocks for `num_new_tokens` more tokens after the computed ones (and after
        `new_computed_blocks`, prefix hits being added now).

        Returns the blocks appended to the request's list (hits first), or None when the free
        list cannot cover them; nothing changes in that case.
        """
        hits = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(hits)
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed + num_evictable_hits > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(hits)
        new_blocks = hits + self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            num_full = min(total, request.num_tokens) // self.block_size
            start = self.num_cached_blocks.get(request.request_id, 0)
            self.pool.cache_full_blocks(blocks, request.block_hashes, start, num_full)
            self.num_cached_blocks[request.request_id] = max(start, num_full)
        return new_blocks

    def free(self, request: Request) -> None:
        """Return the request's blocks, last block first (deepest evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
