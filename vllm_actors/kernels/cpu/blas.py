"""float32 GEMM through the OpenBLAS that numpy ships with, called from our own kernel threads.

A float32 linear of many rows is faster in BLAS than in our GEMM (docs/BENCHMARKS.md,
"Embeddings"). Calling it from Python threads costs a third of that back: after each of our
parallel kernels the OpenMP workers spin for a few milliseconds, and BLAS's threads (or ours)
then share the cores with them. Here each OpenMP thread calls single-threaded `cblas_sgemm`
on its share of the rows inside a `prange`, so the threads that spin are the ones that work.

`cblas_sgemm` is found in numpy's BLAS library (threadpoolctl names its file) under the names
OpenBLAS builds use (`scipy_cblas_sgemm64_` for numpy's 64-bit-integer OpenBLAS); where none
is found, `available()` is False and the caller uses numpy.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numba
import numpy as np
from numba import prange

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
# (symbol, integer type): 64-bit-integer builds first, as numpy's wheels ship them
_SYMBOLS = (("scipy_cblas_sgemm64_", ctypes.c_int64), ("cblas_sgemm64_", ctypes.c_int64),
            ("scipy_cblas_sgemm", ctypes.c_int32), ("cblas_sgemm", ctypes.c_int32))


@functools.cache
def _sgemm() -> Any:
    """numpy's `cblas_sgemm` as a ctypes function (pointers passed as integers), or None.
    Its library is set to one thread (each of our threads calls it on its own share): a
    process may hold other OpenBLAS copies (scipy's), loaded after `threads.configure`
    limited the ones then loaded, with their own thread counts."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:   # pragma: no cover - threadpoolctl is a dependency
        return None
    libs = [lib for lib in ThreadpoolController().lib_controllers
            if lib.user_api == "blas" and lib.internal_api == "openblas"]
    libs.sort(key=lambda lib: "numpy" not in lib.filepath)   # numpy's own first
    for lib in libs:
        handle = ctypes.CDLL(lib.filepath)
        for symbol, integer in _SYMBOLS:
            fn = getattr(handle, symbol, None)
            if fn is None:
                continue
            lib.set_num_threads(1)
            fn.restype = None
            ptr = ctypes.c_uint64
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer, integer,
                           ctypes.c_float, ptr, integer, ptr, integer, ctypes.c_float, ptr,
                           integer]
            return fn
    return None


def available() -> bool:
    return _sgemm() is not None


@functools.cache
def _kernel() -> Any:
    """The prange kernel over row shares, compiled once per process (it holds the BLAS
    function's address, so it is not cached on disk)."""
    sgemm = _sgemm()

    @numba.njit(parallel=True, nogil=True)
    def shares(x, w, out, col, bounds):  # pragma: no cover - compiled
        k = x.shape[1]
        n = w.shape[0]
        ldc = out.shape[1]
        for i in prange(bounds.shape[0] - 1):
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS, hi - lo, n, k, np.float32(1.0),
                      x.ctypes.data + lo * k * 4, k, w.ctypes.data, k, np.float32(0.0),
                      out.ctypes.data + (lo * ldc + col) * 4, ldc)
    return shares


def linear(x: np.ndarray, weights: list[np.ndarray]) -> np.ndarray:
    """x float32 [M, K] times each float32 W [N_i, K] (transposed), side by side ->
    [M, sum N_i]; the rows split evenly over numba's threads. Needs `available()`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((len(x), sum(w.shape[0] for w in weights)), np.float32)
    bounds = np.linspace(0, len(x), numba.get_num_threads() + 1).astype(np.int64)
    col = 0
    for w in weights:
        _kernel()(x, np.ascontiguousarray(w, dtype=np.float32), out, col, bounds)
        col += w.shape[0]
    return out
