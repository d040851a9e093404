"""The CUDA program (every .cu file, joined as the backend joins them) compiles, so syntax and
types are checked without a GPU: with nvcc -ptx for sm_90 and sm_80 where nvcc exists, and
with NVRTC (what CuPy's RawModule uses) where the `nvidia-cuda-nvrtc-cu12` wheel is
installed. Numerical parity runs in test_device_ops.py where a GPU exists; the quantized
matmuls of linear_quant.cu (plain C++ but for their qualifiers) also run on the host with g++
here, against numpy."""

import ctypes
import glob
import importlib.util
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import vllm_actors.kernels.cuda as cuda_pkg
from vllm_actors.kernels import quant
from vllm_actors.kernels.device_backend import (KERNEL_NAMES, QUANT_KERNELS, SOURCE_FILES,
                                                kernel_source, quant_defines)

SOURCES = sorted(p.name for p in Path(cuda_pkg.__file__).parent.glob("*.cu"))


def test_every_source_is_built():
    assert SOURCES == sorted(SOURCE_FILES["cu"])


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cuda") / "program.cu"
    path.write_text(kernel_source("cu"))
    return path


def check_entries(ptx: str) -> None:
    for name in KERNEL_NAMES:    # extern "C": unmangled entry points CuPy looks up by name
        assert f".entry {name}(" in ptx, name


def nvcc_ptx(source: Path, arch: str, tmp_path: Path) -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here")
    out = tmp_path / "out.ptx"
    done = subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-Werror", "all-warnings",
                           str(source), "-o", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return out.read_text()


def nvrtc_ptx(source: Path, arch: str, tmp_path: Path) -> str:
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    libs = [p for d in (spec.submodule_search_locations if spec else [])
            for p in glob.glob(f"{d}/lib/libnvrtc.so*")]
    if not libs:
        pytest.skip("the nvidia-cuda-nvrtc-cu12 wheel is not installed here")
    nvrtc = ctypes.CDLL(sorted(libs)[0])
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), b"ops.cu", 0,
                                    None, None) == 0
    options = [f"--gpu-architecture=compute_{arch[3:]}".encode(), b"--std=c++14"]
    rc = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode(errors="replace")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


@pytest.mark.parametrize("compile_ptx", [nvcc_ptx, nvrtc_ptx], ids=["nvcc", "nvrtc"])
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_program_compiles(program, arch, compile_ptx, tmp_path):
    check_entries(compile_ptx(program, arch, tmp_path))


# linear_quant.cu as host C++: the qualifiers defined away, one thread per call, and
# ops.cu's load_half (a PTX instruction there) in plain arithmetic.
HOST_PRELUDE = """
#include <math.h>
#include <stddef.h>
#define __global__
#define __device__
#define __forceinline__ inline
static struct { int x, y; } blockIdx, blockDim = {1, 1}, threadIdx;
static float load_half(const unsigned char *p) {
    const int h = p[0] | (p[1] << 8), e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? ldexpf((float)m, -24)
                  : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 1024), e - 25);
    return (h >> 15) ? -v : v;
}
"""
HOST_DRIVER = """
extern "C" void host_{0}(const float *x, const unsigned char *w, const float *bias, float *y,
                         int k, int n, int has_bias, int t) {{
    for (blockIdx.y = 0; blockIdx.y < t; ++blockIdx.y)
        for (blockIdx.x = 0; blockIdx.x < n; ++blockIdx.x) {0}(x, w, bias, y, k, n, has_bias);
}}
"""


def test_quant_kernels_run_on_the_host(tmp_path):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed here")
    source = tmp_path / "linear_quant_host.cpp"
    source.write_text(HOST_PRELUDE + quant_defines()
                      + (Path(cuda_pkg.__file__).parent / "linear_quant.cu").read_text()
                      + "".join(HOST_DRIVER.format(name) for name, _ in QUANT_KERNELS.values()))
    lib = tmp_path / "linear_quant_host.so"
    done = subprocess.run([gxx, "-O1", "-shared", "-fPIC", "-Wall", "-Werror", str(source),
                           "-o", str(lib)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    host = ctypes.CDLL(str(lib))
    rng = np.random.default_rng(7)
    rows, k, t = 24, 512, 3
    for qtype, (name, values) in QUANT_KERNELS.items():
        nbytes = quant.block_layout(qtype)[1]
        raw = rng.integers(0, 256, (rows * k // values, nbytes), dtype=np.uint8)
        for field, offset in quant.BLOCK_OFFSETS[qtype].items():
            if field in ("d", "m", "dmin"):     # the half floats: finite, of sane size
                halves = (rng.random(len(raw)) * 0.02 + 0.005).astype(np.float16)
                raw[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
        x = rng.standard_normal((t, k)).astype(np.float32)
        bias = rng.standard_normal(rows).astype(np.float32)
        y = np.empty((t, rows), np.float32)
        ptr = [a.ctypes.data_as(ctypes.c_void_p) for a in (x, raw, bias, y)]
        getattr(host, "host_" + name)(*ptr, k, rows, 1, t)
        want = x @ quant.dequantize(raw, qtype, (rows, k)).T + bias
        assert np.abs(y - want).max() <= 2e-5 * np.abs(want).max(), name
