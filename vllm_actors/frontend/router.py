"""Which data parallel engine core a request goes to: by load, and by the prefix each core
already has cached.

Load is the frontend's own count of unfinished requests per core. vLLM's coordinator polls
waiting/running counts from the cores; the frontend here is the only client of its cores,
so its count is exact at the moment of routing and costs nothing to keep.

Prefix affinity uses a shadow of each core's prefix cache kept in the frontend: the chained
hashes of the full prompt blocks the frontend has sent to that core, in an LRU of the
core's KV capacity (the core's own cache evicts least recently used blocks too). Routing a
prompt of B blocks costs B tuple hashes and at most B dict lookups per core, and no round
trip; the shadow is current because every prompt a core sees passes through here first.
What it cannot see is the core evicting early under memory pressure: then the routed
request recomputes the prefix, which is what it would do on any other core.

The rule: the least loaded cores are eligible, and so is every core whose load exceeds the
least by no more than `max(MIN_SLACK, min_load * REL_SLACK)`; among the eligible, the one
with the longest cached prefix wins, then the less loaded, then the lower index.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

MIN_SLACK = 8        # requests a core may be ahead of the least loaded for a cache hit
REL_SLACK = 0.25     # ... or this fraction of the least loaded core's requests, if more


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        salt: str | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (the salt seeds the chain, as the
    core's does: only prompts with the same salt share blocks). Process-local values."""
    hashes = []
    parent: object = ("salt", salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixRouter:
    """Args:
        num_engines: engine cores.
        capacity_blocks: KV blocks each core holds (its shadow keeps as many hashes).
    """

    def __init__(self, num_engines: int, capacity_blocks: int) -> None:
        self.capacity = max(1, capacity_blocks)
        self.shadows: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]

    def slack(self, min_load: int) -> int:
        """How far above the least loaded core a core may be and still be eligible."""
        return max(MIN_SLACK, int(min_load * REL_SLACK))

    def matched_blocks(self, engine: int, hashes: list[int]) -> int:
        """Leading blocks of a prompt with `hashes` that engine `engine` holds."""
        shadow = self.shadows[engine]
        count = 0
        for h in hashes:
            if h not in shadow:
                break
            count += 1
        return count

    def choose(self, hashes: list[int], loads: Sequence[int], alive: Sequence[bool]) -> int:
        """The engine for a prompt with block `hashes` given each core's load. Raises
        ValueError when no core is alive."""
        live = [e for e in range(len(loads)) if alive[e]]
        if not live:
            raise ValueError("no engine core is alive")
        least = min(loads[e] for e in live)
        bound = least + self.slack(least)
        eligible = [e for e in live if loads[e] <= bound]
        return max(eligible, key=lambda e: (self.matched_blocks(e, hashes), -loads[e], -e))

    def record(self, engine: int, hashes: list[int]) -> None:
        """Engine `engine` will cache these blocks: most recently used now."""
        shadow = self.shadows[engine]
        for h in hashes:
            shadow[h] = None
            shadow.move_to_end(h)
        while len(shadow) > self.capacity:
            shadow.popitem(last=False)

    def forget(self, engine: int | None = None) -> None:
        """Engine `engine` lost its cache (died, or the prefix cache was reset); None: all."""
        for e in range(len(self.shadows)) if engine is None else (engine,):
            self.shadows[e].clear()
