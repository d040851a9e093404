"""Platform: everything that depends on the kind of device, in one object.

- which backend a rank builds, and on which device (OpenCL: rank r takes the r-th device
  after --opencl-device; CUDA: each worker process sees one GPU);
- a worker process's environment: its device's visibility (CUDA_VISIBLE_DEVICES) and its
  share of the CPU cores for BLAS threads;
- whether ranks share CPU cores (then they sleep in shared-memory waits instead of spinning);
- the collective group the ranks form: NCCL among CUDA workers, else shared memory through
  the host;
- the Python package a device needs and the extra that installs it (`config.DEVICE_EXTRAS`,
  which the configuration checks before anything starts).

Before this object, each of these was a name check of its own in the launcher, the worker, the
communicator and the configuration.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from vllm_actors.config import DEVICE_EXTRAS, DeviceConfig
from vllm_actors.errors import ValidationError
from vllm_actors.kernels import get_backend
from vllm_actors.kernels.ops import Backend
from vllm_actors.workers.parallel_state import HostGroup, ShmCommunicator
from vllm_actors.workers.shm import usable_cpus

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMBA_NUM_THREADS")


@dataclass(frozen=True)
class Platform:
    """Args:
        device: the device configuration (`--device`, OpenCL platform and device).
    """

    device: DeviceConfig

    @property
    def name(self) -> str:
        """The device kind asked for: cpu, numpy, opencl, cuda or auto (cuda when a GPU is
        visible at startup, else cpu)."""
        return self.device.backend

    @property
    def on_gpu(self) -> bool:
        """Whether ranks have devices of their own (CUDA; "auto" may become one)."""
        return self.name in ("cuda", "auto")

    def extras(self) -> tuple[str, str] | None:
        """(package, pip extra) the device needs, or None."""
        return DEVICE_EXTRAS.get(self.name)

    def check_installed(self) -> None:
        """Raises ValidationError naming the extra to install when the package is missing."""
        needs = self.extras()
        if needs and importlib.util.find_spec(needs[0]) is None:
            raise ValidationError(f"--device {self.name} needs {needs[0]}: pip install "
                                  f"'vllm-actors[{needs[1]}]'", "device")

    def rank_env(self, rank: int, world_size: int, env: dict[str, str] | None = None,
                 cpu_count: int | None = None) -> dict[str, str]:
        """The environment of worker `rank`: CPU ranks (numpy, cpu, OpenCL on PoCL) share
        the cores, max(1, cores // world_size) BLAS threads each unless the user set the
        variables; CUDA ranks see one GPU each, the rank-th of the parent's
        CUDA_VISIBLE_DEVICES (or GPU `rank`).

        Raises:
            ValidationError: --device cuda with fewer visible GPUs than ranks.
        """
        env = dict(os.environ if env is None else env)
        threads = str(max(1, (cpu_count or usable_cpus()) // world_size))
        for var in THREAD_VARS:
            env.setdefault(var, threads)
        if self.on_gpu:
            visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            if visible and len(visible) < world_size:
                if self.name == "cuda":
                    raise ValidationError(
                        f"--tensor-parallel-size {world_size} needs {world_size} GPUs; "
                        f"CUDA_VISIBLE_DEVICES lists {len(visible)}", "tensor_parallel_size")
                return env       # auto on a machine that will run on the CPU anyway
            env["CUDA_VISIBLE_DEVICES"] = visible[rank] if visible else str(rank)
        return env

    def _opencl_choice(self, rank: int) -> tuple[int | None, int]:
        """Every rank takes the same platform (the one named, else the first that can build
        programs) and rank r the r-th device after --opencl-device, wrapping around when the
        platform has fewer (PoCL has one CPU device: the ranks share it)."""
        device = self.device
        if self.name != "opencl" or rank == 0:
            return device.opencl_platform, device.opencl_device
        from vllm_actors.kernels.opencl.platforms import list_platforms, select_platform
        platform = select_platform(device.opencl_platform, device.opencl_device)
        count = len(list_platforms()[platform][1])
        return platform, (device.opencl_device + rank) % max(count, 1)

    def backend(self, rank: int = 0) -> Backend:
        """Rank `rank`'s backend on its device (a CUDA worker sees only its own GPU)."""
        return get_backend(self.name, *self._opencl_choice(rank))

    def shares_cores(self, backend: Backend, world_size: int) -> bool:
        """Whether `world_size` ranks on `backend` outnumber the CPU cores they run on."""
        return backend.name != "cuda" and world_size > usable_cpus()

    def group(self, comm: ShmCommunicator, backend: Backend) -> Any:
        """The ranks' `models.base.ParallelGroup`: NCCL all-reduce among CUDA workers
        (`workers/nccl.py`), else the shared-memory communicator through the host."""
        if backend.name == "cuda":
            from vllm_actors.workers.nccl import NcclGroup
            return NcclGroup(comm, backend)
        return HostGroup(comm, backend)
