"""All-reduce among CUDA workers with NCCL through CuPy (`cupy.cuda.nccl`). Build-only: no
machine with several GPUs has run it yet (bench/gpu_check.sh runs it when one is lent).

Rank 0 makes the NCCL unique id and broadcasts it over the host communicator; each rank then
joins the clique on its own device (the launcher gave it one GPU through
CUDA_VISIBLE_DEVICES). Logits gathering and id broadcast stay on the host path: logits go to
the host for sampling anyway.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_actors.kernels.ops import Backend
from vllm_actors.workers.parallel_state import HostGroup, ShmCommunicator

NCCL_UNIQUE_ID_BYTES = 128


def nccl_module() -> Any:
    """`cupy.cuda.nccl`, or a RuntimeError saying what to install."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:   # CuPy missing, or built without NCCL
        raise RuntimeError("--tensor-parallel-size > 1 on --device cuda needs NCCL through "
                           "CuPy: pip install 'vllm-actors[cuda12]' nvidia-nccl-cu12 "
                           f"({e})") from None
    return nccl


def share_unique_id(comm: ShmCommunicator, make_id: Any) -> tuple[int, ...]:
    """Rank 0's NCCL unique id (a tuple of 128 signed bytes) on every rank."""
    ids = np.zeros(NCCL_UNIQUE_ID_BYTES, np.int64)
    if comm.rank == 0:
        ids[:] = np.asarray(make_id(), np.int64)
    ids = comm.broadcast_ids(ids if comm.rank == 0 else None, NCCL_UNIQUE_ID_BYTES)
    return tuple(int(v) for v in ids)


class NcclGroup(HostGroup):
    """HostGroup whose all-reduce runs on the devices (in place, on the backend's stream)."""

    def __init__(self, comm: ShmCommunicator, backend: Backend, nccl: Any = None) -> None:
        super().__init__(comm, backend)
        self.nccl = nccl or nccl_module()
        unique_id = share_unique_id(comm, self.nccl.get_unique_id)
        self.nccl_comm = self.nccl.NcclCommunicator(comm.world_size, unique_id, comm.rank)

    def all_reduce(self, x: Any) -> Any:
        stream = getattr(self.backend, "stream", None)
        self.nccl_comm.allReduce(x.data.ptr, x.data.ptr, x.size, self.nccl.NCCL_FLOAT32,
                                 self.nccl.NCCL_SUM, 0 if stream is None else stream.ptr)
        return x
