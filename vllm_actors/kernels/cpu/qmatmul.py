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

`gemv` (M <= `GEMV_MAX_ROWS[type]`; M = 1 for the types of `multi_gemv` below): one numba
kernel per type, prange over pairs of weight rows, weights decoded in registers into 8-lane
partial sums on the stack (`qmatmul_legacy` explains the scheme), the rows ahead prefetched
(short rows: Q8_0 49152x576 0.18 -> 0.08 ns/weight), offsets and mins through x's run sums.
Below `SERIAL_MAX_WORK` it runs on the calling thread. `matmul` beyond that M: the blocked GEMM
of `qmatmul_gemm` (x packed into 16-row panels, tiles of W dequantized to float32 by the rows
kernels, a register-blocked micro-kernel near the FMA peak). It replaced tiles of W handed to
single-threaded BLAS on a pool of Python threads: SmolLM2 at batch 16 went from 178.7 to 105.5
ms/step (linear 126.5 -> 69.0 ms, LM head 22.1 -> 16.0; bench/profile_step.py --batch 16
--context 128).
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
(Q6_K) ns per weight, more than BLAS reading cached floats. The GEMM against numpy's
two-thread BLAS (bench/cpu_matmul.py --types Q4_1,Q8_0 --shapes smol --m 16,32,512, two
threads): 0.39-0.61x at M = 16 on the cached shapes, 0.94-1.12x on the 49152x576 head;
0.59-0.86x at M = 512. Its micro-kernel alone runs at 85-90 % of the FMA peak; the rest is
the dequantize pass (Q4_1 0.25 ns/weight).

`multi_gemv` (2 <= M <= `MULTI_MAX_ROWS[type]`; Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q6_K): the
multi-row GEMV of `qmatmul_multi`, which decodes each block of W once for up to 9 rows of x
(speculative decoding verifies k drafts as k+1 rows). Against what `matmul` ran before (the
GEMV up to `GEMV_MAX_ROWS`, the fused GEMM beyond), two threads, ms, 20th percentiles of
interleaved runs (the one-row GEMV at M = 1 in brackets): Q4_1 3072x576 (0.15) M = 2 0.40 ->
0.21, 3 0.59 -> 0.27, 5 0.60 -> 0.23, 9 0.65 -> 0.43; 576x1536 (0.07) 0.14 -> 0.09, 0.15 ->
0.08, 0.29 -> 0.14, 0.35 -> 0.23; 960x576 (0.05) 0.13 -> 0.08, 0.19 -> 0.10, 0.31 -> 0.11,
0.27 -> 0.18; Q8_0 49152x576 (1.36-1.49) 2.41 -> 1.94, 3.53 -> 2.29, 4.98 -> 2.57, 8.60 ->
4.27. SmolLM2 step (forward and LM head over every row, context 200, medians of 7, old and
new interleaved, three runs; the host's load moves the ratios): M = 1 13.5-16.9 ms, M = 2
1.09-1.24x that (old 1.37-1.64x), 3 1.25-1.62x (old 1.91-2.39x), 5 1.48-1.78x (old
2.86-3.82x), 9 2.47-2.70x (old 3.12-3.99x); four runs of the new dispatch alone: 1.40-1.69x
at 5, 2.03-2.37x at 9. Gemma 3 270M (Q5_0, Q4_K, Q6_K, a 262144-row Q8_0 head), two runs:
M = 5 1.69-1.78x of M = 1 (old 3.2-3.5x), M = 9 2.55-2.86x (old 4.3-4.7x).
The crossover to the fused GEMM, per type: Q4_x 12 (multi 1.08-1.18x faster at 12, 1.02-1.20x
at 14), Q5_x 14 (1.09-1.23x at 14, 0.98-1.13x at 16), Q8_0 15 (1.11-1.29x at 15), Q4_K and
Q6_K 9 (1.16-1.32x at 9, 0.87-0.95x at 12); all below 16, the warm-up's step size for the
fused kernels. At M = 1 the one-row GEMVs stay: the multi-row kernel measured 0.68-0.81x of
them on Q8_0, Q4_K and Q6_K, 0.86-1.06x on Q4_1.

Compiled code is cached per kernel file by numba, which checks only that file: after editing
`qmatmul_prims.py` or `qmatmul_simd.py` clear `__pycache__/*.nbi, *.nbc` here, or kernels
keep the old intrinsics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from gguf import GGMLQuantizationType

from vllm_actors.kernels.cpu import qmatmul_fused as fused
from vllm_actors.kernels.cpu import qmatmul_gemm as gemm
from vllm_actors.kernels.cpu import qmatmul_layout as layout
from vllm_actors.kernels.cpu import qmatmul_multi as multi
from vllm_actors.kernels.cpu import qmatmul_multi_k as multi_k
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

# type -> the GEMM driver (takes the rows kernel's planes)
_GEMM: dict[int, Callable[..., None]] = {
    T.F32: gemm.gemm_f32, T.F16: gemm.gemm_half, T.BF16: gemm.gemm_half,
    T.Q4_0: gemm.gemm_q4, T.Q4_1: gemm.gemm_q4, T.Q5_0: gemm.gemm_q5, T.Q5_1: gemm.gemm_q5,
    T.Q8_0: gemm.gemm_q8_0, T.Q2_K: gemm.gemm_q2_k, T.Q3_K: gemm.gemm_q3_k,
    T.Q4_K: gemm.gemm_q45_k, T.Q5_K: gemm.gemm_q45_k, T.Q6_K: gemm.gemm_q6_k,
}
# type -> the fused small-M GEMM (takes the rows kernel's planes), used up to FUSED_MAX_M rows
_FUSED: dict[int, Callable[..., None]] = {
    T.Q4_0: fused.fused_q4, T.Q4_1: fused.fused_q4, T.Q5_0: fused.fused_q5,
    T.Q5_1: fused.fused_q5, T.Q8_0: fused.fused_q8_0, T.Q4_K: fused.fused_q45_k,
    T.Q5_K: fused.fused_q45_k, T.Q6_K: fused.fused_q6_k,
}
FUSED_MAX_M = 32
# type -> the multi-row GEMV (`qmatmul_multi`: each weight block decoded once for all rows of
# x), used for 2 <= M <= MULTI_MAX_ROWS[type] (measured crossovers to the fused GEMM; keep them
# below 16: the warm-up compiles the fused kernels with a 16-row step)
_MULTI: dict[int, Callable[..., None]] = {
    T.Q4_0: multi.mgemv_q4, T.Q4_1: multi.mgemv_q4, T.Q5_0: multi.mgemv_q5,
    T.Q5_1: multi.mgemv_q5, T.Q8_0: multi.mgemv_q8_0, T.Q4_K: multi_k.mgemv_q4_k,
    T.Q6_K: multi_k.mgemv_q6_k,
}
MULTI_MAX_ROWS: dict[int, int] = {T.Q4_0: 12, T.Q4_1: 12, T.Q5_0: 14, T.Q5_1: 14, T.Q8_0: 15,
                                  T.Q4_K: 9, T.Q6_K: 9}
# Up to this many rows of x `matmul` runs the GEMV kernels; beyond, dequantized tiles + BLAS.
# Measured (3072x1536 and 4096x4096, one thread): the GEMV kernels decode the weights again
# for every row of x, so the cut falls where that costs more than the dequantize pass. Types
# in `_MULTI` reach them only at M = 1 (2 rows and more: the multi-row GEMV).
GEMV_MAX_ROWS: dict[int, int] = {
    T.F32: 8, T.F16: 6, T.BF16: 6, T.Q8_0: 8, T.Q4_0: 6, T.Q4_1: 6, T.Q5_0: 3, T.Q5_1: 3,
    T.Q2_K: 4, T.Q3_K: 3, T.Q4_K: 4, T.Q5_K: 3, T.Q6_K: 3}
# GEMVs over fewer weights x rows than this run on the calling thread: waking numba's
# threads costs more than they save (Q8_0 256x576: 17 us on one thread or two).
SERIAL_MAX_WORK = 1 << 18
# The GEMM's float32 weight tile per task, and the bytes of x panels `outer` runs over per
# 4-row group (both meant to stay in L2, 512 KB per core here).
GEMM_TILE_BYTES = 64 << 10
PANEL_CHUNK_BYTES = 256 << 10
PREFETCH_BYTES = 16 << 10       # the GEMV kernels prefetch about this far ahead
# The rows kernels' inner trip count (weights per run), passed at run time: with a constant,
# LLVM unrolls those loops and, unable to rule out `out` aliasing the planes, leaves them
# scalar (Q8_0: 0.52 ns/weight); a runtime count gets them vectorized behind alias checks
# (0.13 ns/weight).
ROW_RUN = 32


def min_plane(w: QuantMatrix) -> np.ndarray:
    """Q4_1/Q5_1's float16 block mins `[N, K / 32]` (uint16 bits)."""
    return w.planes[layout.PLANES[w.qtype].index("m")]


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


def multi_gemv(w: QuantMatrix, x: np.ndarray, out: np.ndarray) -> None:
    """out[M, N] = x[M, K] @ W.T with the multi-row GEMV (types in `_MULTI`); parallel over
    tasks of `_multi_chunk` weight rows."""
    _check_f32("x", x, (x.shape[0], w.cols))
    _check_f32("out", out, (x.shape[0], w.rows))
    threads = 1 if w.rows * w.cols * x.shape[0] <= SERIAL_MAX_WORK else 0
    chunk = _multi_chunk(w.rows, numba.get_num_threads() if threads == 0 else 1)
    _MULTI[w.qtype](*_kernel_args(w), HALF_LUT, x, out, _prefetch_rows(w), chunk, threads)


def _multi_chunk(rows: int, threads: int) -> int:
    """Weight rows per task of the multi-row GEMV: about 8 tasks per thread, 2 to 64 rows
    (the kernel is called once per task), even (tasks take rows in pairs)."""
    chunk = max(2, min(64, rows // (8 * threads)))
    return chunk + (chunk & 1)


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


def _gemm_tile(w: QuantMatrix, threads: int) -> int:
    """Weight rows per GEMM task: a float32 tile of about `GEMM_TILE_BYTES` (L2-resident while
    `outer` runs over it), a multiple of 4 rows, and a task count that is a multiple of the
    thread count (576 rows in 9 tiles left one of two threads idle for a ninth)."""
    rows = max(4, GEMM_TILE_BYTES // (4 * w.cols) // 4 * 4)
    tasks = -(-w.rows // rows)
    tasks = -(-tasks // threads) * threads
    per_task = -(-w.rows // tasks)
    return max(4, -(-per_task // 4) * 4)


def matmul(w: QuantMatrix, x: np.ndarray) -> np.ndarray:
    """x float32 [M, K] -> float32 [M, N] = x @ W.T. 2 to `MULTI_MAX_ROWS` rows (types that
    have one): `multi_gemv`. Else up to `GEMV_MAX_ROWS` rows: `gemv`. More: the fused small-M
    GEMM (`qmatmul_fused`, up to `FUSED_MAX_M` rows) or the blocked GEMM of `qmatmul_gemm` (x
    packed into panels, tiles of W dequantized once and multiplied by the register-blocked
    micro-kernel), parallel over tiles."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m = x.shape[0]
    out = np.empty((m, w.rows), dtype=np.float32)
    if 2 <= m <= MULTI_MAX_ROWS.get(w.qtype, 0):
        multi_gemv(w, x, out)
        return out
    if m <= GEMV_MAX_ROWS[w.qtype] and not (m == 1 and w.qtype == T.F32):
        gemv(w, x, out)     # (F32 at M = 1: BLAS's GEMV streams 1.6-2x faster than ours)
        return out
    if m == 1:
        np.matmul(x, w.planes[0].T, out=out)
        return out
    _check_f32("x", x, (m, w.cols))
    xp = np.empty((-(-m // gemm.PANEL), w.cols, gemm.PANEL), dtype=np.float32)
    gemm.pack_panels(x, xp)
    tile = _gemm_tile(w, numba.get_num_threads())
    if m <= FUSED_MAX_M and w.qtype in _FUSED:
        _FUSED[w.qtype](*_kernel_args(w, rows=True), HALF_LUT, xp, out, tile, ROW_RUN)
        return out
    chunk = max(1, PANEL_CHUNK_BYTES // (4 * gemm.PANEL * w.cols))
    _GEMM[w.qtype](*_kernel_args(w, rows=True), HALF_LUT, xp, out, tile, chunk, ROW_RUN)
    return out
