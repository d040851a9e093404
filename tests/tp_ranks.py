"""Run tensor-parallel ranks as threads of the test process (tests only)."""

from __future__ import annotations

import threading

from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.workers.parallel_state import (
    HostGroup,
    ShmCommunicator,
    communicator_bytes,
)
from vllm_actors.workers.shm import SharedBuffer

# Partial sums of a row-parallel matmul are added in a different order than one full-width
# dot product: float32 rounding only, on logits of magnitude ~1-10.
TP_TOLERANCE = 2e-5
SLOT_BYTES = 1 << 16          # small, so the all-reduce and gather run in several chunks


def run_ranks(world_size: int, body):
    """body(group, backend) on `world_size` threads; returns rank 0's result."""
    buffer = SharedBuffer.create(communicator_bytes(world_size, SLOT_BYTES))
    results, errors = [None] * world_size, []

    def rank_main(rank):
        try:
            backend = NumpyBackend()
            comm = ShmCommunicator(buffer, rank, world_size, SLOT_BYTES)
            results[rank] = body(HostGroup(comm, backend), backend)
        except BaseException as e:   # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        buffer.unlink()
    if errors:
        raise errors[0]
    assert all(r is None for r in results[1:])
    return results[0]
