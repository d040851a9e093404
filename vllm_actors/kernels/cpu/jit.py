"""How every kernel of the CPU backend is compiled: one decorator, so flags stay uniform.

- `cache=True`: compiled code is cached on disk, so only the first start compiles. numba
  writes next to the source (`__pycache__`) and falls back to a per-user directory when the
  package directory is read-only (or to `NUMBA_CACHE_DIR` when set).
- `nogil=True`: the backend's own worker threads call kernels concurrently.
- Fast math without `nnan`/`ninf`: reductions may be reassociated (so LLVM vectorizes them)
  and multiply-adds contracted, but -inf masks and inf checks keep their meaning.
- `error_model="numpy"`: no zero-division checks inside loops.
- `inline=True` (helpers only): inlined into the caller at numba's IR level. A plain helper
  call inside a kernel's hot loop is not inlined by LLVM (each njit function is its own
  library): the fused GEMM's per-block helper cost 35 % at M = 16 as a call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numba
from numba.core import types

FASTMATH = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})
# the same flags for the code of `numba.extending.overload`s
JIT_OPTIONS = {"fastmath": set(FASTMATH), "error_model": "numpy", "boundscheck": False}


def kernel(fn: Callable[..., Any] | None = None, *, parallel: bool = False,
           inline: bool = False, exact: bool = False) -> Any:
    """`@kernel`, `@kernel(parallel=True)` or `@kernel(inline=True)`: numba's njit with the
    backend's flags. `exact=True` drops fast math: float results then follow the source's
    order whatever LLVM decides, so every build of a kernel gives the same bits."""
    def wrap(f: Callable[..., Any]) -> Any:
        return numba.njit(cache=True, nogil=True, fastmath=set() if exact else set(FASTMATH),
                          parallel=parallel,
                          error_model="numpy", boundscheck=False,
                          inline="always" if inline else "never")(f)
    return wrap if fn is None else wrap(fn)


class Callback:
    """A kernel's loop body as a C callback of the signature `sig` (pointers and sizes),
    compiled with the kernels' flags on first use of `address` (and cached on disk); the
    kernel calls it with `intrinsics.call_address`.

    A parallel kernel that calls an njit function links that function's code into the
    library of its parallel loop and into its own, and numba optimizes and generates
    machine code for each library in full: a large body is compiled three times on a cold
    start. Called through a pointer the kernel receives as an argument, the body is
    compiled once and the kernel stays small (docs/BENCHMARKS.md, "Cold start")."""

    def __init__(self, fn: Callable[..., Any], sig: Any, exact: bool) -> None:
        self.fn, self.sig, self.exact = fn, sig, exact
        self.compiled: Any = None      # numba's CFunc: the code lives as long as it does

    @functools.cached_property
    def address(self) -> int:
        self.compiled = numba.cfunc(self.sig, cache=True, error_model="numpy",
                                    boundscheck=False,
                                    fastmath=set() if self.exact else set(FASTMATH))(self.fn)
        return int(self.compiled.address)


def callback(*arg_types: Any, exact: bool = False) -> Callable[[Callable[..., Any]], Callback]:
    """`@callback(types...)`: the function as a `Callback` returning nothing."""
    return lambda fn: Callback(fn, types.void(*arg_types), exact)
