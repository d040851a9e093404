"""Chained hashes of full KV blocks: hash(parent hash, the block's token ids, extra keys).

Chaining makes a block's hash name its whole prefix, so equal hashes mean equal prefixes and
a prefix-cache lookup can stop at the first miss. SHA-256 (not Python's `hash`) keeps
collisions out of reach.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = bytes(32)


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: str | None = None) -> BlockHash:
    """The hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(parent or ROOT_HASH)
    h.update(array("l", token_ids).tobytes())
    if extra_keys is not None:
        h.update(b"\x00salt\x00" + extra_keys.encode())
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None) -> None:
    """Append the hashes of every block of `token_ids` that is full and not yet hashed.
    The salt goes into the first block only; chaining carries it to the rest."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        salt = cache_salt if not hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start:start + block_size], salt))
