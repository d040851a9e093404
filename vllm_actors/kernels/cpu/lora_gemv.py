"""A LoRA delta inside its linear's GEMV: a single-row decode step's adapted linear in one
kernel call and one parallel loop (`gemv_lora` of `qmatmul_int` and `qmatmul_int_k`), the
same floats as the base GEMV followed by the separate delta call
(`ggml_matmul_f32._lora_delta` for a row alone).

Apart, a step's 120 deltas on SmolLM2 are 120 more calls, each on one thread. Inside the
GEMV, each chunk of its parallel loop (CHUNK_PAIRS pairs of weight rows)
- computes B's inputs xa = A x (`_a_rows`: ggml_vec_dot's order, rounded to float16 where
  the semantics asks) if its thread has not yet: every thread computes all of xa once, into
  its own row of scratch. Splitting A between the threads needs them to wait for each
  other, and on two cores of this machine one atomic shared between them cost more than
  A's products (docs/BENCHMARKS.md, "LoRA");
- computes its weight rows as `gemv` does;
- adds `scale * (B . xa)` to those rows' outputs (`_b_rows`).
The A and B pieces are C callbacks (`jit.Callback`, one per weight dtype).
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
from numba import carray, prange, types

from vllm_actors.kernels.cpu.intrinsics import call_address, data_pointer, stack_f32
from vllm_actors.kernels.cpu.jit import Callback, callback, kernel
from vllm_actors.kernels.cpu.qmatmul_prims import kept, limit_threads, restore_threads
from vllm_actors.kernels.ggml_matmul_f32 import (LANES, OUT_BLOCK, _round_half, _tile_dots,
                                                  _vec_dot_rows)

CHUNK_PAIRS = 16       # pairs of weight rows per chunk of `gemv_lora`'s loop (32 outputs)


def _a_rows(xr_p, a_p, a_size, k, num_ranks, xa_p, row, round_x):  # type: ignore[no-untyped-def]
    """xa[row, i] = xr . A[i] for every row i of A (ggml_vec_dot's order), rounded to
    float16 where `round_x` (B's input, as ggml converts it for F16 weights)."""
    xa = carray(xa_p, (row + 1, num_ranks))[row]
    _vec_dot_rows(carray(xr_p, (k,)), carray(a_p, (a_size,)), num_ranks, xa)
    if round_x:
        for i in range(num_ranks):
            xa[i] = _round_half(xa[i])


def _b_rows(xa_p, num_ranks, row, tiles_p, num_tiles, rmax, parts_p, num_parts, scales_p,
            y_p, n_out, j0, j1):  # type: ignore[no-untyped-def]
    """y[j] += scale * (xa[row, r0:r0+r] . B[:, j - col]) for the outputs j0..j1, in each
    part (r0, r, col, n, first tile) that holds some of them (`pack`'s layout)."""
    xa, y = carray(xa_p, (row + 1, num_ranks))[row], carray(y_p, (n_out,))
    tiles = carray(tiles_p, (num_tiles, OUT_BLOCK // LANES, rmax, LANES))
    parts, scales = carray(parts_p, (num_parts, 5)), carray(scales_p, (num_parts,))
    delta = stack_f32(256)
    for p in range(num_parts):
        r0, r, col, n = parts[p, 0], parts[p, 1], parts[p, 2], parts[p, 3]
        lo, hi = max(j0, col) - col, min(j1, col + n) - col
        if lo >= hi:
            continue
        first, last = lo // LANES, (hi - 1) // LANES
        while first <= last:      # the part's blocks, up to the end of their tile at a time
            t, jb = parts[p, 4] + first // (OUT_BLOCK // LANES), first % (OUT_BLOCK // LANES)
            count = min(last - first + 1, OUT_BLOCK // LANES - jb)
            _tile_dots(xa, r0, tiles[t], r, True, delta, jb, jb + count)
            for j in range(max(lo, first * LANES), min(hi, (first + count) * LANES)):
                y[col + j] += delta[j - (first - jb) * LANES] * scales[p]
            first += count


@functools.cache
def pieces(half: bool) -> tuple[Callback, Callback]:
    """The (A, B) callbacks for float32 weights or float16 bits."""
    f32, i64 = types.CPointer(types.float32), types.int64
    weights = types.CPointer(types.uint16 if half else types.float32)
    a_fn = callback(f32, weights, i64, i64, i64, f32, i64, types.boolean,
                    exact=True)(_a_rows)
    b_fn = callback(f32, i64, i64, weights, i64, i64, types.CPointer(types.int64), i64, f32,
                    f32, i64, i64, i64, exact=True)(_b_rows)
    return a_fn, b_fn


@kernel(inline=True, exact=True)
def lora_chunk(a_fn, xr, a, xa, ready, b_fn, tiles, parts, scales, out, j0, j1, round_x,
               base_fn, base_args):  # type: ignore[no-untyped-def]
    """One chunk of `gemv_lora`: xa on this thread once, the base rows j0..j1 (the callback
    `base_fn` on `base_args`), then their delta."""
    tid = numba.get_thread_id()
    if ready[tid] == 0:
        call_address(a_fn, (data_pointer(xr), data_pointer(a), a.size, xr.shape[0],
                            xa.shape[1], data_pointer(xa), tid, round_x))
        ready[tid] = 1
    call_address(base_fn, base_args)
    call_address(b_fn, (data_pointer(xa), xa.shape[1], tid, data_pointer(tiles),
                        tiles.shape[0], tiles.shape[2], data_pointer(parts), parts.shape[0],
                        data_pointer(scales), data_pointer(out), out.shape[1], j0, j1))


@kernel(inline=True, exact=True)
def lora_loop(fn, prefix, n, threads, x, a_fn, xr, a, xa, ready, b_fn, tiles, parts, scales,
              out, round_x):  # type: ignore[no-untyped-def]
    """`gemv_lora`'s loop over n weight rows in chunks of CHUNK_PAIRS pairs (`lora_chunk`),
    in parallel where inlined into a parallel kernel: the base body at `fn` takes `prefix`
    and the chunk's first and end pairs. First xr = x's one row, rounded to float16 where
    `round_x` (ggml's input for F16 weights), and no thread's xa computed yet."""
    for d in range(xr.shape[0]):
        xr[d] = _round_half(x[0, d]) if round_x else x[0, d]
    for t in range(ready.shape[0]):
        ready[t] = 0
    prev = limit_threads(threads)
    pairs = (n + 1) // 2
    for c in prange((pairs + CHUNK_PAIRS - 1) // CHUNK_PAIRS):
        g0, g1 = c * CHUNK_PAIRS, min(pairs, (c + 1) * CHUNK_PAIRS)
        lora_chunk(a_fn, xr, a, xa, ready, b_fn, tiles, parts, scales, out, 2 * g0,
                   min(n, 2 * g1), round_x, fn, prefix + (g0, g1))
    restore_threads(prev)


def lora_args(lora: Any, k: int, round_x: bool) -> tuple[Any, ...]:
    """`gemv_lora`'s LoRA arguments for `lora` (a `models.lora.LinearLoRA` in `pack`'s
    layout) on an input of K = k: (A's callback, A, this thread's scratch (the rounded
    input, each kernel thread's xa, their flags), B's callback, B's tiles, parts, scales,
    round_x)."""
    fixed = lora.memo.get("gemv")
    if fixed is None:
        a_fn, b_fn = pieces(lora.a.dtype == np.uint16)
        fixed = lora.memo["gemv"] = (a_fn.address, b_fn.address,
                                     int(lora.meta[-1, 0] + lora.meta[-1, 1]))
    a_fn, b_fn, num_ranks = fixed
    xr, xa, ready = _scratch(k, num_ranks)
    return (a_fn, lora.a, xr, xa, ready, b_fn, lora.b_t, lora.meta, lora.scales, round_x)


def _scratch(k: int, num_ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This Python thread's scratch (`kept`) for inputs of K = k and A of num_ranks rows:
    the rounded input, and per kernel thread its xa and its flag."""
    threads = numba.config.NUMBA_NUM_THREADS
    return kept(("lora", k, num_ranks), lambda: (np.empty(k, np.float32),
                                                 np.empty((threads, num_ranks), np.float32),
                                                 np.zeros(threads, np.int64)))
