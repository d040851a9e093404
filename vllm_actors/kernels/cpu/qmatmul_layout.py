"""How each GGML type is kept in memory by the CPU backend: its blocks split into planes.

A plane holds one field of every block of a row, rows stacked: `[N, blocks_per_row * size]`
(float16 fields as uint16 `[N, blocks_per_row]`). The split is lossless: the same bits, moved.
Two fields are also widened so the kernels read them with plain loads: the 6-bit scales of
Q3_K (12 bytes -> 16 int8, bias of 32 removed) and Q4_K/Q5_K (12 bytes -> 8 scales + 8 mins,
uint8). Sizes relative to the GGUF bytes: 1.0 for all types but Q3_K 1.036, Q4_K 1.028,
Q5_K 1.023. Field offsets come from `quant.BLOCK_FIELDS` / `BLOCK_OFFSETS`.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from vllm_actors.kernels import quant
from vllm_actors.kernels.cpu.jit import kernel

T = GGMLQuantizationType

# Blocks split at a time (`_split_span`): 576 KiB of Q4_K, within L2.
_CHUNK_BLOCKS = 4096

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
# plane names per type, in the order the kernels take them
PLANES: dict[int, tuple[str, ...]] = {
    T.F32: ("w",), T.F16: ("w",), T.BF16: ("w",),
    T.Q4_0: ("qs", "d"), T.Q4_1: ("qs", "d", "m"),
    T.Q5_0: ("qs", "qh", "d"), T.Q5_1: ("qs", "qh", "d", "m"),
    T.Q8_0: ("qs", "d"),
    T.Q2_K: ("qs", "scales", "d", "dmin"),
    T.Q3_K: ("hmask", "qs", "scales", "d"),
    T.Q4_K: ("qs", "sc", "mn", "d", "dmin"),
    T.Q5_K: ("qh", "qs", "sc", "mn", "d", "dmin"),
    T.Q6_K: ("ql", "qh", "scales", "d"),
}
SUPPORTED = frozenset(PLANES)
_VIEW = {"d": np.uint16, "dmin": np.uint16, "m": np.uint16}
_SIGNED = {(T.Q8_0, "qs"), (T.Q6_K, "scales")}

# Types without kernels are converted once: tensors up to this many weights to F32 (exact),
# larger ones requantized to Q8_0 (see `convert`).
CONVERT_F32_MAX = 1 << 20
# Types whose blocks a supported type holds exactly, block for block (see `convert`)
LOSSLESS: dict[int, int] = {T.IQ4_NL: T.Q8_0}


@kernel
def _k4_scales_mins(blocks, offset, sc, mn):  # type: ignore[no-untyped-def]
    """Q4_K/Q5_K's 8 6-bit scales and 8 6-bit mins, packed in the 12 bytes at `offset` of
    each block, -> sc, mn uint8 `[n, 8]` (as `quant.unpack_k4_scales_mins`)."""
    for b in range(blocks.shape[0]):
        for j in range(4):
            lo, mid, hi = blocks[b, offset + j], blocks[b, offset + 4 + j], \
                blocks[b, offset + 8 + j]
            sc[b, j] = lo & 63
            mn[b, j] = mid & 63
            sc[b, 4 + j] = (hi & 15) | ((lo >> 6) << 4)
            mn[b, 4 + j] = (hi >> 4) | ((mid >> 6) << 4)


def _plane_spec(qt: T, name: str) -> tuple[int, type]:
    """(bytes a block contributes to the plane, the plane's dtype)."""
    if qt in (T.Q4_K, T.Q5_K) and name in ("sc", "mn"):
        return 8, np.uint8
    if qt == T.Q3_K and name == "scales":
        return 16, np.int8
    size = dict(quant.BLOCK_FIELDS[qt])[name]
    if name in _VIEW:
        return size, _VIEW[name]
    if name == "qh" and qt in (T.Q5_0, T.Q5_1):
        return size, np.uint32
    return size, np.int8 if (qt, name) in _SIGNED else np.uint8


def empty_planes(qtype: int, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """Uninitialized planes for a `[rows, cols]` matrix of a supported type (`split_into`
    fills them)."""
    qt = T(qtype)
    if qt in FLOAT_TYPES:
        return (np.empty((rows, cols), np.float32 if qt == T.F32 else np.uint16),)
    block_size, _ = quant.block_layout(qt)
    if cols % block_size:
        raise ValueError(f"{qt.name}: {cols} columns are not a multiple of {block_size}")
    bpr = cols // block_size
    planes = []
    for name in PLANES[qt]:
        size, dtype = _plane_spec(qt, name)
        planes.append(np.empty((rows, bpr * size // np.dtype(dtype).itemsize), dtype))
    return tuple(planes)


def split_into(raw: np.ndarray, qtype: int, rows: int, cols: int,
               planes: tuple[np.ndarray, ...], row0: int = 0) -> None:
    """Stored bytes (uint8, `rows * cols` weights of a supported type) -> rows row0 ..
    row0 + rows of `planes` (from `empty_planes`; a fused weight's parts fill one set)."""
    qt = T(qtype)
    if qt in FLOAT_TYPES:
        planes[0][row0:row0 + rows] = raw.view(planes[0].dtype).reshape(rows, cols)
        return
    block_size, type_size = quant.block_layout(qt)
    blocks = raw.reshape(-1, type_size)
    # the rows of one part, as bytes per block: [rows * blocks_per_row, size]
    out = [p[row0:row0 + rows].view(np.uint8).reshape(len(blocks), -1) for p in planes]
    spans = _spans(len(blocks))
    if len(spans) == 1:
        _split_span(blocks, qt, out, *spans[0])
        return
    for done in [_pool().submit(_split_span, blocks, qt, out, *span) for span in spans]:
        done.result()


def _spans(n: int) -> list[tuple[int, int]]:
    """[b0, b1) ranges of n blocks, one a thread (contiguous, so each reads its own pages)."""
    threads = max(1, min(numba.get_num_threads(), n // _CHUNK_BLOCKS))
    bounds = [n * i // threads for i in range(threads + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The load's split threads, started at the first large tensor. A forked child gets a
    pool of its own: the parent's threads do not exist there, and its idle count would
    leave submitted work waiting for them."""
    return ThreadPoolExecutor(max_workers=numba.config.NUMBA_NUM_THREADS,
                              thread_name_prefix="split")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pool.cache_clear)


def _split_span(blocks: np.ndarray, qt: T, out: list[np.ndarray], b0: int, b1: int) -> None:
    """Blocks [b0, b1) into `out` (each plane as bytes per block), `_CHUNK_BLOCKS` at a time:
    a chunk stays in L2 while each of its fields is copied out, so the file's bytes are read
    from memory once, not once a plane. numpy's copies and the kernels drop the GIL."""
    offsets = quant.BLOCK_OFFSETS[qt]
    names = PLANES[qt]
    for c0 in range(b0, b1, _CHUNK_BLOCKS):
        src = blocks[c0:min(b1, c0 + _CHUNK_BLOCKS)]
        dst = [target[c0:c0 + len(src)] for target in out]
        for name, target in zip(names, dst):
            if qt in (T.Q4_K, T.Q5_K) and name == "sc":
                _k4_scales_mins(src, offsets["scales"], target, dst[names.index("mn")])
            elif qt in (T.Q4_K, T.Q5_K) and name == "mn":
                continue                                     # written with "sc"
            elif qt == T.Q3_K and name == "scales":
                target[:] = quant.unpack_q3_k_scales(src[:, offsets["scales"]:][:, :12]
                                                     ).view(np.uint8)
            else:
                np.copyto(target, src[:, offsets[name]:offsets[name] + target.shape[1]])


def split(raw: np.ndarray, qtype: int, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """Stored bytes (uint8, `rows * cols` weights of a supported type) -> the type's planes,
    copied into fresh C-contiguous arrays."""
    planes = empty_planes(qtype, rows, cols)
    split_into(raw, qtype, rows, cols, planes)
    return planes


def aligned_empty(shape: tuple[int, ...], dtype: np.typing.DTypeLike) -> np.ndarray:
    """An uninitialized array whose data starts on a 64-byte boundary (a cache line: the
    kernels' vector loads then never straddle two)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize     # np.prod takes 2.7 us on a tuple
    raw = np.empty(nbytes + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip:skip + nbytes].view(dtype).reshape(shape)


# weight rows an interleaved plane holds side by side (`interleave_words`): one vector of 16
# int32 lanes
INTERLEAVED_ROWS = 16


def interleave_halves(plane: np.ndarray) -> np.ndarray:
    """A plane of one 2-byte value a row and superblock (`[N, nsb]` float16 bits: d, dmin; N
    a multiple of 16) with each chunk of 16 rows' values of a superblock side by side: row
    l's value of superblock sb at element 16 sb + l of its chunk (one 32-byte load of 16
    rows' values)."""
    n, nsb = plane.shape
    if n % INTERLEAVED_ROWS:
        raise ValueError(f"cannot interleave a plane of shape {plane.shape}")
    out = aligned_empty(plane.shape, plane.dtype)
    out.reshape(n // INTERLEAVED_ROWS, nsb, INTERLEAVED_ROWS)[:] = plane.reshape(
        n // INTERLEAVED_ROWS, INTERLEAVED_ROWS, nsb).transpose(0, 2, 1)
    return out


def fifth_bits_by_group(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits (uint32 a block, bit j for weight j) reordered so that byte k
    holds, at bit t, the bit of weight 4t + k (group t's code k): the interleaved kernels
    then bring a group's bits to its codes' bit 4 with one shift and one mask
    (`qwide._fifth_of_group`), where each took a byte shuffle, a mask, a compare and a
    select. The same 4 bytes a block."""
    words = np.ascontiguousarray(qh, np.uint32)
    out = np.empty_like(words)
    _by_group(words.reshape(-1), out.reshape(-1))
    return out


@kernel
def _by_group(words, out):  # type: ignore[no-untyped-def]
    """out[i] = words[i] with bit 4t + k moved to bit 8k + t, in one pass (numpy's passes
    or table lookups were several times slower: docs/BENCHMARKS.md)."""
    for i in range(words.shape[0]):
        v, r = words[i], np.uint32(0)
        for t in range(8):
            for k in range(4):
                r |= ((v >> np.uint32(4 * t + k)) & np.uint32(1)) << np.uint32(8 * k + t)
        out[i] = r


def interleave_words(plane: np.ndarray, per_superblock: int,
                     words_as: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """A plane of `per_superblock` bytes a row and superblock (`[N, per_superblock nsb]`, N a
    multiple of 16: Q4_K's quants 128, scales and mins 8, Q6_K's low bits 128, high bits 64,
    scales 16) with
    each chunk of 16 rows reordered: word v (bytes 4v .. 4v + 3) of superblock sb of its row
    l moves to byte 64 (W sb + v) + 4 l of the chunk (W = per_superblock / 4 words), so the
    16 rows' words v lie side by side, one vector of lanes as `krow` and `ktiled` read them
    (no transposes), and a chunk is one contiguous stream. A new plane, its chunks
    reordered on the load's threads; `words_as` maps a run of chunks' 4-byte words (uint32)
    to the words stored (`fifth_bits_by_group`) as they go."""
    n, rb = plane.shape
    if n % INTERLEAVED_ROWS or rb % per_superblock or per_superblock % 4:
        raise ValueError(f"cannot interleave a plane of shape {plane.shape} by "
                         f"{per_superblock} bytes a superblock")
    words = per_superblock // 4
    out = aligned_empty(plane.shape, plane.dtype)
    src = plane.view(np.uint32).reshape(n // INTERLEAVED_ROWS, INTERLEAVED_ROWS,
                                        rb // per_superblock, words)
    dst = out.view(np.uint32).reshape(n // INTERLEAVED_ROWS, rb // per_superblock, words,
                                      INTERLEAVED_ROWS)

    def reorder(c0: int, c1: int) -> None:
        words = src[c0:c1] if words_as is None else words_as(src[c0:c1])
        dst[c0:c1] = words.transpose(0, 2, 3, 1)
    threads = len(_spans(plane.size // 128))      # as many as the split of its blocks took
    bounds = [len(src) * i // threads for i in range(threads + 1)]
    for done in [_pool().submit(reorder, *span) for span in zip(bounds[:-1], bounds[1:])]:
        done.result()
    return out


def convert(raw: np.ndarray, qtype: int, rows: int, cols: int
            ) -> tuple[int, tuple[np.ndarray, ...]]:
    """A type without kernels (IQ*, TQ*, MXFP4, ...) -> (new type, planes). Dequantized with
    `quant.dequantize` (gguf-py's reference); up to `CONVERT_F32_MAX` weights kept as F32
    (no error), else requantized to Q8_0 per 32 weights with `gguf.quants.quantize`: each
    weight moves by at most half a Q8_0 step plus the float16 rounding of the scale, i.e.
    <= 0.504 * max|block| / 127 + 2^-11 * max|block| < max|block| / 226.
    `LOSSLESS` types instead become their exact form at every size (IQ4_NL: `iq4_nl_as_q8_0`)."""
    if qtype == T.IQ4_NL:
        return T.Q8_0, split(iq4_nl_as_q8_0(raw), T.Q8_0, rows, cols)
    if cols * rows <= CONVERT_F32_MAX:
        dense = quant.dequantize(raw, qtype, (rows, cols))
        return T.F32, (np.ascontiguousarray(dense, dtype=np.float32),)
    if cols % 32:
        raise ValueError(f"{T(qtype).name}: cannot requantize {cols} columns to Q8_0")
    row_bytes = raw.size // rows
    out = np.empty((rows, cols // 32 * 34), dtype=np.uint8)
    step = max(1, (1 << 22) // cols)     # bounded float32 temporaries
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        dense = quant.dequantize(raw[r0 * row_bytes:r1 * row_bytes], qtype, (r1 - r0, cols))
        out[r0:r1] = gguf_quants.quantize(dense, T.Q8_0).reshape(r1 - r0, -1)
    return T.Q8_0, split(out.reshape(-1), T.Q8_0, rows, cols)


def iq4_nl_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks (float16 d, 16 bytes of nibbles: weight j < 16 the low nibble of byte j,
    j >= 16 the high nibble of byte j - 16) -> Q8_0 blocks holding the same weights exactly:
    the same d, and each nibble's int8 value from IQ4_NL's table. Under the quantized
    semantics both types take Q8_0 inputs, and the integer sums and d_w * d_x are unchanged,
    so the Q8_0 kernel gives the floats of llama.cpp's IQ4_NL matmul where it runs in
    tinyBLAS's order (the same template as Q8_0's); 8.5 bits a weight instead of 4.5."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 18)
    table = np.array(gguf_quants.IQ4_NL.kvalues, np.int8).view(np.uint8)
    out = np.empty((len(blocks), 34), np.uint8)
    out[:, :2] = blocks[:, :2]
    out[:, 2:18] = table[blocks[:, 2:] & 15]
    out[:, 18:] = table[blocks[:, 2:] >> 4]
    return out.reshape(-1)


def iq4_nl_planes(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """IQ4_NL blocks -> the planes its integer kernels read, as Q4_0's: the nibbles
    (uint8 [rows, cols / 2]) and the float16 scales' bits (uint16 [rows, cols / 32])."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, 18)
    return (np.ascontiguousarray(blocks[:, :, 2:].reshape(rows, -1)),
            np.ascontiguousarray(blocks[:, :, :2]).view(np.uint16).reshape(rows, -1))


def nbytes_gguf(qtype: int, rows: int, cols: int) -> int:
    block_size, type_size = quant.block_layout(qtype)
    return rows * cols // block_size * type_size
