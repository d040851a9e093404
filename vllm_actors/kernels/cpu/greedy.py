"""Greedy ids over the host logits of a plain-greedy step (`CpuBackend.argmax`), in one
kernel: each row's argmax with ties to the lowest id (numpy's), or -1 for a row holding a
non-finite logit (the runner then fails that request, as its host path does).

The host path took three passes and a copy for this: `isfinite` over the whole matrix, the
finite rows copied out, then the sampler's argmax; with Gemma 3's 262,144-token vocabulary
that cost more than 6 ms of a 16-row step (docs/BENCHMARKS.md). Here each row is read
twice: one vectorized pass takes the largest magnitude (non-finite past the exponent's all
ones) and the largest order key, then chunks are scanned for the first key equal to it.

The order key of a float's bits b: b where b >= 0, else -(b & 0x7fffffff). It orders as the
floats do, and -0.0 and +0.0 share the key 0, as they compare equal.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel

LOW = np.int32(0x7FFFFFFF)
INF = np.int32(0x7F800000)     # magnitudes from here on are inf or NaN
CHUNK = 64                     # the search for the first maximum is vectorized by chunks
PARALLEL_ROWS = 2


@kernel(inline=True)
def _key(b):  # type: ignore[no-untyped-def]
    sign = b >> np.int32(31)
    return np.int32((sign ^ (b & LOW)) - sign)


@kernel(inline=True)
def _first(bits, top):  # type: ignore[no-untyped-def]
    """The first index whose key is `top`."""
    n = bits.shape[0]
    for c in range(0, n, CHUNK):
        end = min(n, c + CHUNK)
        hit = np.int32(0)
        for i in range(c, end):
            hit |= np.int32(_key(bits[i]) == top)
        if hit:
            for i in range(c, end):
                if _key(bits[i]) == top:
                    return i
    return -1


@kernel(inline=True)
def _row(bits):  # type: ignore[no-untyped-def]
    """argmax of one row of float32 bits (int32), -1 if a value is inf or NaN."""
    big = np.int32(0)
    top = -LOW
    for i in range(bits.shape[0]):
        b = bits[i]
        big = max(big, np.int32(b & LOW))
        top = max(top, _key(b))
    if big >= INF:
        return -1
    return _first(bits, top)


@kernel
def _serial(bits, out):  # type: ignore[no-untyped-def]
    for r in range(bits.shape[0]):
        out[r] = _row(bits[r])


@kernel(parallel=True)
def _parallel(bits, out):  # type: ignore[no-untyped-def]
    for r in prange(bits.shape[0]):
        out[r] = _row(bits[r])


def argmax(logits: np.ndarray) -> np.ndarray:
    """Greedy ids [rows] (int64) of float32 logits [rows, V]; -1 for a non-finite row."""
    if np.ndim(logits) != 2:
        raise ValueError(f"argmax takes logits [rows, vocab], got shape {np.shape(logits)}")
    bits = np.ascontiguousarray(logits, np.float32).view(np.int32)
    out = np.empty(len(bits), np.int64)
    (_parallel if len(bits) >= PARALLEL_ROWS else _serial)(bits, out)
    return out
