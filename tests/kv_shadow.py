"""A shadow of the paged KV cache kept from the scheduler's block tables: which KV each slot
holds, as (group, hash of the token prefix ending there), and a check that every slot a
step's attention reads holds its own prefix's KV in its own group.

Tokens alone cannot show a stale read: a small model may well give the same greedy tokens
from another request's KV. The shadow shows it whatever the numbers. It models the worker:
block id b of any group is the same page of the shared slots (`models/kv_layout.py`), a
step writes its tokens' KV before attention reads, and a sliding group's token at position
p reads positions above p - window."""

from __future__ import annotations

from vllm_actors.enginecore.scheduler import Scheduler


class KVShadow:
    """Wraps one scheduler's `schedule`; `problems` lists (request, group, position read,
    block id) for every slot read that held other KV."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.pages: dict[int, tuple[int, int]] = {}
        self.problems: list[tuple[str, int, int, int]] = []
        schedule = scheduler.schedule

        def checked():
            step = schedule()
            self.check(step)
            return step
        scheduler.schedule = checked

    @staticmethod
    def _prefix_hashes(tokens: list[int]) -> list[int]:
        out, h = [], 0
        for token in tokens:
            h = hash((h, token))
            out.append(h)
        return out

    def check(self, step) -> None:
        kv = self.scheduler.kv
        bs = kv.block_size
        for req_id, n in step.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens
            prefix = self._prefix_hashes(request.all_token_ids[:end])
            for group, (window, table) in enumerate(zip(kv.windows,
                                                        kv.get_block_ids(req_id))):
                for p in range(end - n, end):
                    self.pages[table[p // bs] * bs + p % bs] = (group, prefix[p])
                for p in range(end - n, end):
                    for q in range(max(0, p - window + 1) if window else 0, p + 1):
                        block = table[q // bs]
                        if block == 0 or self.pages.get(block * bs + q % bs) != (group,
                                                                                   prefix[q]):
                            self.problems.append((req_id, group, q, block))
