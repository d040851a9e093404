"""Every CUDA source compiles (syntax and types checked without a GPU): nvcc -ptx for sm_90
and sm_80. The kernels' numerical parity runs in test_device_ops.py where a GPU exists."""

import shutil
import subprocess
from pathlib import Path

import pytest

import vllm_actors.kernels.cuda as cuda_pkg
from vllm_actors.kernels.device_backend import KERNEL_NAMES

SOURCES = sorted(Path(cuda_pkg.__file__).parent.glob("*.cu"))


def test_there_are_sources():
    assert [p.name for p in SOURCES] == ["ops.cu"]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles(source, arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here (CUDA sources are then checked by gpu_check.sh)")
    ptx = tmp_path / "out.ptx"
    done = subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-Werror", "all-warnings",
                           str(source), "-o", str(ptx)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    text = ptx.read_text()
    for name in KERNEL_NAMES:    # extern "C": unmangled entry points CuPy looks up by name
        assert f".entry {name}(" in text, name
