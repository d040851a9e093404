"""The CUDA backend (CuPy): the shared device backend (`kernels/device_backend.py`) launching
the kernels of `ops.cu`, compiled once by NVRTC through `cupy.RawModule`.

Build-only until a GPU machine runs `bench/gpu_check.sh`: CI compiles `ops.cu` with nvcc
(tests/kernels/test_cuda_sources.py); the parity tests run wherever CuPy sees a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_actors.kernels.device_backend import KERNEL_NAMES, DeviceBackend, kernel_source

THREADS = 128   # must match THREADS in ops.cu


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise RuntimeError("the CUDA backend needs CuPy: pip install 'vllm-actors[cuda12]' "
                           "(or [cuda13])") from None
    return cupy


def cuda_available() -> bool:
    """CuPy is installed and sees at least one GPU."""
    try:
        return _cupy().cuda.runtime.getDeviceCount() > 0
    except Exception:   # no CuPy, no driver, no device: all mean "not here"
        return False


class CudaBackend(DeviceBackend):
    """Implements `kernels.ops.Backend` on one CUDA device (the current one)."""

    name = "cuda"
    GROUPS = {"rms_norm": THREADS, "layer_norm": THREADS, "argmax_rows": THREADS,
              "paged_attention": 32, "paged_attention_kv": 32}

    def __init__(self, device: int = 0) -> None:
        cp = _cupy()
        self.cp = cp
        count = cp.cuda.runtime.getDeviceCount()
        if not 0 <= device < count:
            raise ValueError(f"CUDA device {device} does not exist; CuPy sees {count}")
        self.device = cp.cuda.Device(device)
        self.device.use()
        self.stream = cp.cuda.Stream(non_blocking=True)
        module = cp.RawModule(code=kernel_source("cu"), options=("--std=c++14",))
        self.kernels = {name: module.get_function(name) for name in KERNEL_NAMES}

    def _put(self, array: np.ndarray) -> Any:
        with self.stream:
            return self.cp.asarray(np.ascontiguousarray(array))

    _keep = _put   # CuPy's pool tracks device memory; free_memory asks the driver

    def _empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return self.cp.empty(shape, dtype)

    def _zeros(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return self.cp.zeros(shape, dtype)

    def _launch(self, name: str, items: tuple[int, ...], *args: Any) -> None:
        if any(n > 65535 for n in items[1:]):   # CUDA's limit on grid y and z
            raise ValueError(f"{name}: {items[1:]} rows exceed CUDA's 65535 grid limit; lower "
                             "--max-num-batched-tokens")
        group = self.GROUPS.get(name)
        if group is None:
            grid = (-(-items[0] // THREADS), *items[1:])
            block = (THREADS,)
        else:
            grid, block = items, (group,)
        self.kernels[name](grid, block, args, stream=self.stream)

    def to_host(self, x: Any) -> np.ndarray:
        out = self.cp.asnumpy(x, stream=self.stream)
        self.stream.synchronize()
        return out

    def free_memory(self) -> int:
        free, _total = self.cp.cuda.runtime.memGetInfo()
        return int(free) + int(self.cp.get_default_memory_pool().free_bytes())
