"""Which OpenCL platform to run on: the first one whose device can build a program.

PoCL from the `pocl-binary-distribution` wheel (PoCL 3.0, LLVM 14) cannot build any program
on CPUs newer than its LLVM (AMD Zen 4/5: "unknown target CPU 'generic'"), while Debian's
PoCL 3.1 picks the CPU target at run time. Both can be installed at once: pyopencl's bundled
ICD loader reads /etc/OpenCL/vendors before its own PoCL. So unless the user names a
platform, every platform's device is probed in order with a tiny kernel (built, run, read
back), once per device per process, and the first that works is taken.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

FIX = ("Fix: install Debian's PoCL, which picks the CPU target at run time "
       "(`apt-get install pocl-opencl-icd`, as root); pyopencl's bundled ICD loader reads "
       "/etc/OpenCL/vendors, so it appears beside the wheel's PoCL with no setting "
       "(`clinfo -l` or `OCL_ICD_DEBUG=1` shows what the loader found).")

PROBE_SOURCE = ("__kernel void probe(__global float *x) "
                "{ size_t i = get_global_id(0); x[i] = 2.0f * x[i] + 1.0f; }")

# (platform label, its devices); a device is whatever the probe takes (a pyopencl.Device)
PlatformList = Sequence[tuple[str, Sequence[Any]]]
Probe = Callable[[Any], "str | None"]   # device -> None if it builds and runs the probe, else why


class OpenCLPlatformError(RuntimeError):
    """No OpenCL platform can build programs, or the platform the user named cannot."""


def select_platform(requested: int | None = None, device: int = 0) -> int:
    """The platform index to use: `requested` when given (checked), else the first platform
    whose device `device` builds and runs the probe kernel.

    Raises:
        ValueError: the requested platform, or the device on every platform, does not exist.
        OpenCLPlatformError: the requested platform cannot build, or none can, or there is
            no OpenCL platform at all (the message names the fix).
    """
    listed = list_platforms()
    index = choose_platform(listed, requested, device, probe_device)
    if requested is None:
        logger.info("OpenCL platform %d (%s): the first that builds programs", index,
                    listed[index][0])
    return index


def list_platforms() -> list[tuple[str, list[Any]]]:
    """Every platform's label and devices, in the ICD loader's (deterministic) order."""
    import pyopencl as cl
    try:
        platforms = cl.get_platforms()
    except cl.Error as e:   # the loader found no ICD at all (PLATFORM_NOT_FOUND_KHR)
        raise OpenCLPlatformError(f"no OpenCL platform: {_summary(str(e))}. {FIX}") from None
    listed = []
    for platform in platforms:
        try:
            devices = platform.get_devices()
        except cl.Error:   # DEVICE_NOT_FOUND: a platform without devices
            devices = []
        version = " ".join(platform.version.split()[2:4])
        listed.append((f"{platform.name} {version}".strip(), devices))
    return listed


def choose_platform(platforms: PlatformList, requested: int | None, device: int,
                    probe: Probe) -> int:
    """The selection rule on any platform list and probe (see `select_platform`)."""
    labels = [label for label, _ in platforms]
    if requested is not None:
        if not 0 <= requested < len(platforms):
            raise ValueError(f"OpenCL platform {requested} does not exist; found {labels} "
                             "(--opencl-platform)")
        label, devices = platforms[requested]
        if not 0 <= device < len(devices):
            raise ValueError(f"OpenCL device {device} does not exist on platform {label!r}; "
                             f"found {[_name(d) for d in devices]} (--opencl-device)")
        why = probe(devices[device])
        if why is not None:
            raise OpenCLPlatformError(
                f"OpenCL platform {requested} ({label}, --opencl-platform) cannot build "
                f"programs for device {device} ({_name(devices[device])}): {why}. Leave "
                f"--opencl-platform out to take the first platform that can. {FIX}")
        return requested
    failures = []
    for index, (label, devices) in enumerate(platforms):
        if 0 <= device < len(devices):
            why = probe(devices[device])
            if why is None:
                return index
            failures.append(f"platform {index} ({label}): {why}")
    if failures:
        raise OpenCLPlatformError(f"no OpenCL platform can build a program for device "
                                  f"{device}: {'; '.join(failures)}. {FIX}")
    found = [(label, [_name(d) for d in devices]) for label, devices in platforms]
    if any(devices for _, devices in platforms):
        raise ValueError(f"OpenCL device {device} does not exist on any platform; found "
                         f"{found} (--opencl-device)")
    raise OpenCLPlatformError(f"no OpenCL device (platforms found: {found}). {FIX}")


_probed: dict[int, str | None] = {}


def probe_device(device: Any) -> str | None:
    """None if `device` builds and runs the probe kernel, else the reason; once per process."""
    key = device.int_ptr
    if key not in _probed:
        _probed[key] = _run_probe(device)
    return _probed[key]


def _run_probe(device: Any) -> str | None:
    import pyopencl as cl
    host = np.arange(4, dtype=np.float32)
    out = np.empty_like(host)
    try:
        with warnings.catch_warnings():   # a non-empty build log is a warning in pyopencl
            warnings.simplefilter("ignore")
            context = cl.Context([device])
            queue = cl.CommandQueue(context)
            program = cl.Program(context, PROBE_SOURCE).build()
            flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
            buffer = cl.Buffer(context, flags, hostbuf=host)
            program.probe(queue, host.shape, None, buffer)
            cl.enqueue_copy(queue, out, buffer)
            queue.finish()
    except cl.Error as e:
        return _summary(str(e))
    if not np.array_equal(out, 2 * host + 1):
        return f"the probe kernel computed {out.tolist()} instead of {(2 * host + 1).tolist()}"
    return None


def _summary(message: str) -> str:
    """The lines of a build error that say what went wrong (clang's `error:` lines), else the
    first line; one line, at most 300 characters."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror\b", line, re.IGNORECASE)
              and "clBuildProgram failed" not in line]
    if not errors and lines:   # pyopencl repeats "call failed: CODE" joined by " - "
        errors = [" - ".join(dict.fromkeys(lines[0].split(" - ")))]
    text = " | ".join(errors) or "unknown error"
    return text if len(text) <= 300 else text[:297] + "..."


def _name(device: Any) -> str:
    return str(getattr(device, "name", device))
