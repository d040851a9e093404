"""The CUDA program (every .cu file, joined as the backend joins them) compiles, so syntax and
types are checked without a GPU: with nvcc -ptx for sm_90 and sm_80 where nvcc exists, and
with NVRTC (what CuPy's RawModule uses) where the `nvidia-cuda-nvrtc-cu12` wheel is
installed. Numerical parity runs in test_device_ops.py where a GPU exists."""

import ctypes
import glob
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

import vllm_actors.kernels.cuda as cuda_pkg
from vllm_actors.kernels.device_backend import KERNEL_NAMES, SOURCE_FILES, kernel_source

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
