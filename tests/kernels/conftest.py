"""The device backends under test: OpenCL (PoCL in CI; the first platform that can build
programs) and CUDA (where CuPy sees a GPU)."""

import pytest
from opencl_platform import require_opencl


@pytest.fixture(scope="session", params=["opencl", "cuda"])
def dev(request):
    if request.param == "opencl":
        require_opencl()
        from vllm_actors.kernels.opencl.backend import OpenCLBackend
        return OpenCLBackend()
    from vllm_actors.kernels.cuda.backend import CudaBackend, cuda_available
    if not cuda_available():
        pytest.skip("no CUDA GPU visible to CuPy (the CUDA parity run is bench/gpu_check.sh)")
    return CudaBackend()
