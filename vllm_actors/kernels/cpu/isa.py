"""Which integer-SIMD path the CPU backend's 8-bit dot products take, chosen at run time.

Paths, each a superset of the one before it:
- `portable`: plain LLVM vector IR (widen, multiply, add), correct on any CPU numba runs on;
- `avx2`: `vpmaddubsw` + `vpmaddwd`, as llama.cpp's AVX2 path;
- `avx512`: `vpdpbusd` (AVX-512 VNNI, 256-bit form), as llama.cpp with VNNI.

All three give the same int32 lanes, so the same float results bit for bit. The host's best
path is the default; `VLLM_ACTORS_CPU_ISA` forces a lower one (tests run every path the
machine can execute). numba keys its on-disk cache by CPU, and the path is a literal argument
of every kernel that uses it, so code of one path is never run for another.
"""

from __future__ import annotations

import functools
import os
import platform

import numba
from llvmlite import binding as llvm

PATHS = ("portable", "avx2", "avx512")
ENV = "VLLM_ACTORS_CPU_ISA"
_NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx2", "fma", "avx512vnni", "avx512vl",
                                              "avx512bw")}


def _features() -> set[str]:
    """LLVM feature names numba compiles for (its own CPU_FEATURES setting, else the host)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    text = numba.config.CPU_FEATURES
    if text is None:
        if numba.config.CPU_NAME not in (None, "host"):
            return set()          # a named target CPU without a feature list: assume none
        text = llvm.get_host_cpu_features().flatten()
    return {f[1:] for f in text.split(",") if f.startswith("+")}


@functools.cache
def host_features() -> frozenset[str]:
    """LLVM's names of the features kernels are compiled for (asking costs 0.35 ms: once)."""
    return frozenset(_features())


@functools.cache
def available() -> tuple[str, ...]:
    """The paths this machine can execute, lowest first."""
    have = host_features()
    return tuple(p for p in PATHS if all(f in have for f in _NEEDS.get(p, ())))


def selected() -> str:
    """The path kernels take: `VLLM_ACTORS_CPU_ISA` when set (it must be one this machine
    can execute), else the best available. Read at every call (tests force paths), and
    resolved once per value: each matmul asks."""
    return _resolve(os.environ.get(ENV, ""))


def selected_code() -> int:
    """`code(selected())`, as each matmul asks it."""
    return _resolved_code(os.environ.get(ENV, ""))


@functools.cache
def _resolved_code(setting: str) -> int:
    return code(_resolve(setting))


@functools.cache
def _resolve(setting: str) -> str:
    paths = available()
    forced = setting.strip().lower()
    if not forced:
        return paths[-1]
    if forced not in PATHS:
        raise ValueError(f"{ENV}={forced!r}: expected one of {', '.join(PATHS)}")
    if forced not in paths:
        raise ValueError(f"{ENV}={forced}: this CPU cannot execute it "
                         f"(it can: {', '.join(paths)})")
    return forced


def code(path: str) -> int:
    """The literal kernels take for `path`."""
    return PATHS.index(path)
