"""Radix index over cached blocks: a trie whose edges are chained block hashes.

A lookup walks from the root one block hash at a time, so a hit is always a true prefix of
the request; `match_length` is what longest-prefix-match admission ranks requests by.
Evicting a block drops its subtree from the index (those blocks could no longer be reached).
"""

from __future__ import annotations

from typing import Any, Sequence

from vllm_actors.enginecore.block_hash import BlockHash


class _Node:
    __slots__ = ("block_hash", "block", "parent", "children")

    def __init__(self, block_hash: BlockHash | None, block: Any, parent: "_Node | None") -> None:
        self.block_hash = block_hash
        self.block = block
        self.parent = parent
        self.children: dict[BlockHash, _Node] = {}


class RadixIndex:
    """Maps block-hash chains to cached blocks (objects with a `block_hash` attribute)."""

    def __init__(self) -> None:
        self.root = _Node(None, None, None)
        self.nodes: dict[BlockHash, _Node] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.nodes

    def insert(self, parent_hash: BlockHash | None, block_hash: BlockHash, block: Any) -> bool:
        """Index `block` under its parent; False (nothing indexed) when the hash is already
        cached or the parent is not (then the block could never be reached)."""
        if block_hash in self.nodes:
            return False
        parent = self.root if parent_hash is None else self.nodes.get(parent_hash)
        if parent is None:
            return False
        node = _Node(block_hash, block, parent)
        parent.children[block_hash] = node
        self.nodes[block_hash] = node
        block.block_hash = block_hash
        return True

    def remove(self, block_hash: BlockHash) -> list[Any]:
        """Drop a block and its descendants from the index; returns their blocks (whose
        `block_hash` is reset)."""
        node = self.nodes.get(block_hash)
        if node is None:
            return []
        assert node.parent is not None
        del node.parent.children[block_hash]
        removed, stack = [], [node]
        while stack:
            current = stack.pop()
            del self.nodes[current.block_hash]
            current.block.block_hash = None
            removed.append(current.block)
            stack.extend(current.children.values())
        return removed

    def match(self, block_hashes: Sequence[BlockHash]) -> list[Any]:
        """Blocks of the longest cached prefix of `block_hashes`."""
        node, blocks = self.root, []
        for block_hash in block_hashes:
            node = node.children.get(block_hash)
            if node is None:
                break
            blocks.append(node.block)
        return blocks

    def match_length(self, block_hashes: Sequence[BlockHash]) -> int:
        """Number of leading blocks of `block_hashes` that are cached."""
        return len(self.match(block_hashes))

    def get(self, block_hash: BlockHash) -> Any:
        """The cached block of one hash, or None."""
        node = self.nodes.get(block_hash)
        return None if node is None else node.block

    def clear(self) -> None:
        for node in self.nodes.values():
            node.block.block_hash = None
        self.root.children.clear()
        self.nodes.clear()


class FlatIndex:
    """Cached blocks by hash alone, for sliding-window KV groups. A window's hit needs only
    the blocks at its end, and those blocks' hashes chain over the whole prefix, so a block
    stays reachable when blocks before it are evicted (a trie would drop it with them)."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, Any] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.blocks

    def insert(self, parent_hash: BlockHash | None, block_hash: BlockHash, block: Any) -> bool:
        """Index `block`; False when the hash is already cached."""
        if block_hash in self.blocks:
            return False
        self.blocks[block_hash] = block
        block.block_hash = block_hash
        return True

    def remove(self, block_hash: BlockHash) -> list[Any]:
        block = self.blocks.pop(block_hash, None)
        if block is None:
            return []
        block.block_hash = None
        return [block]

    def get(self, block_hash: BlockHash) -> Any:
        return self.blocks.get(block_hash)

    def clear(self) -> None:
        for block in self.blocks.values():
            block.block_hash = None
        self.blocks.clear()
