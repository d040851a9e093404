"""Whether the OpenCL tests can run here: the backend's own platform choice (the first platform
that can build programs). Where none can, every OpenCL test skips with one reason naming the
fix, except in CI (`CI=true`, set by `.ci/run`), where they fail: CI must always run them."""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest


@functools.cache
def opencl_problem() -> str | None:
    """None if an OpenCL platform can build programs, else why not and how to fix it."""
    if importlib.util.find_spec("pyopencl") is None:
        return "pyopencl is not installed: pip install -e '.[test]' (or 'vllm-actors[pocl]')"
    from vllm_actors.kernels.opencl import platforms
    try:
        platforms.select_platform()
    except platforms.OpenCLPlatformError as e:
        return str(e)
    return None


def require_opencl() -> None:
    """Skip the calling test (fail it under CI=true) unless OpenCL can run here."""
    problem = opencl_problem()
    if problem is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"OpenCL must run in CI (CI=true) but cannot: {problem}", pytrace=False)
    pytest.skip(f"OpenCL cannot run here: {problem}")
