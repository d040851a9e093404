"""Multi-row GEMV for small M (speculative decoding's k+1 rows, small batches): each block of
32 weights is decoded ONCE into registers and multiplied into every row of x, where the
one-row GEMV kernels decode W again per row of x.

`mgemv(codec, planes, lut, x, out, dist, chunk, threads)`, one driver for every type whose
`qmatmul_codec.Codec` has `blocks`: x float32 `[M, K]` (copied to a 32-byte boundary when
it is not: `aligned`), out `[M, N]`, `dist` rows to prefetch ahead, `chunk` weight rows a
task (even; a prange over tasks), `threads` as in the GEMV kernels. Per task, group of x rows
(at most `GROUP_MAX`) and K slice (`slice_blocks`: the group's rows of x stay in L1), a pass
decodes R weight rows' block into `w` (`qmatmul_codec.decode_block`) and `vrows` adds it
times each of the G rows into one 8-lane accumulator per (x row, weight row), in registers.
G and R are literals, so `_span` picks one of nine inlined copies of `_pass`: R = 2 up to
G = 5, R = 1 beyond. `_span` is a kernel of its own (inlined into the prange body it compiled
three times slower), and the warm-up's helper compiles these first
(`CpuBackend.compile_matmuls`). The measurements behind G, R, the slices and the dispatch
(`qmatmul.MULTI_MAX_ROWS`) are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_codec import decode_block
from vllm_actors.kernels.cpu.qmatmul_prims import limit_threads, restore_threads, stack_f32
from vllm_actors.kernels.cpu.qmatmul_simd import vrows, vsum, vzero

GROUP_MAX = 9       # x rows per pass (a larger M runs in groups of at most this many)
X_SLICE_BYTES = 24 << 10    # a group's rows of x per K slice: kept within L1 (32 KB here)


@kernel
def group_rows(m):  # type: ignore[no-untyped-def]
    """Rows per group for M rows of x: the fewest groups of at most GROUP_MAX, evened out."""
    groups = max(1, (m + GROUP_MAX - 1) // GROUP_MAX)
    return max(1, (m + groups - 1) // groups)


@kernel
def slice_blocks(blocks, g):  # type: ignore[no-untyped-def]
    """32-column blocks per K slice for a group of g rows of x: the fewest slices whose rows
    of x fit X_SLICE_BYTES, evened out."""
    most = max(1, X_SLICE_BYTES // (128 * g))
    slices = max(1, (blocks + most - 1) // most)
    return max(1, (blocks + slices - 1) // slices)


@kernel
def aligned(x):  # type: ignore[no-untyped-def]
    """x, or when its data is not 32-byte aligned, a copy that is. numpy places small arrays
    at 16 mod 64 bytes; `vrows` reads x in 32-byte loads, and loads that straddle cache lines
    cost it 1.6x at 9 rows (Q4_1 1024x576, one thread: 0.27 against 0.17 ms)."""
    if x.ctypes.data % 32 == 0:
        return x
    m, k = x.shape
    buf = np.empty((m + 1, k), dtype=np.float32)    # rows of k floats: multiples of 32 bytes
    start = (32 - buf.ctypes.data % 32) % 32 // 4
    flat = buf.reshape(-1)
    for i in range(m):
        for j in range(k):
            flat[start + i * k + j] = x[i, j]
    return flat[start:start + m * k].reshape((m, k))


@kernel(inline=True)
def start(acc, g, r):  # type: ignore[no-untyped-def]
    for j in range(g * r):
        vzero(acc, 8 * j)


@kernel(inline=True)
def finish(acc, out, r0, m0, first, g, r):  # type: ignore[no-untyped-def]
    """out[m0 + j, r0 + k] = (after the first K slice: +=) the sum of accumulator (j, k);
    rows of W past the end skipped."""
    n = out.shape[1]
    for j in range(g):
        for k in range(r):
            if r0 + k < n:
                v = vsum(acc, 8 * (r * j + k))
                out[m0 + j, r0 + k] = v if first else out[m0 + j, r0 + k] + v


@kernel(inline=True)
def _pass(codec, planes, lut, x, out, dist, lo, hi, m0, b0, b1, g, r):  # type: ignore[no-untyped-def]
    """Weight rows [lo, hi), r at a time, against x's rows m0 .. m0 + g over blocks [b0, b1):
    each block decoded once (`qmatmul_codec.decode_block`) for all g rows."""
    n = out.shape[1]
    acc = stack_f32(80)
    w = stack_f32(64)
    for r0 in range(lo, hi, r):
        start(acc, g, r)
        for b in range(b0, b1):
            for k in range(r):
                row = min(r0 + k, n - 1)
                decode_block(codec, planes, lut, row, b, w, 32 * k, min(row + dist, n - 1))
            vrows(acc, w, x, m0 * x.shape[1] + 32 * b, g, r)
        finish(acc, out, r0, m0, b0 == 0, g, r)


@kernel
def _span(codec, planes, lut, x, out, dist, lo, hi, m0, mt, b0, b1):  # type: ignore[no-untyped-def]
    """`_pass` with mt rows of x, each (G, R) its own literal loop (see the module docstring)."""
    if mt == 1:
        _pass(codec, planes, lut, x, out, dist, lo, hi, m0, b0, b1, 1, 2)
    elif mt == 2:
        _pass(codec, planes, lut, x, out, dist, lo, hi, m0, b0, b1, 2, 2)
    elif mt == 3:
        _pass(codec, planes, lut, x, out, dist, lo, hi, m0, b0, b1, 3, 2)
    elif mt == 4:
        _pass(codec, planes, lut, x, out, dist, lo, hi, m0, b0, b1, 4, 2)
    elif mt == 5:
        _pass(codec, planes, lut, x, out, dist, lo, hi, m0, b0, b1, 5, 2)
    elif mt == 6:
        _pass(codec, planes, lut, x, out, dist, lo, hi, m0, b0, b1, 6, 1)
    elif mt == 7:
        _pass(codec, planes, lut, x, out, dist, lo, hi, m0, b0, b1, 7, 1)
    elif mt == 8:
        _pass(codec, planes, lut, x, out, dist, lo, hi, m0, b0, b1, 8, 1)
    else:
        _pass(codec, planes, lut, x, out, dist, lo, hi, m0, b0, b1, 9, 1)


@kernel(parallel=True)
def mgemv(codec, planes, lut, x, out, dist, chunk, threads):  # type: ignore[no-untyped-def]
    """out = x @ W.T for a codec with `blocks`, W's planes as its rows kernel takes them."""
    prev = limit_threads(threads)
    x = aligned(x)
    n = out.shape[1]
    nm = x.shape[0]
    blocks = x.shape[1] // 32
    per = group_rows(nm)
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(n, lo + chunk)
        for m0 in range(0, nm, per):
            mt = min(per, nm - m0)
            kb = slice_blocks(blocks, mt)
            for b0 in range(0, blocks, kb):
                _span(codec, planes, lut, x, out, dist, lo, hi, m0, mt, b0,
                      min(blocks, b0 + kb))
    restore_threads(prev)
