"""Matmul over weights kept in their GGUF formats: `x @ W.T` with W dequantized in registers.

(Docstring completed with measurements below.)
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from gguf import GGMLQuantizationType

from vllm_actors.kernels.cpu import qmatmul_layout as layout
from vllm_actors.kernels.cpu.qmatmul_float import gemv_f32, gemv_half, rows_f32, rows_half
from vllm_actors.kernels.cpu.qmatmul_k23 import gemv_q2_k, gemv_q3_k, rows_q2_k, rows_q3_k
from vllm_actors.kernels.cpu.qmatmul_k45 import (
    gemv_q4_k, gemv_q5_k, gemv_q6_k, rows_q45_k, rows_q6_k)
from vllm_actors.kernels.cpu.qmatmul_legacy import (
    gemv_q4, gemv_q5, gemv_q8_0, rows_q4, rows_q5, rows_q8_0)
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
    budget = TILE_BYTES_LARGE_M if m > LARGE_M else TILE_BYTES_SMALL_M
    rows = max(16, budget // (4 * w.cols)) // 8 * 8
    per_worker = -(-w.rows // workers)
    return max(1, min(rows, -(-per_worker // 8) * 8))


def matmul(w: QuantMatrix, x: np.ndarray, pool: TilePool | None = None) -> np.ndarray:
    """x float32 [M, K] -> float32 [M, N] = x @ W.T. Up to `GEMV_MAX_ROWS` rows: `gemv`.
    More: tiles of W dequantized to float32 and multiplied by BLAS (`np.matmul`), the tiles
    split over `pool`'s threads (on the caller's thread alone without a pool)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m = x.shape[0]
    out = np.empty((m, w.rows), dtype=np.float32)
    if m <= GEMV_MAX_ROWS[w.qtype]:
        gemv(w, x, out)
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
        res = _scratch_buffer("result", tile * m)
        for t in range(lo, hi):
            a, b = t * tile, min(w.rows, (t + 1) * tile)
            if dense is not None:
                weights = dense[a:b]
            else:
                weights = buf[:(b - a) * w.cols].reshape(b - a, w.cols)
                rows_kernel(*args, HALF_LUT, ids[a:b], weights, ROW_RUN)
            # into a contiguous block, then copied: BLAS writing the strided columns of `out`
            # directly measured 25 % slower at M = 16
            part = res[:m * (b - a)].reshape(m, b - a)
            np.matmul(x, weights.T, out=part)
            out[:, a:b] = part

    if pool is None:
        run(0, tiles)
    else:
        pool.run_split(run, tiles)
    return out
