"""The device backends under test: OpenCL (PoCL in CI) and CUDA (where CuPy sees a GPU)."""

import pytest


@pytest.fixture(scope="session", params=["opencl", "cuda"])
def dev(request):
    if request.param == "opencl":
        pyopencl = pytest.importorskip("pyopencl", reason="pip install 'vllm-actors[pocl]'")
        from vllm_actors.kernels.opencl.backend import OpenCLBackend
        try:
            return OpenCLBackend()
        except pyopencl.Error as e:   # no platform at all
            pytest.skip(f"no OpenCL device: {e}")
    from vllm_actors.kernels.cuda.backend import CudaBackend, cuda_available
    if not cuda_available():
        pytest.skip("no CUDA GPU visible to CuPy (the CUDA parity run is bench/gpu_check.sh)")
    return CudaBackend()
