"""Preparation off the event loop, in two lanes: a request's heavy work (JSON decoding, chat
template, tokenization, grammar checks) runs in a thread pool, and requests that look heavy
(large bodies, grammars, tools, templates, bad words, biases) get a pool of their own whose
queue is bounded, so they wait or are refused (503) rather than delay light ones. After a
large body the freed memory goes back to the system.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import threading
from typing import Any, Callable, TypeVar

from vllm_actors.frontend.openai_schema import APIError

PREPARE_THREADS = 4        # light requests being decoded / rendered / tokenized at once
HEAVY_THREADS = 2          # heavy ones (large bodies, grammars, tools, templates, bad words)
HEAVY_WAITING = 16         # heavy requests that may wait for a thread; more are refused 503
PREPARE_TIMEOUT_S = 60.0   # a request still not prepared after this is refused (503)
HEAVY_BODY_BYTES = 64 * 2**10
# Body fragments that mark a request whose preparation may be heavy (grammar checks, tool
# schemas, templates, bad-word tokenization); found with a byte search, before decoding.
HEAVY_MARKERS = (b"guided_", b"response_format", b"structured_outputs", b'"tools"',
                 b"chat_template", b'"format"', b"bad_words", b"logit_bias")
LARGE_WORK_BYTES = 2**20   # after a body this large, free memory goes back to the system
T = TypeVar("T")


def is_heavy(body: bytes) -> bool:
    """Whether preparing this body may take long: the heavy lane's bounded queue then keeps
    it from delaying light requests (docs: README's limits)."""
    return len(body) > HEAVY_BODY_BYTES or any(m in body for m in HEAVY_MARKERS)


class PrepareLane:
    """A thread pool whose waiting work is bounded: past `threads + max_waiting` pending
    jobs a request is refused at once (503) instead of queueing; None: unbounded (work for
    requests already accepted, such as building their response bodies)."""

    def __init__(self, name: str, threads: int, max_waiting: int | None) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)
        self.limit = None if max_waiting is None else threads + max_waiting
        self.pending = 0   # submitted and not finished (changed on the event loop only)

    async def run(self, fn: Callable[[], T], timeout: float, trim: bool) -> T:
        """fn() on the pool. Raises APIError 503 when the lane is full or fn takes longer
        than `timeout` (its thread then finishes unobserved); `trim`: give free memory
        back to the system once fn is done (a large request's buffers)."""
        if self.limit is not None and self.pending >= self.limit:
            raise APIError(503, f"the server is busy preparing {self.pending} heavy requests "
                                "(grammars, tools, large bodies); retry shortly",
                           code="server_busy", type_="service_unavailable_error")
        loop = asyncio.get_running_loop()
        self.pending += 1
        job = self.pool.submit(_then_trim, fn) if trim else self.pool.submit(fn)
        job.add_done_callback(lambda _: _call_soon(loop, self._finished))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"the request took longer than {timeout:.0f}s to prepare (chat "
                                "template, tokenization, grammar); it was dropped",
                           code="prepare_timeout", type_="service_unavailable_error") from None

    def _finished(self) -> None:
        self.pending -= 1

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):   # the loop closed at shutdown
        loop.call_soon_threadsafe(fn)


_trim_lock = threading.Lock()


def _then_trim(fn: Callable[[], T]) -> T:
    """fn(), then glibc's malloc_trim: a large request's freed buffers otherwise stay in the
    process for good (docs/BENCHMARKS.md, "Request bounds in the frontend")."""
    try:
        return fn()
    finally:
        if _trim_lock.acquire(blocking=False):   # one trim at a time is enough
            try:
                release_free_memory()
            finally:
                _trim_lock.release()


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_free_memory() -> None:
    """Return freed heap memory to the system (glibc only; elsewhere a no-op)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
