"""KV block pool: block objects with ref counts, an O(1) LRU free list, prefix-cache index.

Invariants (checked by property tests):
- block 0 is the null block: never handed out, freed or cached;
- a block is in the free list exactly when its ref count is 0;
- a freed block keeps its hash (it can still be hit) until it is handed out again;
- every indexed hash maps to a block that holds that hash;
- a block is cached in at most one KV cache group's index (`KVBlock.group`).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from vllm_actors.enginecore.block_hash import BlockHash
from vllm_actors.enginecore.radix import FlatIndex, RadixIndex


class KVBlock:
    """One block of KV memory. `prev_free`/`next_free` link it into the free list; `group`
    is the KV cache group whose index holds its hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group = 0
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list through the blocks: popleft/append/appendleft/remove in
    O(1). The front is the first to be reused: freed blocks with no cached hash, then the
    least recently freed cached block (evicted)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, "block is not in the free list"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def appendleft(self, block: KVBlock) -> None:
        first = self.head.next_free
        assert first is not None
        self.head.next_free, block.prev_free = block, self.head
        block.next_free, first.prev_free = first, block
        self.num_free_blocks += 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is self.tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[KVBlock]:
        block = self.head.next_free
        while block is not None and block is not self.tail:
            yield block
            block = block.next_free


class BlockPool:
    """Args:
        num_blocks: blocks in total, the null block included.
        enable_caching: index full blocks by hash for prefix caching.
        group_windows: the sliding window of each KV cache group (0: full attention). Each
            group has its own index: a radix trie for full attention, a flat map for
            sliding windows (see `FlatIndex`).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 group_windows: Sequence[int] = (0,)) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.enable_caching = enable_caching
        self.indexes: list[RadixIndex | FlatIndex] = [
            FlatIndex() if window else RadixIndex() for window in group_windows]

    @property
    def index(self) -> RadixIndex | FlatIndex:
        """The first group's index (the only one of a model with one attention type)."""
        return self.indexes[0]

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks that are referenced."""
        usable = len(self.blocks) - 1
        return (usable - self.num_free_blocks) / usable if usable else 0.0

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the front of the free list, evicting their cached hashes."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self.indexes[block.group].remove(block.block_hash)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (pulling free ones out of the free list);
        the null block is skipped."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; cached blocks reaching 0 join the free list's back in the given
        order (LRU eviction, as vLLM), blocks with no hash its front, so the next request
        reuses them first: nothing cached is lost by it, and their memory is warm (vLLM
        queues them behind never-used blocks, so a server's first pass over its KV budget
        wrote every prefill into fresh pages; docs/BENCHMARKS.md, "Warm KV blocks first").
        The null block (a sliding group's placeholder) is skipped."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt > 0
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash],
                          start: int, end: int, group: int = 0) -> None:
        """Index blocks[start:end] (all full) under block_hashes[start:end] in `group`'s
        index; null placeholders are skipped."""
        if not self.enable_caching:
            return
        index = self.indexes[group]
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is None and block is not self.null_block:
                parent = block_hashes[i - 1] if i > 0 else None
                if index.insert(parent, block_hashes[i], block):
                    block.group = group

    def lookup(self, block_hashes: Sequence[BlockHash], group: int = 0) -> list[KVBlock]:
        """The cached blocks of the longest cached prefix of `block_hashes` (a full-attention
        group)."""
        index = self.indexes[group]
        assert isinstance(index, RadixIndex)
        return index.match(block_hashes) if self.enable_caching else []

    def cached_block(self, block_hash: BlockHash, group: int) -> KVBlock | None:
        return self.indexes[group].get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != len(self.blocks) - 1:
            return False
        for index in self.indexes:
            index.clear()
        return True
