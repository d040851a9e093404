"""Compute backends behind one contract (`ops.Backend`); numpy is the reference, cpu the
compiled CPU path."""

from __future__ import annotations

from vllm_actors.kernels.ops import Backend

BACKENDS = ("cpu", "numpy", "opencl", "cuda")


def get_backend(name: str = "cpu", opencl_platform: int | None = None,
                opencl_device: int = 0) -> Backend:
    """The backend called `name`. OpenCL: `opencl_platform` None takes the first platform
    whose device `opencl_device` can build programs.

    Raises:
        ValueError: an unknown backend name, or an OpenCL platform/device that does not exist.
        RuntimeError: the backend's package (pyopencl) is not installed; OpenCLPlatformError
            (a RuntimeError): the named OpenCL platform, or every one, cannot build programs.
    """
    if name == "auto":
        from vllm_actors.kernels.cuda.backend import cuda_available
        name = "cuda" if cuda_available() else "cpu"
    if name == "cuda":
        from vllm_actors.kernels.cuda.backend import CudaBackend
        return CudaBackend()
    if name == "cpu":
        from vllm_actors.kernels.cpu.backend import CpuBackend
        return CpuBackend()
    if name == "numpy":
        from vllm_actors.kernels.numpy_backend import NumpyBackend
        return NumpyBackend()
    if name == "opencl":
        from vllm_actors.kernels.opencl.backend import OpenCLBackend
        return OpenCLBackend(opencl_platform, opencl_device)
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
