"""The OpenCL backend (PyOpenCL): the shared device backend (`kernels/device_backend.py`)
launching the kernels of `ops.cl`.

The platform is the one named, else the first that can build programs (`platforms.py`). The
program is built once per context and its kernel objects are fetched once; per-step buffers
come from a memory pool. On PoCL (OpenCL on the CPU) this runs in CI for correctness;
the kernels are simple one-output-per-work-item loops, not tuned for speed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_actors.kernels.device_backend import MAX_HEAD_DIM, DeviceBackend, kernel_source
from vllm_actors.kernels.opencl.platforms import select_platform

GROUP = 64   # the work-group size ops.cl's cooperative kernels are written for


def _cl() -> tuple[Any, Any]:
    try:
        import pyopencl as cl
        import pyopencl.array as cl_array
        import pyopencl.tools  # noqa: F401  (MemoryPool)
    except ImportError:
        raise RuntimeError("the OpenCL backend needs pyopencl: pip install 'vllm-actors[opencl]' "
                           "(or [pocl] for OpenCL on the CPU)") from None
    return cl, cl_array


def list_devices() -> list[tuple[int, int, str]]:
    """(platform index, device index, 'platform: device') for every OpenCL device."""
    cl, _ = _cl()
    return [(p, d, f"{plat.name}: {dev.name}") for p, plat in enumerate(cl.get_platforms())
            for d, dev in enumerate(plat.get_devices())]


class OpenCLBackend(DeviceBackend):
    """Implements `kernels.ops.Backend` on one OpenCL device."""

    name = "opencl"
    GROUPS = {"rms_norm": GROUP, "layer_norm": GROUP, "argmax_rows": GROUP}

    def __init__(self, platform: int | None = None, device: int = 0) -> None:
        """platform None: the first platform whose device `device` can build programs
        (`platforms.select_platform`); an explicit one must exist and build."""
        cl, cl_array = _cl()
        self.cl, self.cl_array = cl, cl_array
        self.platform = select_platform(platform, device)
        self.device = cl.get_platforms()[self.platform].get_devices()[device]
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context)
        self.allocator = cl.tools.MemoryPool(cl.tools.ImmediateAllocator(self.queue))
        program = cl.Program(self.context, kernel_source("cl")).build(
            options=[f"-DMAX_HEAD_DIM={MAX_HEAD_DIM}"])
        self.kernels = {k.function_name: k for k in program.all_kernels()}
        self._allocated = 0

    def _put(self, array: np.ndarray) -> Any:
        return self.cl_array.to_device(self.queue, np.ascontiguousarray(array),
                                       allocator=self.allocator)

    def _keep(self, array: np.ndarray) -> Any:
        self._allocated += array.nbytes
        return self.cl_array.to_device(self.queue, np.ascontiguousarray(array))

    def _empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return self.cl_array.empty(self.queue, shape, dtype, allocator=self.allocator)

    def _zeros(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        self._allocated += int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.cl_array.zeros(self.queue, shape, dtype)

    def _launch(self, name: str, items: tuple[int, ...], *args: Any) -> None:
        kernel = self.kernels[name]
        kernel.set_args(*[a if isinstance(a, np.generic) else a.data for a in args])
        group = self.GROUPS.get(name)
        if group is None:
            self.cl.enqueue_nd_range_kernel(self.queue, kernel, items, None)
        else:
            self.cl.enqueue_nd_range_kernel(self.queue, kernel, (items[0] * group, *items[1:]),
                                            (group, *([1] * (len(items) - 1))))

    def to_host(self, x: Any) -> np.ndarray:
        return x.get(self.queue)

    def free_memory(self) -> int:
        return max(0, int(self.device.global_mem_size) - self._allocated)
