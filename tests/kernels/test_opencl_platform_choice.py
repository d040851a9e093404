"""The OpenCL platform choice on this machine's real platforms (the wheel's PoCL, Debian's
PoCL where installed, any GPU driver): the first platform whose device builds and runs the
probe kernel, the same in a fresh process, and the one the backend runs on."""

import subprocess
import sys
from pathlib import Path

from opencl_platform import require_opencl

from vllm_actors.kernels.opencl import platforms


def test_auto_choice_is_the_first_platform_that_builds():
    require_opencl()
    listed = platforms.list_platforms()
    chosen = platforms.select_platform()
    for label, devices in listed[:chosen]:
        assert not devices or platforms.probe_device(devices[0]) is not None, label
    assert platforms.probe_device(listed[chosen][1][0]) is None


def test_choice_is_the_same_in_a_fresh_process_and_is_the_backends():
    require_opencl()
    from vllm_actors.kernels.opencl.backend import OpenCLBackend
    code = "from vllm_actors.kernels.opencl import platforms; print(platforms.select_platform())"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=120,
                           cwd=Path(__file__).parents[2])
    chosen = platforms.select_platform()
    assert int(fresh.stdout.split()[-1]) == chosen
    assert OpenCLBackend().platform == chosen
