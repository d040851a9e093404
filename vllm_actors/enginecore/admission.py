"""Waiting queues, one per scheduling policy. The scheduler asks `peek()` for the request to
admit next and `pop()`s it once its blocks are reserved.

- fcfs: arrival order; preempted requests go back to the front.
- priority: smallest `priority` first, then earliest arrival (vLLM's order).
- lpm: the request with the longest cached prefix first (SGLang's longest-prefix-match);
  ties go to the earliest; a request passed over `max_skips` times is admitted next.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

from vllm_actors.enginecore.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self.queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.queue)

    def add(self, request: Request) -> None:
        self.queue.append(request)

    def prepend(self, request: Request) -> None:
        """A preempted request resumes before newer arrivals."""
        self.queue.appendleft(request)

    def peek(self) -> Request:
        return self.queue[0]

    def pop(self, request: Request) -> None:
        if self.queue[0] is request:
            self.queue.popleft()
        else:
            self.queue.remove(request)

    def remove(self, request: Request) -> None:
        self.queue.remove(request)


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class PriorityQueue(FCFSQueue):
    """Kept sorted on insertion (bisect-free: waiting queues are short next to a step)."""

    def add(self, request: Request) -> None:
        key = _priority_key(request)
        for i, other in enumerate(self.queue):
            if key < _priority_key(other):
                self.queue.insert(i, request)
                return
        self.queue.append(request)

    def prepend(self, request: Request) -> None:
        self.add(request)


class LPMQueue(FCFSQueue):
    """Args:
        cached_tokens: a request's cached prefix length (the KV cache manager's radix lookup).
        max_skips: how many times a request may be passed over by a later one.
        scan_limit: how many waiting requests are ranked per admission.
    """

    def __init__(self, cached_tokens: Callable[[Request], int], max_skips: int,
                 scan_limit: int = 64) -> None:
        super().__init__()
        self.cached_tokens = cached_tokens
        self.max_skips = max_skips
        self.scan_limit = scan_limit

    def peek(self) -> Request:
        head = self.queue[0]
        if head.num_times_skipped >= self.max_skips:
            return head
        best, best_len = head, self.cached_tokens(head)
        for i, request in enumerate(self.queue):
            if i >= self.scan_limit:
                break
            length = self.cached_tokens(request) if i else best_len
            if length > best_len:
                best, best_len = request, length
        return best

    def pop(self, request: Request) -> None:
        for ahead in self.queue:
            if ahead is request:
                break
            ahead.num_times_skipped += 1
        super().pop(request)


def make_waiting_queue(policy: str, cached_tokens: Callable[[Request], int],
                       lpm_max_skips: int) -> FCFSQueue:
    if policy == "priority":
        return PriorityQueue()
    if policy == "lpm":
        return LPMQueue(cached_tokens, lpm_max_skips)
    return FCFSQueue()
