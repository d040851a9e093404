"""OpenCL platform choice on fake platform lists (no OpenCL needed): the first platform that
can build programs, an explicit choice checked, errors that name the fix; and the tests'
own rule (skip with the fix outside CI, fail under CI=true)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import msgspec
import opencl_platform
import pytest

from vllm_actors.config import EngineArgs, EngineConfig
from vllm_actors.kernels.opencl import platforms
from vllm_actors.kernels.opencl.platforms import OpenCLPlatformError, choose_platform

ZEN4_ERROR = "error: unknown target CPU 'generic'"


def fake(label: str, *device_names: str) -> tuple[str, list[SimpleNamespace]]:
    return label, [SimpleNamespace(name=n) for n in device_names]


WHEEL = fake("Portable Computing Language PoCL 3.0-rc2", "pthread-AMD Ryzen 9 7950X")
DEBIAN = fake("Portable Computing Language PoCL 3.1+debian", "pthread-znver4-AMD Ryzen 9")
GPU = fake("NVIDIA CUDA", "NVIDIA H100", "NVIDIA H100")


class Probe:
    """Fails for the devices named in `broken` (with `why`) and records what it probed."""

    def __init__(self, *broken: str, why: str = ZEN4_ERROR) -> None:
        self.broken, self.why, self.probed = set(broken), why, []

    def __call__(self, device: SimpleNamespace) -> str | None:
        self.probed.append(device.name)
        return self.why if device.name in self.broken else None


def test_first_platform_that_cannot_build_is_passed_over():
    probe = Probe("pthread-AMD Ryzen 9 7950X")
    assert choose_platform([WHEEL, DEBIAN, GPU], None, 0, probe) == 1
    assert probe.probed == ["pthread-AMD Ryzen 9 7950X", "pthread-znver4-AMD Ryzen 9"]


def test_first_platform_that_builds_is_taken_without_probing_the_rest():
    probe = Probe()
    assert choose_platform([WHEEL, DEBIAN], None, 0, probe) == 0
    assert probe.probed == ["pthread-AMD Ryzen 9 7950X"]


def test_platforms_without_the_device_are_passed_over():
    probe = Probe()
    assert choose_platform([WHEEL, GPU], None, 1, probe) == 1
    assert probe.probed == ["NVIDIA H100"]


def test_explicit_platform_is_used_and_only_it_is_probed():
    probe = Probe()
    assert choose_platform([WHEEL, DEBIAN], 1, 0, probe) == 1
    assert probe.probed == ["pthread-znver4-AMD Ryzen 9"]


def test_explicit_platform_that_cannot_build_is_an_error_naming_it_and_the_fix():
    probe = Probe("pthread-AMD Ryzen 9 7950X")
    with pytest.raises(OpenCLPlatformError) as e:
        choose_platform([WHEEL, DEBIAN], 0, 0, probe)
    message = str(e.value)
    assert message.startswith("OpenCL platform 0 (Portable Computing Language PoCL 3.0-rc2, "
                              "--opencl-platform) cannot build programs for device 0 "
                              "(pthread-AMD Ryzen 9 7950X): error: unknown target CPU 'generic'")
    assert "apt-get install pocl-opencl-icd" in message
    assert probe.probed == ["pthread-AMD Ryzen 9 7950X"]   # no fallback to platform 1


def test_no_platform_that_builds_is_an_error_listing_each_and_naming_the_fix():
    probe = Probe("pthread-AMD Ryzen 9 7950X", "pthread-znver4-AMD Ryzen 9")
    with pytest.raises(OpenCLPlatformError) as e:
        choose_platform([WHEEL, DEBIAN], None, 0, probe)
    message = str(e.value)
    assert message.startswith(
        "no OpenCL platform can build a program for device 0: platform 0 (Portable Computing "
        f"Language PoCL 3.0-rc2): {ZEN4_ERROR}; platform 1 (Portable Computing Language PoCL "
        f"3.1+debian): {ZEN4_ERROR}. Fix: install Debian's PoCL")
    assert "apt-get install pocl-opencl-icd" in message
    assert "/etc/OpenCL/vendors" in message


@pytest.mark.parametrize("listed", [[], [fake("PoCL"), fake("other")]])
def test_no_device_at_all_names_the_fix(listed):
    with pytest.raises(OpenCLPlatformError, match="no OpenCL device.*pocl-opencl-icd"):
        choose_platform(listed, None, 0, Probe())


@pytest.mark.parametrize("requested, device, match", [
    (2, 0, (r"OpenCL platform 2 does not exist; found \['Portable Computing Language PoCL "
            r"3.0-rc2', 'NVIDIA CUDA'\] \(--opencl-platform\)")),
    (1, 2, (r"OpenCL device 2 does not exist on platform 'NVIDIA CUDA'; found \['NVIDIA H100', "
            r"'NVIDIA H100'\] \(--opencl-device\)")),
    (None, 5, r"OpenCL device 5 does not exist on any platform"),
])
def test_missing_platform_or_device_is_a_value_error(requested, device, match):
    probe = Probe()
    with pytest.raises(ValueError, match=match):
        choose_platform([WHEEL, GPU], requested, device, probe)
    assert probe.probed == []


def test_probe_runs_once_per_device_per_process(monkeypatch):
    runs = []
    monkeypatch.setattr(platforms, "_probed", {})
    monkeypatch.setattr(platforms, "_run_probe", lambda d: runs.append(d.int_ptr) or "broken")
    first, second = SimpleNamespace(int_ptr=11), SimpleNamespace(int_ptr=12)
    assert [platforms.probe_device(d) for d in (first, second, first, second)] == ["broken"] * 4
    assert runs == [11, 12]


def test_build_log_summary_keeps_the_compiler_error_line():
    # the shape of pyopencl's message for a failed clBuildProgram on PoCL
    log = ("clBuildProgram failed: BUILD_PROGRAM_FAILURE - clBuildProgram failed: "
           "BUILD_PROGRAM_FAILURE\n\nBuild on <pyopencl.Device 'pthread-AMD Ryzen 9 7950X' on "
           "'Portable Computing Language' at 0x55b5>:\n\nerror: unknown target CPU 'generic'\n"
           "note: valid target CPU values are: nocona, core2, ...\n\n(options: -I /x/cl)")
    assert platforms._summary(log) == ZEN4_ERROR
    assert platforms._summary("clBuildProgram failed: INVALID_BUILD_OPTIONS - clBuildProgram "
                              "failed: INVALID_BUILD_OPTIONS\n\n(options: -I /x/cl)") == \
        "clBuildProgram failed: INVALID_BUILD_OPTIONS"
    assert len(platforms._summary("error: " + "x" * 1000)) == 300


def require_outcome() -> tuple[str, str]:
    """What `require_opencl` did to its caller, caught here so that a skip or a failure in the
    wrong place cannot turn this test itself into a skip."""
    try:
        opencl_platform.require_opencl()
    except pytest.fail.Exception as e:
        return "fail", str(e)
    except pytest.skip.Exception as e:
        return "skip", str(e)
    return "run", ""


@pytest.fixture
def no_opencl(monkeypatch):
    monkeypatch.setattr(opencl_platform, "opencl_problem", lambda: "no OpenCL platform. Fix: X")


def test_tests_skip_with_the_fix_outside_ci(no_opencl, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert require_outcome() == ("skip", "OpenCL cannot run here: no OpenCL platform. Fix: X")


def test_tests_fail_in_ci(no_opencl, monkeypatch):
    monkeypatch.setenv("CI", "true")
    message = "OpenCL must run in CI (CI=true) but cannot: no OpenCL platform. Fix: X"
    assert require_outcome() == ("fail", message)


def test_tests_run_when_a_platform_builds(monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(opencl_platform, "opencl_problem", lambda: None)
    assert require_outcome() == ("run", "")


def test_tests_use_the_backends_choice_and_report_its_error(monkeypatch):
    pytest.importorskip("pyopencl")

    def none_builds(requested=None, device=0):
        raise OpenCLPlatformError("no OpenCL platform can build a program. Fix: Y")

    monkeypatch.setattr(platforms, "select_platform", none_builds)
    assert opencl_platform.opencl_problem.__wrapped__() == \
        "no OpenCL platform can build a program. Fix: Y"
    monkeypatch.setattr(platforms, "select_platform", lambda requested=None, device=0: 1)
    assert opencl_platform.opencl_problem.__wrapped__() is None


@pytest.mark.parametrize("argv, expected", [([], None), (["--opencl-platform", "1"], 1)])
def test_flag_default_is_auto_and_a_named_platform_is_kept(argv, expected):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    config = EngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()
    assert config.device.opencl_platform == expected
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    assert wire.device.opencl_platform == expected
