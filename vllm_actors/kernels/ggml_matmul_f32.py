"""float32 and float16 products in llama.cpp's CPU order: the LoRA deltas of the compiled
backend (`_lora_delta`), exact under the quantized GGUF semantics. A GGUF adapter's A and B
are F32 or F16. `ggml_mul_mat` multiplies F32 weights with float32 inputs. For F16 weights
it first rounds the input to float16 (vec_dot_type F16; for B, A's float32 output), then
goes the same two ways with float32 lanes, except that `ggml_vec_dot_f16` adds its leftovers
in float64. (llama-cpp-python 0.3.36's tinyBLAS multiplies F16 by F16; newer ggml releases
give it the float32 input unrounded. Rounding only in vec_dot parts from 0.3.36's tokens on
the F16 adapter golden at step 7, margin 0.125.)

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
from numba.core import types as nbtypes
from numba.extending import overload

from vllm_actors.kernels.cpu.attention_math import f32_to_half, half_to_f32, read_half
from vllm_actors.kernels.cpu.intrinsics import (HARDWARE_HALF, fma16, hardware_round_half,
                                                muladd16, muladd16_f64, reduce64, stack_f32,
                                                stack_f64)
from vllm_actors.kernels.ggml_attention import _tree16

LANES = 16
OUT_BLOCK = 256     # outputs of B per task: a tile (rank x 256 weights) stays in L1
GROUP_BLOCKS = 4    # blocks of 16 outputs whose leftover chains run side by side (64 lanes)
SERIAL_MAX_WORK = 150_000    # multiply-adds below which one thread is faster (bench: 135k, 172k)


def _weight(v):  # type: ignore[no-untyped-def]
    """A stored weight as float32: float32 as is, float16 bits (uint16) converted."""
    raise NotImplementedError("numba only")


@overload(_weight, inline="always")
def _weight_impl(v):  # type: ignore[no-untyped-def]
    if isinstance(v, nbtypes.Float):
        return lambda v: v
    return lambda v: read_half(v)


def _is_half(wt):  # type: ignore[no-untyped-def]
    """Whether `wt` holds float16 bits: a constant where compiled."""
    raise NotImplementedError("numba only")


@overload(_is_half, inline="always")
def _is_half_impl(wt):  # type: ignore[no-untyped-def]
    half = isinstance(wt.dtype, nbtypes.Integer)
    return lambda wt: half


@numba.njit(cache=True)
def _tile_dots(x, xi, tile, r, alone, out, jb0=0, jb1=OUT_BLOCK // LANES):  # type: ignore[no-untyped-def]
    """out[j] = x[xi:xi+r] . B[:r, j] for the outputs of blocks jb0..jb1 (16 each; all
    OUT_BLOCK by default) of one tile (`pack`'s layout: blocks of 16 outputs, each
    [largest rank, 16]; float32 or float16 bits), in
    ggml's order: tinyBLAS (r a multiple of 16, a request of several rows: 16 chains) or
    ggml_vec_dot (64 chains over chunks of 64, folded, then the leftovers one by one, in
    float32 for float32 weights and float64 for float16). Each block's chains are vectors
    across its 16 outputs, so a tile is read once, in order."""
    rows = tile.shape[1]
    tiny = r % LANES == 0 and not alone
    whole = r - r % 64
    for jb in range(jb0, jb1):
        base = jb * rows * LANES
        if tiny:
            acc = stack_f32(256)
            for lane in range(256):
                acc[lane] = np.float32(0.0)
            for s in range(0, r, LANES):
                for c in range(LANES):
                    fma16(acc, c * LANES, tile, base + (s + c) * LANES, x[xi + s + c], 0)
            _tree16(acc, LANES, out[jb * LANES:])
            continue
        if whole:
            chains = np.zeros(64 * LANES, np.float32)
            for s in range(0, whole, 64):
                for c in range(64):
                    fma16(chains, c * LANES, tile, base + (s + c) * LANES, x[xi + s + c], 0)
            for c in range(LANES * LANES):      # chain v*16 + l: (v0 + v2) + (v1 + v3)
                chains[c] = (chains[c] + chains[2 * 256 + c]) + (chains[256 + c]
                                                                 + chains[3 * 256 + c])
            _tree16(chains, LANES, out[jb * LANES:])
        else:
            for c in range(LANES):
                out[jb * LANES + c] = np.float32(0.0)
    if not tiny and whole < r:
        _leftover_blocks(x, xi, tile, whole, r, out, jb0, jb1)


@numba.njit(inline="always", cache=True)
def _leftover_blocks(x, xi, tile, whole, r, out, jb0, jb1):  # type: ignore[no-untyped-def]
    """out[j] += x[xi+i] * B[i, j] for i in whole..r one by one (ggml_vec_dot's leftovers)
    over blocks jb0..jb1: GROUP_BLOCKS blocks of 16 outputs at a time, since each output's
    sum is one dependent chain and the blocks' chains can run side by side, then the rest
    one by one."""
    jb = jb0
    while jb + GROUP_BLOCKS <= jb1:
        _leftover_group(x, xi, tile, whole, r, out, jb, GROUP_BLOCKS)
        jb += GROUP_BLOCKS
    while jb < jb1:
        _leftover_group(x, xi, tile, whole, r, out, jb, 1)
        jb += 1


@numba.njit(inline="always", cache=True)
def _leftover_group(x, xi, tile, whole, r, out, jb, count):  # type: ignore[no-untyped-def]
    """`_leftover_blocks` on blocks jb..jb+count (count <= GROUP_BLOCKS, a constant where
    inlined): float32 sums for float32 weights, float64 ones for float16."""
    rows = tile.shape[1]
    base = jb * rows * LANES
    if _is_half(tile):
        wide = stack_f64(64)
        for c in range(count * LANES):
            wide[c] = np.float64(out[jb * LANES + c])
        for i in range(whole, r):
            for g in range(count):
                muladd16_f64(wide, g * LANES, tile, base + (g * rows + i) * LANES, x[xi + i])
        for c in range(count * LANES):
            out[jb * LANES + c] = np.float32(wide[c])
    else:
        acc = stack_f32(64)
        for c in range(count * LANES):
            acc[c] = out[jb * LANES + c]
        for i in range(whole, r):
            for g in range(count):
                muladd16(acc, g * LANES, tile, base + (g * rows + i) * LANES, x[xi + i])
        for c in range(count * LANES):
            out[jb * LANES + c] = acc[c]


@numba.njit(inline="always", cache=True)
def _at(i, d, k):  # type: ignore[no-untyped-def]
    """Where `pack` puts A[i, d] (K = k): rows in pairs, each pair's chunks of 64 side by
    side (chunk c of the first row, then of the second), then the pair's leftovers."""
    whole = k - k % 64
    base = (i // 2) * 2 * k
    if d < whole:
        return base + (d // 64) * 128 + (i % 2) * 64 + d % 64
    return base + 2 * whole + (i % 2) * (k - whole) + (d - whole)


@numba.njit(inline="always", cache=True)
def _leftovers(x, a, i, whole, k, total):  # type: ignore[no-untyped-def]
    """`total` plus x[d] * A[i, d] for d in whole..k one by one: float32 sums for float32
    weights (`ggml_vec_dot_f32`), float64 ones for float16 (`ggml_vec_dot_f16`)."""
    start = _at(i, whole, k) - whole
    if _is_half(a):
        wide = np.float64(total)
        for d in range(whole, k):
            wide += np.float64(x[d] * _weight(a[start + d]))
        return np.float32(wide)
    for d in range(whole, k):
        total = total + x[d] * a[start + d]
    return total


@numba.njit(cache=True)
def _vec_dot_rows(x, a, num_rows, out):  # type: ignore[no-untyped-def]
    """out[i] = x . A[i] for the num_rows rows of A (`pack`'s layout) in ggml_vec_dot's
    order: four 16-lane chains over chunks of 64, folded and reduced (`reduce64`), then
    `_leftovers`. A pair of rows at a time, read as one run, their eight chains in
    registers."""
    k = x.shape[0]
    whole = k - k % 64
    for i0 in range(0, num_rows, 2):
        acc = stack_f32(128)
        for lane in range(128):
            acc[lane] = np.float32(0.0)
        for s in range(0, whole, 64):
            at = _at(i0, s, k)
            for c in range(8):
                fma16(acc, c * LANES, a, at + c * LANES, x, s + (c % 4) * LANES)
        zero = np.float32(0.0)
        out[i0] = _leftovers(x, a, i0, whole, k, reduce64(acc, 0) if whole else zero)
        if i0 + 1 < num_rows:
            out[i0 + 1] = _leftovers(x, a, i0 + 1, whole, k,
                                     reduce64(acc, 64) if whole else zero)


@numba.njit(inline="always", cache=True)
def _reduce16_at(acc, base):  # type: ignore[no-untyped-def]
    """`_mm512_reduce_add_ps` of acc[base:base+16] (`_tree16`'s tree, for one sum)."""
    t0 = acc[base + 8] + acc[base + 0]
    t1 = acc[base + 9] + acc[base + 1]
    t2 = acc[base + 10] + acc[base + 2]
    t3 = acc[base + 11] + acc[base + 3]
    t4 = acc[base + 12] + acc[base + 4]
    t5 = acc[base + 13] + acc[base + 5]
    t6 = acc[base + 14] + acc[base + 6]
    t7 = acc[base + 15] + acc[base + 7]
    u0, u1, u2, u3 = t4 + t0, t5 + t1, t6 + t2, t7 + t3
    return (u0 + u2) + (u1 + u3)


@numba.njit(cache=True)
def _tiny_rows(x, a, num_rows, out):  # type: ignore[no-untyped-def]
    """out[i] = x . A[i] for the num_rows rows of A (`pack`'s layout; K a multiple of 16)
    in tinyBLAS's order: one 16-lane chain per row, then `_mm512_reduce_add_ps`. Eight rows
    at a time (the last one repeated to fill a group), their chains in registers."""
    k = x.shape[0]
    last = num_rows - 1
    for i0 in range(0, num_rows, 8):
        acc = stack_f32(128)
        for lane in range(128):
            acc[lane] = np.float32(0.0)
        for s in range(0, k, LANES):
            for g in range(8):
                fma16(acc, g * LANES, a, _at(min(i0 + g, last), s, k), x, s)
        for g in range(8):
            if i0 + g < num_rows:
                out[i0 + g] = _reduce16_at(acc, g * LANES)


def _lora_delta(y, x, rows, a, tiles, parts, scales, alone, round_x):  # type: ignore[no-untyped-def]
    """y[t, col:col+n] += scale * (B . (A[r0:r0+r] . x[t])) for each row t in `rows` and each
    part (r0, r, col, n, tile0) of `parts` [P, 5] (parts in rank order), in `pack`'s layout
    (float32 or float16 bits): A's rows in pairs, each part's B in tiles of OUT_BLOCK
    outputs from tiles[tile0] on. Both products in ggml's order for a row whose request has
    `alone[t]` one row in the step (see the module), their inputs rounded to float16 first
    where `round_x`; the scaled product rounded, then added, as `ggml_add(res,
    ggml_scale(...))`. The B products run in tasks of one tile over every row, so a tile is
    read from memory once per step."""
    k = x.shape[1]
    num_ranks = parts[-1, 0] + parts[-1, 1]
    xr = _inputs(x, rows, round_x)
    xa = np.empty((rows.shape[0], num_ranks), np.float32)
    for ii in prange(rows.shape[0]):
        if alone[rows[ii]] or k % LANES:
            _vec_dot_rows(xr[ii], a, num_ranks, xa[ii])
        else:
            _tiny_rows(xr[ii], a, num_ranks, xa[ii])
    if round_x:             # B's input, A's float32 output, rounded as ggml converts it
        for ii in range(rows.shape[0]):
            for c in range(num_ranks):
                xa[ii, c] = _round_half(xa[ii, c])
    starts = np.zeros(parts.shape[0] + 1, np.int64)
    for p in range(parts.shape[0]):
        starts[p + 1] = starts[p] + (parts[p, 3] + OUT_BLOCK - 1) // OUT_BLOCK
    for task in prange(starts[-1]):
        p = np.searchsorted(starts, task, side="right") - 1
        r0, r, col, n, tile0 = parts[p, 0], parts[p, 1], parts[p, 2], parts[p, 3], parts[p, 4]
        j0 = (task - starts[p]) * OUT_BLOCK
        m = min(OUT_BLOCK, n - j0)
        tile = tiles[tile0 + task - starts[p]]
        delta = np.empty(OUT_BLOCK, np.float32)
        for ii in range(rows.shape[0]):
            t = rows[ii]
            _tile_dots(xa[ii], r0, tile, r, alone[t], delta)
            for j in range(m):
                y[t, col + j0 + j] += delta[j] * scales[p]


if HARDWARE_HALF:
    @numba.njit(inline="always", cache=True)
    def _round_half(v):  # type: ignore[no-untyped-def]
        """v rounded to the nearest float16 (ties to even), in hardware."""
        return hardware_round_half(v)
else:
    @numba.njit(inline="always", cache=True)
    def _round_half(v):  # type: ignore[no-untyped-def]
        """v rounded to the nearest float16 (ties to even), on the bits."""
        return half_to_f32(f32_to_half(v))


@numba.njit(cache=True)
def _inputs(x, rows, round_x):  # type: ignore[no-untyped-def]
    """x's `rows`, each value rounded to the nearest float16 (ties to even) where `round_x`,
    as ggml converts a matmul's float32 input for F16 weights."""
    out = np.empty((rows.shape[0], x.shape[1]), np.float32)
    for ii in range(rows.shape[0]):
        for d in range(x.shape[1]):
            out[ii, d] = _round_half(x[rows[ii], d]) if round_x else x[rows[ii], d]
    return out


def pack(a: np.ndarray, b_t: np.ndarray, meta: np.ndarray, half: bool = False
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layout `_lora_delta` reads in order: A [sum of ranks, K] flat with its rows in
    pairs (`_at`), and each part's B (b_t [largest rank, sum of n], part p's at columns
    meta[p, 4]:) cut into zero-padded tiles of OUT_BLOCK outputs, each stored as blocks of
    16 outputs [largest rank, 16] (`_tile_dots`); meta's last column becomes each part's
    first tile. `half` (every value a float16 one): both stored as float16 bits where the
    CPU converts them in hardware. All C-contiguous: the kernels index them flat."""
    tiles, out = [], meta.copy()
    for p, (_, _, _, n, b0) in enumerate(meta.tolist()):
        out[p, 4] = len(tiles)
        for j0 in range(0, n, OUT_BLOCK):
            tile = np.zeros((b_t.shape[0], OUT_BLOCK), np.float32)
            m = min(OUT_BLOCK, n - j0)
            tile[:, :m] = b_t[:, b0 + j0:b0 + j0 + m]
            tiles.append(tile.reshape(-1, OUT_BLOCK // LANES, LANES).transpose(1, 0, 2))
    a, tiles = _paired(np.asarray(a, np.float32)), np.ascontiguousarray(np.stack(tiles))
    if half and HARDWARE_HALF:
        a, tiles = (w.astype(np.float16).view(np.uint16) for w in (a, tiles))
    return a, tiles, out


def _paired(a: np.ndarray) -> np.ndarray:
    """A [R, K] flat in `_at`'s order (an odd R's last pair padded with a zero row)."""
    rows, k = a.shape
    whole = k - k % 64
    a = np.concatenate([a, np.zeros((rows % 2, k), np.float32)])
    pairs = a.reshape(-1, 2, k)
    chunks = pairs[:, :, :whole].reshape(len(pairs), 2, whole // 64, 64).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(np.concatenate(
        [chunks.reshape(len(pairs), -1), pairs[:, :, whole:].reshape(len(pairs), -1)],
        axis=1).reshape(-1))


def _named(name: str) -> types.FunctionType:
    """`_lora_delta` under another name: numba's on-disk cache names an entry by the
    function, not by its compile options, so a serial and a parallel build of one function
    would load each other's code."""
    fn = types.FunctionType(_lora_delta.__code__, _lora_delta.__globals__, name)
    fn.__qualname__ = name
    return fn


lora_delta_parallel = numba.njit(parallel=True, cache=True)(_named("lora_delta_parallel"))
lora_delta_serial = numba.njit(cache=True)(_named("lora_delta_serial"))   # prange as range

