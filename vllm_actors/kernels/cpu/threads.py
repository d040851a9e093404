"""The CPU backend's one thread budget: numba's kernel threads are sized to the CPUs this
process may really use, and BLAS (still called by a few host ops) runs single-threaded so the
two never fight over cores.

Usable CPUs = the affinity mask, capped by a cgroup CPU quota (`cpu.max` in cgroup v2,
`cpu.cfs_quota_us / cpu.cfs_period_us` in v1), divided among tensor-parallel ranks by the
caller. Idle threads block: numba's OpenMP threads after libgomp's default short spin
(GOMP_SPINCOUNT). Measured on 2 cores (docs/BENCHMARKS.md, "Shared cores"): a passive policy
(no spin) doubled decode time on an idle machine, because each of a step's ~150 kernels then
pays a thread wake-up; the short spin costs 1.6x against one thread when another process
keeps a core busy, and does not collapse.

`LoadFollower` then keeps the thread count at the CPUs other processes leave free (read from
/proc/stat after half a second of work, or a tenth when it may go back up): beside a busy
neighbour the kernels run on fewer threads instead of waiting at every parallel region for a
thread the OS has descheduled.
Every kernel splits its work into chunks that do not depend on the thread count, so this
changes no result.
"""

from __future__ import annotations

import math
import os
import time


def _cgroup_quota() -> float | None:
    """CPUs allowed by a cgroup quota, or None when unlimited or unknown."""
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", encoding="ascii") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us", encoding="ascii") as f:
            period_us = int(f.read())
        return quota_us / period_us if quota_us > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """CPUs this process may run on: affinity mask, capped by a cgroup quota (rounded up)."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:
        count = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


_STATE: dict[str, object] = {}


def configure(threads: int | None = None) -> int:
    """Size numba's threads to `threads` (default: the usable CPUs, capped by
    NUMBA_NUM_THREADS, which a tensor-parallel launcher sets to each rank's share) and make
    BLAS single-threaded; idempotent, returns the thread count."""
    import numba
    count = max(1, min(threads or usable_cpus(), numba.config.NUMBA_NUM_THREADS))
    if _STATE.get("threads") == count:
        return count
    numba.set_num_threads(count)
    if "blas_limit" not in _STATE:
        try:
            from threadpoolctl import threadpool_limits
            _STATE["blas_limit"] = threadpool_limits(1, user_api="blas")
        except ImportError:   # pragma: no cover - threadpoolctl is a dependency
            pass
    _STATE["threads"] = count
    return count


def _busy_jiffies(cpus: set[int]) -> tuple[int, int]:
    """(busy, total) jiffies of `cpus` so far, from /proc/stat's per-CPU lines."""
    busy = total = 0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            if not line.startswith("cpu") or line[3] == " ":
                continue
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                values = [int(v) for v in fields[:8]]
                total += sum(values)
                busy += sum(values) - values[3] - values[4]       # less idle and iowait
    return busy, total


def _own_jiffies() -> int:
    """CPU time of this process (all its threads), in jiffies (/proc/self/stat)."""
    with open("/proc/self/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])                    # utime + stime


class LoadFollower:
    """Sizes numba's threads (for the thread that calls `follow`) to `limit` less the CPUs
    other processes kept busy while this process worked, at least one.

    An interval counts only while this process works: a pause of more than GAP_S since our
    last marked work (`working`: each layer, and the end of the LM head) ends it, since the
    pause mostly holds what others did while we waited, which says nothing of whether they
    compete now; a new interval starts and the count stays. (Acting on such intervals, a
    SmolLM2 prefill sent right after one of llama.cpp's in a side-by-side bench ran on one
    thread, 3.0 s against 1.7 s; and with a 0.5 s pause rule, runs of 8 decode steps
    alternating with llama.cpp's fell to one thread for good, docs/BENCHMARKS.md.)
    INTERVAL_S of work can lower the count; RAISE_S of work with the CPUs free raises it
    again, so that short bursts of work recover once a neighbour has gone."""

    INTERVAL_S = 0.5
    RAISE_S = 0.1
    GAP_S = 0.1

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.current = limit
        self._working_at = time.monotonic()
        try:
            self.cpus = os.sched_getaffinity(0)
            self._last = self._probe = self._read(time.monotonic())
        except (AttributeError, OSError, ValueError):
            self._last = None                       # no /proc: keep the configured count

    def _read(self, now: float) -> tuple[float, int, int, int]:
        return (now, *_busy_jiffies(self.cpus), _own_jiffies())

    def working(self) -> None:
        """This process is computing a step (the backend calls it once a layer): cheap."""
        self._working_at = time.monotonic()

    def follow(self) -> int:
        """At a step's start; cheap unless an interval has passed. Returns the thread count
        now in use."""
        if self._last is None or self.limit <= 1:
            return self.current
        now = time.monotonic()
        paused = now - self._working_at > self.GAP_S
        self._working_at = now
        if paused:
            self._last = self._probe = self._read(now)
        elif now - self._last[0] >= self.INTERVAL_S:
            reading = self._read(now)
            self._set(self._wanted(self._last, reading))
            self._last = self._probe = reading
        elif self.current < self.limit and now - self._probe[0] >= self.RAISE_S:
            reading = self._read(now)
            self._set(max(self.current, self._wanted(self._probe, reading)))
            self._probe = reading
        return self.current

    def _wanted(self, before: tuple[float, int, int, int],
                after: tuple[float, int, int, int]) -> int:
        """The CPUs others left free between two readings, within 1 .. limit."""
        _, busy0, total0, own0 = before
        _, busy, total, own = after
        if total <= total0:
            return self.current
        others = max(0, (busy - busy0) - (own - own0)) * len(self.cpus) / (total - total0)
        return max(1, min(self.limit, round(len(self.cpus) - others)))

    def _set(self, wanted: int) -> None:
        if wanted != self.current:
            import numba
            numba.set_num_threads(wanted)
            self.current = wanted
