"""The tensor-parallel group of a worker: collectives among the ranks of one machine.

`ShmCommunicator` runs on host memory shared by all ranks: each collective writes this rank's
part into its slot, passes one barrier, then reads. The barrier is a generation counter per
rank (each written only by its owner, so no atomics are needed); every collective uses the
slots of its generation's parity, which makes one barrier per collective enough: a rank can
only write generation g + 2's slots after everyone arrived at g + 1, i.e. finished reading g.
All-reduce adds the slots in rank order, so every rank gets bit-identical sums.

`HostGroup` is what a model sees (`models.base.ParallelGroup`): all-reduce through the host
(numpy arrays stay in place; an OpenCL array is downloaded, reduced and uploaded again), logits
gathered to rank 0, sampled ids broadcast from rank 0. `workers/nccl.py` replaces only the
all-reduce on CUDA.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from vllm_actors.kernels.ops import Backend
from vllm_actors.workers.shm import CACHE_LINE, SharedBuffer, wait_for

DEFAULT_SLOT_BYTES = 8 << 20
_COUNTER_STRIDE = CACHE_LINE // 8    # int64 elements between two ranks' counters


def communicator_bytes(world_size: int, slot_bytes: int) -> int:
    """Size of the shared segment: one cache line per rank's counter, two slot sets."""
    return world_size * CACHE_LINE + 2 * world_size * slot_bytes


class ShmCommunicator:
    """Collectives over one shared segment (see the module docstring).

    Args:
        buffer: a segment of `communicator_bytes(world_size, slot_bytes)` bytes, zeroed.
        alive: checked while waiting; a dead peer raises `shm.PeerGoneError`.
    """

    def __init__(self, buffer: SharedBuffer, rank: int, world_size: int, slot_bytes: int,
                 alive: Callable[[], bool] = lambda: True) -> None:
        self.buffer, self.rank, self.world_size = buffer, rank, world_size
        self.slot_bytes, self.alive = slot_bytes, alive
        head = world_size * CACHE_LINE
        self.counters = np.frombuffer(buffer.buf, np.int64, head // 8)[::_COUNTER_STRIDE]
        self.slots = np.frombuffer(buffer.buf, np.uint8, 2 * world_size * slot_bytes,
                                   head).reshape(2, world_size, slot_bytes)
        self.generation = 0

    def _slot(self, rank: int, dtype: Any, count: int) -> np.ndarray:
        """Rank `rank`'s slot of the coming collective, as `count` items of `dtype`."""
        return self.slots[self.generation & 1, rank].view(dtype)[:count]

    def barrier(self) -> None:
        self.generation += 1
        generation = self.generation
        self.counters[self.rank] = generation
        counters = self.counters
        wait_for(lambda: counters.min() >= generation, self.alive, "a tensor-parallel peer")

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """float32 x of any shape -> the sum over ranks (a new array), in slot-sized chunks."""
        if self.world_size == 1:
            return x
        flat = np.ascontiguousarray(x, np.float32).reshape(-1)
        out = np.empty_like(flat)
        step = self.slot_bytes // 4
        for start in range(0, len(flat), step):
            part = flat[start:start + step]
            n = len(part)
            self._slot(self.rank, np.float32, n)[:] = part
            slots = [self._slot(r, np.float32, n) for r in range(self.world_size)]
            self.barrier()
            total = out[start:start + n]
            np.add(slots[0], slots[1], out=total)
            for other in slots[2:]:
                total += other
        return out.reshape(x.shape)

    def gather_columns(self, x: np.ndarray, widths: list[int]) -> np.ndarray | None:
        """x [R, widths[rank]] float32 from every rank -> [R, sum(widths)] on rank 0."""
        return self._gather(x, widths, self.rank == 0)

    def all_gather_columns(self, x: np.ndarray, widths: list[int]) -> np.ndarray:
        """x [R, widths[rank]] float32 from every rank -> [R, sum(widths)] on every rank."""
        out = self._gather(x, widths, True)
        assert out is not None
        return out

    def _gather(self, x: np.ndarray, widths: list[int], mine: bool) -> np.ndarray | None:
        """The ranks' columns in rank order, where `mine` (else None), in slot-sized runs of
        rows."""
        if self.world_size == 1:
            return x
        x = np.ascontiguousarray(x, np.float32)
        rows = len(x)
        out = np.empty((rows, sum(widths)), np.float32) if mine else None
        offsets = np.concatenate([[0], np.cumsum(widths)])
        step = max(1, self.slot_bytes // (4 * max(widths)))
        for start in range(0, max(rows, 1), step):
            part = x[start:start + step]
            n = len(part)
            self._slot(self.rank, np.float32, part.size)[:] = part.reshape(-1)
            slots = [self._slot(r, np.float32, n * widths[r]) for r in range(self.world_size)]
            self.barrier()
            if out is not None:
                for r, slot in enumerate(slots):
                    out[start:start + n, offsets[r]:offsets[r + 1]] = slot.reshape(n, widths[r])
        return out

    def broadcast_ids(self, ids: np.ndarray | None, count: int) -> np.ndarray:
        """int64 [count] from rank 0 -> every rank (a copy). count must fit one slot."""
        assert count * 8 <= self.slot_bytes
        if self.world_size == 1:
            return np.array(ids, np.int64)
        if self.rank == 0:
            self._slot(0, np.int64, count)[:] = ids
        slot = self._slot(0, np.int64, count)
        self.barrier()
        return slot.copy()


class HostGroup:
    """`models.base.ParallelGroup` over a ShmCommunicator; device arrays round-trip through
    the host (`backend.to_host` / `backend.from_host`), numpy arrays do not move."""

    def __init__(self, comm: ShmCommunicator, backend: Backend) -> None:
        self.comm, self.backend = comm, backend
        self.rank, self.world_size = comm.rank, comm.world_size

    def all_reduce(self, x: Any) -> Any:
        return self.backend.from_host(self.comm.all_reduce(self.backend.to_host(x)))

    def gather_columns(self, x: np.ndarray, widths: list[int]) -> np.ndarray | None:
        return self.comm.gather_columns(x, widths)

    def all_gather_columns(self, x: Any, widths: list[int]) -> Any:
        return self.backend.from_host(self.comm.all_gather_columns(self.backend.to_host(x),
                                                                   widths))

    def broadcast_ids(self, ids: np.ndarray | None, count: int) -> np.ndarray:
        return self.comm.broadcast_ids(ids, count)
