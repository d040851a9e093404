"""KV cache groups: how a model's layers share the paged KV cache (vLLM's hybrid allocator).

Layers with the same attention type (full, or a sliding window of a given width) are split
into groups of equal size. Every group has its own block list per request, but all groups
draw their block ids from one pool, and block id b of group g is page b of the group's
layers: the cache holds `group_size` tensors (slots), and layer i keeps its KV in slot
`slot_of[i]` at the block ids of group `group_of[i]`. A block id belongs to one group at a
time, so layers of different groups that share a slot never collide.

What this buys: a sliding-window group needs only the blocks its window can still see, so
the scheduler frees the blocks behind the window. A Gemma 3 request of 32k tokens then holds
full-length KV for its global layers only. A model with one attention type has one group of
all its layers, the layout it had before groups existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_actors.models.base import ModelArgs


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share block lists. `window`: their sliding window (0: full attention)."""

    window: int
    layers: tuple[int, ...]


def _group_size(counts: list[int]) -> int:
    """vLLM takes the smallest type's layer count and pads the last group of the other
    types; we do the same unless padding would waste more than a tenth of the layers, and
    then take the greatest common divisor (no padding, more groups)."""
    smallest = min(counts)
    padding = sum(-c % smallest for c in counts)
    return smallest if padding * 10 <= sum(counts) else math.gcd(*counts)


def kv_cache_groups(args: ModelArgs) -> list[KVCacheGroup]:
    """The model's KV cache groups: full-attention groups first, then by window width."""
    by_window: dict[int, list[int]] = {}
    for layer in range(args.num_layers):
        by_window.setdefault(args.window(layer), []).append(layer)
    size = _group_size([len(layers) for layers in by_window.values()])
    return [KVCacheGroup(window, tuple(layers[start:start + size]))
            for window, layers in sorted(by_window.items())
            for start in range(0, len(layers), size)]


def layer_slots(groups: list[KVCacheGroup]) -> tuple[list[int], list[int]]:
    """(group_of, slot_of) per layer."""
    num_layers = sum(len(g.layers) for g in groups)
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            group_of[layer], slot_of[layer] = g, slot
    return group_of, slot_of


def num_slots(groups: list[KVCacheGroup]) -> int:
    """KV tensors the cache needs: the largest group's layer count."""
    return max(len(g.layers) for g in groups)


def blocks_per_request(groups: list[KVCacheGroup], num_tokens: int, block_size: int,
                       max_num_batched_tokens: int) -> int:
    """Most blocks (pages) one request of `num_tokens` holds at once over all groups. A
    sliding group keeps the window behind its oldest new token plus one step's chunk (vLLM's
    bound, one block more for a window that does not start on a block boundary)."""
    total = 0
    for group in groups:
        tokens = num_tokens
        if group.window:
            tokens = min(num_tokens, group.window - 1 + max_num_batched_tokens)
        total += -(-tokens // block_size) + (1 if group.window and tokens < num_tokens else 0)
    return total
