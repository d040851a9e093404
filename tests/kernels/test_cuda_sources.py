"""Every CUDA source compiles (syntax and types checked without a GPU): with nvcc -ptx for
sm_90 and sm_80 where nvcc exists, and with NVRTC (what CuPy's RawModule uses) where the
`nvidia-cuda-nvrtc-cu12` wheel is installed. Numerical parity runs in test_device_ops.py where
a GPU exists."""

import ctypes
import glob
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

import vllm_actors.kernels.cuda as cuda_pkg
from vllm_actors.kernels.device_backend import KERNEL_NAMES

SOURCES = sorted(Path(cuda_pkg.__file__).parent.glob("*.cu"))


def test_there_are_sources():
    assert [p.name for p in SOURCES] == ["ops.cu"]


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
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles(source, arch, compile_ptx, tmp_path):
    check_entries(compile_ptx(source, arch, tmp_path))
