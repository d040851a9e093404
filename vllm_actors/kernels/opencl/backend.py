"""The OpenCL backend (PyOpenCL): the shared device backend (`kernels/device_backend.py`)
launching the kernels of `ops.cl`.

The program is built once per context and its kernel objects are fetched once; per-step
buffers come from a memory pool. On PoCL (OpenCL on the CPU) this runs in CI for correctness;
the kernels are simple one-output-per-work-item loops, not tuned for speed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_actors.kernels.device_backend import MAX_HEAD_DIM, DeviceBackend, kernel_source

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
    GROUPS = {"rms_norm": GROUP, "argmax_rows": GROUP}

    def __init__(self, platform: int = 0, device: int = 0) -> None:
        cl, cl_array = _cl()
        self.cl, self.cl_array = cl, cl_array
        platforms = cl.get_platforms()
        if not 0 <= platform < len(platforms):
            raise ValueError(f"OpenCL platform {platform} does not exist; found "
                             f"{[p.name for p in platforms]} (--opencl-platform)")
        devices = platforms[platform].get_devices()
        if not 0 <= device < len(devices):
            raise ValueError(f"OpenCL device {device} does not exist on platform "
                             f"{platforms[platform].name!r}; found {[d.name for d in devices]} "
                             "(--opencl-device)")
        self.device = devices[device]
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

    def _zeros(self, shape: tuple[int, ...]) -> Any:
        self._allocated += int(np.prod(shape)) * 4
        return self.cl_array.zeros(self.queue, shape, np.float32)

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
