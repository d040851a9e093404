"""Matmul over weights kept in their GGUF formats: `x @ W.T`, W dequantized in registers.

Layout (`qmatmul_layout`). A `QuantMatrix` keeps a weight `[N, K]` in its GGML type, split
into planes: each field of the blocks (quants, fifth/high bits, scales, mins) one `[N, ...]`
array, the same bytes moved; only Q3_K/Q4_K/Q5_K's 6-bit scales are widened to bytes. Memory
is 1.0x the GGUF bytes (Q3_K 1.036x, Q4_K 1.028x, Q5_K 1.023x). Planar against raw blocks,
measured on one core at M = 1 (min of runs): Q8_0 49152x576 6.07 vs 6.05 ms and 4096x4096
1.689 vs 1.687 ms (an early scalar-sum kernel: no difference); Q4_0 0.097 vs 0.125 ns/weight
at 3072x576, 0.119 vs 0.124 at 4096x4096, 0.098 vs 0.099 at 49152x576. Planar was never
slower and keeps the kernels to plain 8-byte loads of one field, so every type is planar (raw
K-quant kernels were not written). Float16 scales stay float16 bits, read through `HALF_LUT`;
F16/BF16 weights stay 16-bit and are converted in registers (F16C / a shift).

Types without kernels (IQ*, TQ*, MXFP4, Q8_K, ...) are converted once by `pack`: tensors up
to `qmatmul_layout.CONVERT_F32_MAX` (2^20) weights are dequantized to F32 (no error), larger
ones requantized to Q8_0 with `gguf.quants.quantize` from gguf-py's dequantization: every
weight moves by less than max|w| / 226 over its block of 32 (half a Q8_0 step plus the float16
rounding of the scale), and they take 8.5 bits per weight, so such a tensor exceeds the 1.15x
memory bound (IQ4_NL, at 4.5 bits, takes 1.9x).

`gemv` (M <= `GEMV_MAX_ROWS[type]`): one numba kernel per type, prange over pairs of weight
rows, weights decoded in registers into 8-lane partial sums on the stack (`qmatmul_legacy`
explains the scheme), the rows ahead prefetched (short rows: Q8_0 49152x576 0.18 -> 0.08
ns/weight), offsets and mins through x's run sums. Below `SERIAL_MAX_WORK` it runs on the
calling thread. `matmul` beyond that M: tiles of 1 MB (M <= 64) or 4 MB of W dequantized to
float32 by the serial rows kernels and multiplied by BLAS, tiles split over the `TilePool`.
The crossover (`GEMV_MAX_ROWS`) was measured per type: the GEMV kernels decode W again for
every row of x, so types that are costly to decode cross early (Q5_x, Q3_K, Q5_K, Q6_K at 3;
Q2_K, Q4_K at 4; Q4_x, F16, BF16 at 6; Q8_0, F32 at 8).

Measured (bench/cpu_matmul.py --threads 1, medians of 9, two runs; a 2-core AMD EPYC VM
shared with other jobs, so runs differ by up to 2x; numpy is float32 `x @ W.T` on the
pre-dequantized weight, one BLAS thread), ours vs numpy in ms at M = 1: Q8_0 49152x576
2.8-3.0 vs 5.6-6.2, 4096x4096 1.3 vs 3.0-3.7, 28672x4096 9.2-11.0 vs 22-26; Q4_K 28672x4096
13.8-17.9 vs 22-26; Q4_0 49152x576 3.7-4.2 vs 5.6-6.2; F16 28672x4096 14.1-16.4 vs 22-26.
DRAM-bound shapes gain with the bytes saved. Where float32 W stays in cache (3072x576,
576x1536: 7 and 3.5 MB) numpy is faster (0.25-0.9x): decoding costs 0.06 (Q8_0) to 0.2
(Q6_K) ns per weight, more than BLAS reading cached floats. M = 512: mostly 0.9-1.1x;
M = 16 and 32: 0.45-1.0x (the dequantize pass, and BLAS repacking x per tile). With two
threads numba's OpenMP layer here took 7.9 ms medians for a 1.4 ms kernel (thread wake-ups;
the workqueue layer: 2.8 ms), so two-thread numbers from this machine are not meaningful.

Compiled code is cached per kernel file by numba, which checks only that file: after editing
`qmatmul_prims.py` clear `__pycache__/*.nbi, *.nbc` here, or kernels keep the old intrinsics.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from vllm_actors.kernels.cpu import qmatmul_layout as layout
from vllm_actors.kernels.cpu.qmatmul_float import (
    gemv_f32,
    gemv_half,
    rows_f32,
    rows_half,
)
from vllm_actors.kernels.cpu.qmatmul_k23 import (
    gemv_q2_k,
    gemv_q3_k,
    rows_q2_k,
    rows_q3_k,
)
from vllm_actors.kernels.cpu.qmatmul_k45 import (
    gemv_q4_k,
    gemv_q5_k,
    gemv_q6_k,
    rows_q6_k,
    rows_q45_k,
)
from vllm_actors.kernels.cpu.qmatmul_legacy import (
    gemv_q4,
    gemv_q5,
    gemv_q8_0,
    rows_q4,
    rows_q5,
    rows_q8_0,
)
from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT
from vllm_actors.kernels.cpu.threads import TilePool

T = GGMLQuantizationType


@dataclass(frozen=True)
class QuantMatrix:
    """A weight `[rows, cols]` kept in GGML type `qtype` as the planes of `qmatmul_layout`."""

    qtype: int
    rows: int
    cols: int
    planes: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)


_NO_U16 = np.zeros((0, 0), dtype=np.uint16)
_NO_U8 = np.zeros((0, 0), dtype=np.uint8)


def _kernel_args(w: QuantMatrix, rows: bool = False) -> tuple[Any, ...]:
    """The planes as the type's GEMV (or `rows`) kernel takes them (kernels shared by two
    types get placeholders)."""
    p = w.planes
    qt = w.qtype
    if qt == T.Q4_0:
        return p[0], p[1], _NO_U16
    if qt == T.Q5_0:
        return p[0], p[1], p[2], _NO_U16
    if qt == T.Q4_K and rows:
        return (_NO_U8,) + p
    if qt in (T.F16, T.BF16):
        return p[0], qt == T.BF16
    return p


# type -> (GEMV kernel, rows kernel)
_KERNELS: dict[int, tuple[Callable[..., None], Callable[..., None]]] = {
    T.F32: (gemv_f32, rows_f32), T.F16: (gemv_half, rows_half), T.BF16: (gemv_half, rows_half),
    T.Q4_0: (gemv_q4, rows_q4), T.Q4_1: (gemv_q4, rows_q4),
    T.Q5_0: (gemv_q5, rows_q5), T.Q5_1: (gemv_q5, rows_q5), T.Q8_0: (gemv_q8_0, rows_q8_0),
    T.Q2_K: (gemv_q2_k, rows_q2_k), T.Q3_K: (gemv_q3_k, rows_q3_k),
    T.Q4_K: (gemv_q4_k, rows_q45_k), T.Q5_K: (gemv_q5_k, rows_q45_k),
    T.Q6_K: (gemv_q6_k, rows_q6_k),
}

# Up to this many rows of x `matmul` runs the GEMV kernels; beyond, dequantized tiles + BLAS.
# Measured (3072x1536 and 4096x4096, one thread): the GEMV kernels decode the weights again
# for every row of x, so the cut falls where that costs more than the dequantize pass.
GEMV_MAX_ROWS: dict[int, int] = {
    T.F32: 8, T.F16: 6, T.BF16: 6, T.Q8_0: 8, T.Q4_0: 6, T.Q4_1: 6, T.Q5_0: 3, T.Q5_1: 3,
    T.Q2_K: 4, T.Q3_K: 3, T.Q4_K: 4, T.Q5_K: 3, T.Q6_K: 3}
# GEMVs over fewer weights x rows than this run on the calling thread: waking numba's
# threads costs more than they save (Q8_0 256x576: 17 us on one thread or two).
SERIAL_MAX_WORK = 1 << 18
# Bytes of float32 weight per dequantized tile. BLAS repacks x for every tile, so tiles are
# larger than L2 (measured, one thread, M = 16..512: 64 KB tiles 1.3-1.8x numpy's time,
# 1-4 MB 0.9-1.2x).
TILE_BYTES_SMALL_M = 1 << 20
TILE_BYTES_LARGE_M = 4 << 20
LARGE_M = 64
PREFETCH_BYTES = 16 << 10       # the GEMV kernels prefetch about this far ahead
# The rows kernels' inner trip count (weights per run), passed at run time: with a constant,
# LLVM unrolls those loops and, unable to rule out `out` aliasing the planes, leaves them
# scalar (Q8_0: 0.52 ns/weight); a runtime count gets them vectorized behind alias checks
# (0.13 ns/weight).
ROW_RUN = 32


def supports_fused(parts: Sequence[QuantMatrix]) -> bool:
    """Whether `concat` can stack these matrices (same type and columns)."""
    return len(parts) > 0 and all(p.qtype == parts[0].qtype and p.cols == parts[0].cols
                                  for p in parts)


def concat(parts: Sequence[QuantMatrix]) -> QuantMatrix:
    """Stack along rows (fused QKV, gate+up)."""
    if not supports_fused(parts):
        raise ValueError("concat needs matrices of one type and column count")
    if len(parts) == 1:
        return parts[0]
    planes = tuple(np.concatenate([p.planes[i] for p in parts], axis=0)
                   for i in range(len(parts[0].planes)))
    return QuantMatrix(parts[0].qtype, sum(p.rows for p in parts), parts[0].cols, planes)


def pack(data: np.ndarray, qtype: int, shape: tuple[int, int]) -> QuantMatrix:
    """Stored tensor data of `shape` (N, K) -> QuantMatrix, copied into RAM once. Types
    without kernels are converted (`qmatmul_layout.convert`: F32 when small, else Q8_0)."""
    rows, cols = int(shape[0]), int(shape[1])
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size != layout.nbytes_gguf(qtype, rows, cols):
        raise ValueError(f"{raw.size} bytes do not hold a {T(qtype).name} {shape} tensor")
    if qtype in layout.SUPPORTED:
        return QuantMatrix(int(qtype), rows, cols, layout.split(raw, qtype, rows, cols))
    new_type, planes = layout.convert(raw, qtype, rows, cols)
    return QuantMatrix(int(new_type), rows, cols, planes)


def _prefetch_rows(w: QuantMatrix) -> int:
    return max(4, min(32, PREFETCH_BYTES * w.rows // max(1, w.nbytes)))


def _check_f32(name: str, a: np.ndarray, shape: tuple[int, int]) -> None:
    if a.shape != shape or a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous float32 {shape}, got {a.dtype} "
                         f"{a.shape}{'' if a.flags.c_contiguous else ' (strided)'}")


def gemv(w: QuantMatrix, x: np.ndarray, out: np.ndarray) -> None:
    """out[M, N] = x[M, K] @ W.T for small M (both float32, C-contiguous); parallel over pairs
    of weight rows (numba's threads)."""
    _check_f32("x", x, (x.shape[0], w.cols))
    _check_f32("out", out, (x.shape[0], w.rows))
    threads = 1 if w.rows * w.cols * x.shape[0] <= SERIAL_MAX_WORK else 0
    _KERNELS[w.qtype][0](*_kernel_args(w), HALF_LUT, x, out, _prefetch_rows(w), threads)


@functools.lru_cache(maxsize=16)
def _row_ids(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)   # writable: one numba signature with take_rows'


def dequantize_rows(w: QuantMatrix, r0: int, r1: int, out: np.ndarray) -> None:
    """Rows [r0, r1) as float32 into out `[r1 - r0, K]` (serial, releases the GIL)."""
    if not 0 <= r0 <= r1 <= w.rows:
        raise ValueError(f"dequantize_rows [{r0}, {r1}) of {w.rows} rows")
    _check_f32("out", out, (r1 - r0, w.cols))
    ids = _row_ids(w.rows)[r0:r1]
    _KERNELS[w.qtype][1](*_kernel_args(w, rows=True), HALF_LUT, ids, out, ROW_RUN)


def take_rows(w: QuantMatrix, ids: np.ndarray, out: np.ndarray) -> None:
    """Rows `ids` (e.g. token ids) as float32 into out `[len(ids), K]`."""
    ids = np.array(ids, dtype=np.int64).reshape(-1)
    _check_f32("out", out, (ids.size, w.cols))
    if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
        raise IndexError(f"row ids out of range [0, {w.rows})")
    _KERNELS[w.qtype][1](*_kernel_args(w, rows=True), HALF_LUT, ids, out, ROW_RUN)


_scratch = threading.local()


def _scratch_buffer(name: str, size: int) -> np.ndarray:
    """This thread's float32 scratch `name` of at least `size` elements (kept between calls)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=np.float32)
        setattr(_scratch, name, buf)
    return buf


def _tile_rows(w: QuantMatrix, m: int, workers: int) -> int:
    per_worker = -(-w.rows // workers)
    if w.qtype == T.F32:            # nothing to dequantize: one BLAS call per worker
        return per_worker
    budget = TILE_BYTES_LARGE_M if m > LARGE_M else TILE_BYTES_SMALL_M
    rows = max(16, budget // (4 * w.cols)) // 8 * 8
    return max(1, min(rows, -(-per_worker // 8) * 8))


def matmul(w: QuantMatrix, x: np.ndarray, pool: TilePool | None = None) -> np.ndarray:
    """x float32 [M, K] -> float32 [M, N] = x @ W.T. Up to `GEMV_MAX_ROWS` rows: `gemv`.
    More: tiles of W dequantized to float32 and multiplied by BLAS (`np.matmul`), the tiles
    split over `pool`'s threads (on the caller's thread alone without a pool)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m = x.shape[0]
    out = np.empty((m, w.rows), dtype=np.float32)
    if m <= GEMV_MAX_ROWS[w.qtype] and not (m == 1 and w.qtype == T.F32):
        gemv(w, x, out)     # (F32 at M = 1: BLAS's GEMV streams 1.6-2x faster than ours)
        return out
    _check_f32("x", x, (m, w.cols))
    workers = pool.size if pool is not None else 1
    tile = _tile_rows(w, m, workers)
    tiles = -(-w.rows // tile)
    rows_kernel = _KERNELS[w.qtype][1]
    args = _kernel_args(w, rows=True)
    ids = _row_ids(w.rows)
    dense = w.planes[0] if w.qtype == T.F32 else None

    def run(lo: int, hi: int) -> None:
        buf = _scratch_buffer("tile", tile * w.cols) if dense is None else None
        res = _scratch_buffer("result", tile * m) if m <= LARGE_M else None
        for t in range(lo, hi):
            a, b = t * tile, min(w.rows, (t + 1) * tile)
            if dense is not None:
                weights = dense[a:b]
            else:
                weights = buf[:(b - a) * w.cols].reshape(b - a, w.cols)
                rows_kernel(*args, HALF_LUT, ids[a:b], weights, ROW_RUN)
            if m > LARGE_M:
                np.matmul(x, weights.T, out=out[:, a:b])
            else:   # BLAS writing strided columns of `out` measured 25 % slower at M = 16
                part = res[:m * (b - a)].reshape(m, b - a)
                np.matmul(x, weights.T, out=part)
                out[:, a:b] = part

    if pool is None:
        run(0, tiles)
    else:
        pool.run_split(run, tiles)
    return out
