"""float32 x float32 products in llama.cpp's CPU order: the LoRA deltas of the compiled
backend (`_lora_delta`), exact under the quantized GGUF semantics (a GGUF adapter's A and B
are F32; `ggml_mul_mat` multiplies them with float32 inputs, vec_dot_type F32).

- A request with two rows or more in the step and a contraction that is a multiple of 16:
  llamafile's tinyBLAS (ggml tries it first; it leaves one-row products to ggml), one fused
  multiply-add chain of 16 lanes per output over the row, then `_mm512_reduce_add_ps`
  (lanes i + i+8, + i+4, + i+2, + i+1).
- Otherwise `ggml_vec_dot_f32`: four 16-lane accumulators over chunks of 64, folded
  (0+2, 1+3, then 0+1) and reduced the same way, then the leftover elements added one by
  one, `sum += x * y` with two roundings (not contracted: the contracted form parts from
  llama.cpp's tokens on the SmolLM2 adapter golden, this one gives them all).
The 16-lane orders are those of an AVX-512 build (`ggml_math.ggml_width`), as the other
`ggml_*` kernels assume; tests/integration/test_lora_engine.py checks them on llama.cpp's
tokens.
"""

from __future__ import annotations

import types

import numba
import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.intrinsics import fma_f32

LANES = 16
OUT_BLOCK = 256     # outputs of B per task: a block of B (rank x 256 floats) stays in L1
SERIAL_MAX_WORK = 150_000    # multiply-adds below which one thread is faster (bench: 135k, 172k)


@numba.njit(inline="always", cache=True)
def _reduce16(acc):  # type: ignore[no-untyped-def]
    t0 = acc[8] + acc[0]
    t1 = acc[9] + acc[1]
    t2 = acc[10] + acc[2]
    t3 = acc[11] + acc[3]
    t4 = acc[12] + acc[4]
    t5 = acc[13] + acc[5]
    t6 = acc[14] + acc[6]
    t7 = acc[15] + acc[7]
    u0, u1, u2, u3 = t4 + t0, t5 + t1, t6 + t2, t7 + t3
    v0, v1 = u0 + u2, u1 + u3
    return v0 + v1


@numba.njit(inline="always", cache=True)
def _dots(x, xi, wt, w0, c0, k, n, alone, acc, out):  # type: ignore[no-untyped-def]
    """out[j] = x[xi:xi+k] . wt[w0:w0+k, c0 + j] for j < n (wt: the weights transposed, so
    each step runs along the outputs), in ggml's order: tinyBLAS (k a multiple of 16, a
    request of several rows) or ggml_vec_dot_f32. acc: [64, >= n] scratch. Rows are sliced
    before the loops over j: indexing with a run-time offset keeps LLVM from vectorizing
    them (3x slower, measured)."""
    if k % LANES == 0 and not alone:
        for lane in range(LANES):
            acc_row = acc[lane]
            for j in range(n):
                acc_row[j] = np.float32(0.0)
        for start in range(0, k, LANES):
            for lane in range(LANES):
                xv = x[xi + start + lane]
                w_row = wt[w0 + start + lane, c0:c0 + n]
                acc_row = acc[lane]
                for j in range(n):
                    acc_row[j] = fma_f32(xv, w_row[j], acc_row[j])
        _reduce_lanes(acc, n, out)
        return
    whole = k - k % 64
    if whole == 0:      # ggml's accumulators reduce to 0: only the element-by-element sum
        for j in range(n):
            out[j] = np.float32(0.0)
    else:
        for a in range(4 * LANES):
            acc_row = acc[a]
            for j in range(n):
                acc_row[j] = np.float32(0.0)
        for start in range(0, whole, 64):
            for a in range(4 * LANES):
                xv = x[xi + start + a]
                w_row = wt[w0 + start + a, c0:c0 + n]
                acc_row = acc[a]
                for j in range(n):
                    acc_row[j] = fma_f32(xv, w_row[j], acc_row[j])
        for lane in range(LANES):
            a0, a1, a2, a3 = acc[lane], acc[LANES + lane], acc[2 * LANES + lane], \
                acc[3 * LANES + lane]
            for j in range(n):
                a0[j] = (a0[j] + a2[j]) + (a1[j] + a3[j])
        _reduce_lanes(acc, n, out)
    for i in range(whole, k):
        xv = x[xi + i]
        w_row = wt[w0 + i, c0:c0 + n]
        for j in range(n):
            out[j] = out[j] + xv * w_row[j]


@numba.njit(inline="always", cache=True)
def _reduce_lanes(acc, n, out):  # type: ignore[no-untyped-def]
    """out[j] = `_mm512_reduce_add_ps` of acc[0:16, j]: lanes i + i+8, + i+4, + i+2, + i+1."""
    for j in range(n):
        t0 = acc[8, j] + acc[0, j]
        t1 = acc[9, j] + acc[1, j]
        t2 = acc[10, j] + acc[2, j]
        t3 = acc[11, j] + acc[3, j]
        t4 = acc[12, j] + acc[4, j]
        t5 = acc[13, j] + acc[5, j]
        t6 = acc[14, j] + acc[6, j]
        t7 = acc[15, j] + acc[7, j]
        u0, u1, u2, u3 = t4 + t0, t5 + t1, t6 + t2, t7 + t3
        out[j] = (u0 + u2) + (u1 + u3)


def _lora_delta(y, x, rows, a_t, tiles, parts, scales, alone):  # type: ignore[no-untyped-def]
    """y[t, col:col+n] += scale * (B . (A[r0:r0+r] . x[t])) for each row t in `rows` and each
    part (r0, r, col, n, tile0) of `parts` [P, 5], in the layout of `pack`: A transposed
    (a_t [K, sum of ranks]) and each part's B in tiles of OUT_BLOCK outputs from tiles[tile0]
    on. Both products run along their outputs in ggml's order for a row whose request has
    `alone[t]` one row in the step (see the module); the scaled product rounded, then added,
    as `ggml_add(res, ggml_scale(...))`. The B products run in tasks of one tile over every
    row, so a tile is read from memory once per step, as one contiguous run."""
    k, num_ranks = a_t.shape
    xa = np.empty((rows.shape[0], num_ranks), np.float32)
    for ii in prange(rows.shape[0]):
        acc = np.empty((4 * LANES, num_ranks), np.float32)
        _dots(x[rows[ii]], 0, a_t, 0, 0, k, num_ranks, alone[rows[ii]], acc, xa[ii])
    starts = np.zeros(parts.shape[0] + 1, np.int64)
    for p in range(parts.shape[0]):
        starts[p + 1] = starts[p] + (parts[p, 3] + OUT_BLOCK - 1) // OUT_BLOCK
    for task in prange(starts[-1]):
        p = np.searchsorted(starts, task, side="right") - 1
        r0, r, col, n, tile0 = parts[p, 0], parts[p, 1], parts[p, 2], parts[p, 3], parts[p, 4]
        j0 = (task - starts[p]) * OUT_BLOCK
        m = min(OUT_BLOCK, n - j0)
        wt = tiles[tile0 + task - starts[p]]
        acc = np.empty((4 * LANES, OUT_BLOCK), np.float32)
        delta = np.empty(OUT_BLOCK, np.float32)
        for ii in range(rows.shape[0]):
            t = rows[ii]
            _dots(xa[ii], r0, wt, 0, 0, r, m, alone[t], acc, delta)
            for j in range(m):
                y[t, col + j0 + j] += delta[j] * scales[p]


def pack(a: np.ndarray, b_t: np.ndarray, meta: np.ndarray
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layout `_lora_delta` streams: A [sum of ranks, K] transposed, and each part's B
    (b_t [largest rank, sum of n], part p's at columns meta[p, 4]:) cut into zero-padded
    tiles [largest rank, OUT_BLOCK]; meta's last column becomes each part's first tile.
    Both products then read one contiguous run each (as columns of b_t, a tile was 16 runs of
    1 KB, which the hardware prefetchers followed poorly: 1.8-2.3 -> 1.6-1.9 ms a SmolLM2
    token at rank 16, docs/BENCHMARKS.md)."""
    tiles, out = [], meta.copy()
    for p, (_, _, _, n, b0) in enumerate(meta.tolist()):
        out[p, 4] = len(tiles)
        for j0 in range(0, n, OUT_BLOCK):
            tile = np.zeros((b_t.shape[0], OUT_BLOCK), np.float32)
            m = min(OUT_BLOCK, n - j0)
            tile[:, :m] = b_t[:, b0 + j0:b0 + j0 + m]
            tiles.append(tile)
    return np.ascontiguousarray(a.T), np.stack(tiles), out


def _named(name: str) -> types.FunctionType:
    """`_lora_delta` under another name: numba's on-disk cache names an entry by the
    function, not by its compile options, so a serial and a parallel build of one function
    would load each other's code."""
    fn = types.FunctionType(_lora_delta.__code__, _lora_delta.__globals__, name)
    fn.__qualname__ = name
    return fn


lora_delta_parallel = numba.njit(parallel=True, cache=True)(_named("lora_delta_parallel"))
lora_delta_serial = numba.njit(cache=True)(_named("lora_delta_serial"))   # prange as range

