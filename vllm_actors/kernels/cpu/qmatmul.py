"""Matmul over weights kept in their GGUF formats: `x @ W.T`, W dequantized in registers.

- Layout (`qmatmul_layout`): a `QuantMatrix` keeps each field of a type's blocks as one plane
  `[N, ...]`, the same bytes moved (1.00-1.04x the file). Types without kernels (IQ*, TQ*,
  MXFP4, ...) are converted once by `pack`: small tensors to F32, larger requantized to Q8_0.
- A type's kernels and decoders are its codec (`qmatmul_codec`, `CODECS`): the drivers
  below that take many rows are written once and compiled per codec.
- `gemv` (M <= `GEMV_MAX_ROWS[type]`): one kernel per type, parallel over pairs of weight rows,
  8-lane partial sums on the stack, offsets and mins through x's run sums.
- `multi_gemv` (2 <= M <= `MULTI_MAX_ROWS[type]`): decodes each block once for every row of x
  (speculative decoding's k+1 rows).
- `matmul` beyond: the fused small-M GEMM (`qmatmul_fused`, M <= `FUSED_MAX_M`) or the blocked
  GEMM (`qmatmul_gemm`: x packed into panels, tiles of W dequantized, a register-blocked
  micro-kernel).
The crossovers and the measurements behind each choice are in docs/BENCHMARKS.md ("Compiled
CPU backend: kernel layout and dispatch").

numba caches compiled code per kernel file and checks only that file: after editing
`qmatmul_prims.py`, `qmatmul_simd.py`, `qmatmul_codec.py` or `qdot.py` clear
`__pycache__/*.nbi, *.nbc` here, or kernels keep the old intrinsics and decoders.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np
from gguf import GGMLQuantizationType

from vllm_actors.kernels.cpu import qmatmul_codec as codecs
from vllm_actors.kernels.cpu import qmatmul_fused as fused
from vllm_actors.kernels.cpu import qmatmul_gemm as gemm
from vllm_actors.kernels.cpu import qmatmul_layout as layout
from vllm_actors.kernels.cpu import qmatmul_multi as multi
from vllm_actors.kernels.cpu.qmatmul_legacy import rows_iq4_nl
from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT

T = GGMLQuantizationType


@dataclass(frozen=True)
class QuantMatrix:
    """A weight `[rows, cols]` kept in GGML type `qtype` as the planes of `qmatmul_layout`."""

    qtype: int
    rows: int
    cols: int
    planes: tuple[np.ndarray, ...]
    # under the quantized semantics: a Q4_K weight llama.cpp would repack (x86 AVX2, rows a
    # multiple of 8, a matmul weight), whose float order the integer kernels then follow
    ggml_repacked: bool = False
    # the GGUF type the planes hold exactly in `qtype`'s form (IQ4_NL as Q8_0,
    # `qmatmul_layout.LOSSLESS`), whose llama.cpp float order the integer kernels follow
    stored_as: int | None = None
    # a repacked Q4_K or a Q6_K whose planes of codes hold 16 rows interleaved
    # (`interleave`): only the integer kernels that take 16 weight rows as vector lanes read
    # it (`krow`, `ktiled`)
    interleaved: bool = False
    # what the kernels reading this matrix prepared once for their calls (argument type
    # keys, prefetch distance); never part of its value, and not copied by `replace`
    memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

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


# type -> its kernels and decoders (`qmatmul_codec`): the one-row GEMV and rows kernel, and
# the codec the multi-row GEMV, the fused GEMM (types with `blocks`) and the GEMM compile for
CODECS: dict[int, codecs.Codec] = {
    T.F32: codecs.F32, T.F16: codecs.HALF, T.BF16: codecs.HALF,
    T.Q4_0: codecs.Q4_0, T.Q4_1: codecs.Q4_1, T.Q5_0: codecs.Q5_0, T.Q5_1: codecs.Q5_1,
    T.Q8_0: codecs.Q8_0, T.Q2_K: codecs.Q2_K, T.Q3_K: codecs.Q3_K,
    T.Q4_K: codecs.Q4_K, T.Q5_K: codecs.Q5_K, T.Q6_K: codecs.Q6_K,
}
# the fused small-M GEMM (`qmatmul_fused`) runs up to this many rows
FUSED_MAX_M = 32
# the multi-row GEMV (`qmatmul_multi`: each weight block decoded once for all rows of x)
# serves 2 <= M <= MULTI_MAX_ROWS[type] (measured crossovers to the fused GEMM; keep them
# below 16: the warm-up compiles the fused kernels with a 16-row step)
MULTI_MAX_ROWS: dict[int, int] = {T.Q4_0: 12, T.Q4_1: 12, T.Q5_0: 14, T.Q5_1: 14, T.Q8_0: 15,
                                  T.Q4_K: 9, T.Q6_K: 9}
# Up to this many rows of x `matmul` runs the GEMV kernels; beyond, dequantized tiles + BLAS.
# Measured (3072x1536 and 4096x4096, one thread): the GEMV kernels decode the weights again
# for every row of x, so the cut falls where that costs more than the dequantize pass. Types
# in `MULTI_MAX_ROWS` reach them only at M = 1 (2 rows and more: the multi-row GEMV).
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
    """Whether `concat` can stack these matrices (same type, source type, columns, float
    order and layout)."""
    first = parts[0] if parts else None
    return first is not None and all(
        (p.qtype, p.cols, p.stored_as, p.ggml_repacked, p.interleaved)
        == (first.qtype, first.cols, first.stored_as, first.ggml_repacked, first.interleaved)
        for p in parts)


def concat(parts: Sequence[QuantMatrix]) -> QuantMatrix:
    """Stack along rows (fused QKV, gate+up), keeping the parts' float order and layout
    (`ggml_repacked`, `interleaved`: `supports_fused` requires them equal)."""
    if not supports_fused(parts):
        raise ValueError("concat needs matrices of one type, column count, float order and "
                         "layout")
    if len(parts) == 1:
        return parts[0]
    planes = tuple(np.concatenate([p.planes[i] for p in parts], axis=0)
                   for i in range(len(parts[0].planes)))
    return QuantMatrix(parts[0].qtype, sum(p.rows for p in parts), parts[0].cols, planes,
                       ggml_repacked=parts[0].ggml_repacked, stored_as=parts[0].stored_as,
                       interleaved=parts[0].interleaved)


# the 32-weight block types `qwide` reads interleaved: its quants' bytes a block a row
_WORDS_32 = {T.Q4_0: 16, T.Q4_1: 16, T.Q5_0: 16, T.Q5_1: 16, T.Q8_0: 32, T.IQ4_NL: 16}


def interleave(w: QuantMatrix, integer: bool = True) -> QuantMatrix:
    """W with its planes interleaved 16 rows at a time (`qmatmul_layout.interleave_words`,
    `interleave_halves`: every block of a chunk of 16 rows one run of vectors, a row in each
    lane), where only the integer kernels that take 16 weight rows as vector lanes read it:
    a repacked Q4_K (`krow`, `ktiled`), and when `integer` (the quantized semantics's
    kernels alone read the weight) a Q6_K and the 32-weight types (`qwide`; IQ4_NL where
    llama.cpp repacks it: as stored, a request of one row takes another order, in the pair
    kernels); rows a multiple of 16. Any other matrix as it is."""
    if w.interleaved or w.rows % layout.INTERLEAVED_ROWS:
        return w
    iq4_nl = T.IQ4_NL in (w.qtype, w.stored_as)
    if w.qtype == T.Q4_K and w.ggml_repacked:
        qs, sc, mn, d, dmin = w.planes
        planes = (layout.interleave_words(qs, 128), layout.interleave_words(sc, 8),
                  layout.interleave_words(mn, 8), layout.interleave_halves(d),
                  layout.interleave_halves(dmin))
    elif w.qtype == T.Q6_K and integer:
        ql, qh, sc, d = w.planes
        planes = (layout.interleave_words(ql, 128), layout.interleave_words(qh, 64),
                  layout.interleave_words(sc, 16), layout.interleave_halves(d))
    elif w.qtype in _WORDS_32 and integer and (w.ggml_repacked or not iq4_nl):
        planes = (layout.interleave_words(w.planes[0], _WORDS_32[w.qtype]),
                  *(layout.interleave_words(p.view(np.uint8), 4,
                                            layout.fifth_bits_by_group).view(np.uint32)
                    if p.dtype == np.uint32 else layout.interleave_halves(p)
                    for p in w.planes[1:]))
    else:
        return w
    return QuantMatrix(w.qtype, w.rows, w.cols, planes, ggml_repacked=w.ggml_repacked,
                       stored_as=w.stored_as, interleaved=True)


def _raw(data: np.ndarray, qtype: int, shape: tuple[int, int]) -> np.ndarray:
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size != layout.nbytes_gguf(qtype, *shape):
        raise ValueError(f"{raw.size} bytes do not hold a {T(qtype).name} {shape} tensor")
    return raw


def pack(data: np.ndarray, qtype: int, shape: tuple[int, int]) -> QuantMatrix:
    """Stored tensor data of `shape` (N, K) -> QuantMatrix, copied into RAM once. Types
    without kernels are converted (`qmatmul_layout.convert`: F32 when small, else Q8_0)."""
    rows, cols = int(shape[0]), int(shape[1])
    if qtype in layout.SUPPORTED:
        return pack_stacked([data], qtype, [rows], cols)
    new_type, planes = layout.convert(_raw(data, qtype, (rows, cols)), qtype, rows, cols)
    exact = int(qtype) if layout.LOSSLESS.get(int(qtype)) == new_type else None
    return QuantMatrix(int(new_type), rows, cols, planes, stored_as=exact)


def pack_iq4_nl(data: np.ndarray, shape: tuple[int, int]) -> QuantMatrix:
    """An IQ4_NL weight kept as IQ4_NL (4.5 bits a weight), for the integer kernels of the
    quantized semantics (`qmatmul_int`) and row lookups (`take_rows`) only; `pack` gives the
    exact Q8_0 form every kernel reads."""
    rows, cols = int(shape[0]), int(shape[1])
    planes = layout.iq4_nl_planes(_raw(data, T.IQ4_NL, (rows, cols)), rows, cols)
    return QuantMatrix(int(T.IQ4_NL), rows, cols, planes)


def pack_stacked(parts: Sequence[np.ndarray], qtype: int, rows: Sequence[int], cols: int
                 ) -> QuantMatrix:
    """Stored data of several matrices of one supported type and column count, stacked
    along rows into one QuantMatrix (fused QKV, gate+up): each part is split straight into
    its rows of one set of planes, so the weights are copied once."""
    planes = layout.empty_planes(qtype, sum(rows), cols)
    row0 = 0
    for data, n in zip(parts, rows):
        layout.split_into(_raw(data, qtype, (n, cols)), qtype, n, cols, planes, row0)
        row0 += n
    return QuantMatrix(int(qtype), row0, cols, planes)


LLAMA_UBATCH = 512     # llama.cpp's default n_ubatch: the rows of one call of its graph


@dataclass(frozen=True)
class RowPlaces:
    """Each row of a step as llama.cpp would compute it, whose kernels depend on how many
    rows a call holds: the row's index in its call and that call's rows (a request decoded
    alone; a prompt's rows in calls of `LLAMA_UBATCH`, however the engine chunks it)."""

    index: np.ndarray
    size: np.ndarray

    def __len__(self) -> int:
        return len(self.index)

    @classmethod
    def of_requests(cls, counts: Any) -> "RowPlaces":
        """Each request's rows as one call (`counts`: the rows of each request, in order)."""
        n = np.asarray(counts, np.int64)
        return cls(np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n), np.repeat(n, n))

    @classmethod
    def of_step(cls, counts: np.ndarray, seq_lens: np.ndarray, prompt_lens: np.ndarray
                ) -> "RowPlaces":
        """A step's rows (`counts` of each request, ending at `seq_lens`), those of a prompt
        in its `LLAMA_UBATCH` call of the whole prompt (`prompt_lens`)."""
        alone = cls.of_requests(counts)
        pos = np.repeat(np.asarray(seq_lens, np.int64) - counts, counts) + alone.index
        prompt = np.repeat(np.asarray(prompt_lens, np.int64), counts)
        index, rows = prompt_call(pos, prompt)
        inside = pos < prompt
        return cls(np.where(inside, index, alone.index), np.where(inside, rows, alone.size))


def prompt_call(pos: np.ndarray, prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index, rows) of the prompt row at `pos` in llama.cpp's `LLAMA_UBATCH` call of its
    prompt of `prompt` tokens (int64 arrays; meaningful where pos < prompt)."""
    first = pos // LLAMA_UBATCH * LLAMA_UBATCH
    return pos - first, np.minimum(LLAMA_UBATCH, prompt - first)


def row_places(requests: Any) -> RowPlaces:
    """`requests` (a `RowPlaces`, or the rows of each request) as `RowPlaces`."""
    return requests if isinstance(requests, RowPlaces) else RowPlaces.of_requests(requests)


def one_row_each(requests: Any, rows: int) -> bool:
    """Whether each of `rows` rows is a call of one row (`requests` as `row_places` takes
    it; None: the rows are one call)."""
    if requests is None:
        return rows == 1
    if isinstance(requests, RowPlaces):
        return bool((requests.size == 1).all())
    return len(requests) == rows


def prefetch_rows(w: QuantMatrix) -> int:
    """How many weight rows ahead the GEMVs prefetch (about `PREFETCH_BYTES`)."""
    dist = w.memo.get("prefetch_rows")
    if dist is None:
        dist = w.memo["prefetch_rows"] = max(4, min(32, PREFETCH_BYTES * w.rows
                                                    // max(1, w.nbytes)))
    return dist


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
    CODECS[w.qtype].gemv(*_kernel_args(w), HALF_LUT, x, out, prefetch_rows(w), threads)


def multi_gemv(w: QuantMatrix, x: np.ndarray, out: np.ndarray) -> None:
    """out[M, N] = x[M, K] @ W.T with the multi-row GEMV (types in `MULTI_MAX_ROWS`); parallel over
    tasks of `_multi_chunk` weight rows."""
    _check_f32("x", x, (x.shape[0], w.cols))
    _check_f32("out", out, (x.shape[0], w.rows))
    threads = 1 if w.rows * w.cols * x.shape[0] <= SERIAL_MAX_WORK else 0
    chunk = _multi_chunk(w.rows, numba.get_num_threads() if threads == 0 else 1)
    multi.mgemv(CODECS[w.qtype], _kernel_args(w, rows=True), HALF_LUT, x, out, prefetch_rows(w),
                chunk, threads)


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
    _rows(w, ids, out)


def take_rows(w: QuantMatrix, ids: np.ndarray, out: np.ndarray) -> None:
    """Rows `ids` (e.g. token ids) as float32 into out `[len(ids), K]`."""
    ids = np.array(ids, dtype=np.int64).reshape(-1)
    _check_f32("out", out, (ids.size, w.cols))
    if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
        raise IndexError(f"row ids out of range [0, {w.rows})")
    _rows(w, ids, out)


def _rows(w: QuantMatrix, ids: np.ndarray, out: np.ndarray) -> None:
    """The type's rows kernel (IQ4_NL kept as itself: `rows_iq4_nl`; it has no other float
    kernel, so only tables and the integer kernels meet it)."""
    if w.qtype == T.IQ4_NL:
        rows_iq4_nl(w.planes[0], w.planes[1], HALF_LUT, ids, out, ROW_RUN)
    else:
        CODECS[w.qtype].rows(*_kernel_args(w, rows=True), HALF_LUT, ids, out, ROW_RUN)


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
    codec, planes = CODECS[w.qtype], _kernel_args(w, rows=True)
    if m <= FUSED_MAX_M and codec.blocks:
        fused.fused(codec, planes, HALF_LUT, xp, out, tile)
        return out
    chunk = max(1, PANEL_CHUNK_BYTES // (4 * gemm.PANEL * w.cols))
    gemm.gemm(codec.tiles, planes, HALF_LUT, xp, out, tile, chunk, ROW_RUN)
    return out
