"""Shared memory between the engine core and its worker processes, without
`multiprocessing.shared_memory` (whose resource tracker would start one more process in every
subprocess-launched worker and unlink segments when any of them exits).

A segment is a file in /dev/shm mapped by every process. The creator unlinks the name as soon
as every worker has mapped it (after the readiness handshake), so a crash never leaves one
behind. `wait_for` is the one spin-then-sleep loop every shared-memory wait uses.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from typing import Callable

SHM_DIR = "/dev/shm"
CACHE_LINE = 64
_MAX_SLEEP_S = 0.001
_LIVENESS_EVERY_S = 0.25


# (spin checks, sched_yield seconds, first sleep seconds; sleeps double up to 1 ms). When the
# ranks outnumber the cores a spinning waiter only delays the peer it waits for (measured in
# docs/BENCHMARKS.md), so it sleeps almost at once.
_DEDICATED_CORES = (200, 0.002, 0.00005)
_OVERSUBSCRIBED = (20, 0.0, 0.00001)


class _WaitPolicy:
    spin, yield_s, sleep_s = _DEDICATED_CORES


_POLICY = _WaitPolicy()


def set_oversubscribed(oversubscribed: bool) -> None:
    """Choose the wait policy for this process (workers call it once at startup)."""
    _POLICY.spin, _POLICY.yield_s, _POLICY.sleep_s = \
        _OVERSUBSCRIBED if oversubscribed else _DEDICATED_CORES


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class PeerGoneError(RuntimeError):
    """A process this one was waiting on in shared memory is gone."""


class SharedBuffer:
    """A named, mapped shared-memory segment. `buf` is a writable memoryview."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)   # unmapped when the process exits
        finally:
            os.close(fd)
        self.name, self.size, self.owner = name, size, create
        self.buf = memoryview(self._mmap)

    @classmethod
    def create(cls, size: int, prefix: str = "va") -> "SharedBuffer":
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}", size, create=True)

    @classmethod
    def attach(cls, name: str, size: int) -> "SharedBuffer":
        return cls(name, size, create=False)

    def unlink(self) -> None:
        """Remove the name (mappings stay valid); safe to call twice."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


def parent_alive(parent_pid: int | None) -> Callable[[], bool]:
    """A liveness check for waits in a worker: its parent (the engine core) still exists."""
    if parent_pid is None:
        return lambda: True
    return lambda: os.getppid() == parent_pid


def wait_for(ready: Callable[[], bool], alive: Callable[[], bool] = lambda: True,
             what: str = "peer") -> None:
    """Return once `ready()` is true: spin, then yield the CPU, then sleep (up to 1 ms per
    check) so idle waiters cost little (see `_WaitPolicy`).

    Raises:
        PeerGoneError: `alive()` turned false while waiting.
    """
    for _ in range(_POLICY.spin):
        if ready():
            return
    start = last_check = time.monotonic()
    sleep = _POLICY.sleep_s
    while not ready():
        now = time.monotonic()
        if now - start < _POLICY.yield_s:
            os.sched_yield()
        else:
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP_S)
        if now - last_check > _LIVENESS_EVERY_S:
            last_check = now
            if not alive():
                raise PeerGoneError(f"gave up waiting for {what}: the other side is gone")
