"""GGML block formats and their vectorized numpy dequantizers (the reference for device kernels).

Each `_deq_*` takes stored blocks as uint8 `[num_blocks, type_size]` and returns float32
`[num_blocks, block_size]`, following the arithmetic of ggml's `dequantize_row_*` so results
are bit-identical to gguf-py's reference dequantizers. Types without a hand-written path fall
back to `gguf.quants.dequantize`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

T = GGMLQuantizationType
QK_K = 256

# The fields of each block type the device matmuls read in place (`linear_quant.cl` / `.cu`),
# in storage order: (name, bytes). Half floats: d (scale), m / dmin (min); the rest are byte
# arrays. The device sources get values per block, bytes per block and these offsets as
# #defines (`device_backend.kernel_source`); the sizes add up to GGML_QUANT_SIZES's.
BLOCK_FIELDS: dict[int, tuple[tuple[str, int], ...]] = {
    T.Q8_0: (("d", 2), ("qs", 32)),
    T.Q4_0: (("d", 2), ("qs", 16)),
    T.Q4_1: (("d", 2), ("m", 2), ("qs", 16)),
    T.Q5_0: (("d", 2), ("qh", 4), ("qs", 16)),
    T.Q5_1: (("d", 2), ("m", 2), ("qh", 4), ("qs", 16)),
    T.Q2_K: (("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)),
    T.Q3_K: (("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)),
    T.Q4_K: (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)),
    T.Q5_K: (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)),
    T.Q6_K: (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)),
    T.IQ4_NL: (("d", 2), ("qs", 16)),
}
# qtype -> {field: byte offset in the block}, from BLOCK_FIELDS
BLOCK_OFFSETS: dict[int, dict[str, int]] = {
    qt: {name: sum(size for _, size in fields[:i]) for i, (name, _) in enumerate(fields)}
    for qt, fields in BLOCK_FIELDS.items()}


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte `start` of every block, as float32 `[num_blocks, 1]`."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """`[n, k]` packed bytes -> `[n, 2k]` with all low nibbles first, then all high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit unpacking: `[n, count // 8]` bytes -> `[n, count]` of 0/1 (uint8)."""
    return np.unpackbits(packed, axis=1, count=count, bitorder="little")


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b, 2)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    return _nibbles(qs) | (_bits(qh, 32) << 4)


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    q = _q5_values(b[:, 2:6], b[:, 6:]).astype(np.int8) - np.int8(16)
    return _f16(b, 0) * q.astype(np.float32)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _q5_values(b[:, 4:8], b[:, 8:]).astype(np.float32) + _f16(b, 2)


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)


def _deq_q2_k(b: np.ndarray) -> np.ndarray:
    # scales[16] | qs[64] | d | dmin. Element (half n, shift j, l<32) comes from qs[32n + l]
    # bits 2j..2j+1 and uses sub-block scale 8n + 2j + l // 16.
    n = len(b)
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (scales >> 4).astype(np.float32))[:, :, None]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    q = (qs.reshape(n, 2, 1, 32) >> shifts) & 3
    q = q.reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _k_scales_6bit(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 16 6-bit scales packed into 12 bytes -> int8 `[n, 16]` (bias of 32 removed)."""
    i = np.arange(16)
    low = (scales[:, i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 0x0F
    high = (scales[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 0x03
    return (low | (high << 4)).astype(np.int8) - np.int8(32)


def unpack_q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's packed `[n, 12]` scale bytes -> int8 `[n, 16]` sub-block scales (bias removed)."""
    return _k_scales_6bit(scales)


def unpack_k4_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's packed `[n, 12]` bytes -> uint8 scales `[n, 8]` and mins `[n, 8]`."""
    return _k4_scales_mins(scales)


def _deq_q3_k(b: np.ndarray) -> np.ndarray:
    # hmask[32] | qs[64] | scales[12] | d. Element (n, j, l) uses qs[32n + l] bits 2j..,
    # hmask[l] bit 4n + j (a clear bit subtracts 4) and scale 8n + 2j + l // 16.
    n = len(b)
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    dl = (d * _k_scales_6bit(scales).astype(np.float32))[:, :, None]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    q = ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).astype(np.int8)
    hbit_index = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)
    h = (hmask.reshape(n, 1, 1, 32) >> hbit_index) & 1
    q = q - ((1 - h).astype(np.int8) << 2)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _k4_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 8 6-bit scales and 8 6-bit mins packed in 12 bytes -> two `[n, 8]`."""
    sc = np.empty((len(s), 8), dtype=np.uint8)
    mn = np.empty((len(s), 8), dtype=np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _k4_apply(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """q: `[n, 8, 32]` unsigned sub-block values; returns d*sc*q - dmin*m."""
    n = len(b)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k4_scales_mins(b[:, 4:16])
    d1 = (d * sc.astype(np.float32))[:, :, None]
    m1 = (dmin * mn.astype(np.float32))[:, :, None]
    return (d1 * q.astype(np.float32) - m1).reshape(n, QK_K)


def _k4_values(qs: np.ndarray) -> np.ndarray:
    """Q4_K nibbles: group g of 32 bytes gives sub-blocks 2g (low nibbles) and 2g+1 (high)."""
    g = qs.reshape(len(qs), 4, 1, 32)
    return np.concatenate([g & 0x0F, g >> 4], axis=2).reshape(len(qs), 8, 32)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    return _k4_apply(b, _k4_values(b[:, 16:144]))


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    # d | dmin | scales[12] | qh[32] | qs[128]; sub-block s takes its 5th bit from qh[l] bit s.
    qh = b[:, 16:48]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return _k4_apply(b, _k4_values(b[:, 48:176]) | (high << 4))


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    # ql[128] | qh[64] | scales[16] int8 | d. Half h (128 values) uses ql[64h:64h+64],
    # qh[32h:32h+32]; quarter k of the half: low/high nibble of ql[l + 32(k%2)], qh bits 2k.
    n = len(b)
    ql = b[:, :128].reshape(n, 2, 2, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b, 208)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)             # [n, 2, 4, 32]
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)         # [n, 2, 4, 32]
    q = q.reshape(n, 16, 16).astype(np.float32)
    return ((d * scales)[:, :, None] * q).reshape(n, QK_K)


def _deq_bf16(b: np.ndarray) -> np.ndarray:
    return (b.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _deq_f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _deq_f32(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float32)


_DEQUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    T.F32: _deq_f32, T.F16: _deq_f16, T.BF16: _deq_bf16,
    T.Q4_0: _deq_q4_0, T.Q4_1: _deq_q4_1, T.Q5_0: _deq_q5_0, T.Q5_1: _deq_q5_1,
    T.Q8_0: _deq_q8_0, T.Q2_K: _deq_q2_k, T.Q3_K: _deq_q3_k, T.Q4_K: _deq_q4_k,
    T.Q5_K: _deq_q5_k, T.Q6_K: _deq_q6_k,
}

_PLAIN = (T.F32, T.F16, T.BF16)

# Rows are dequantized in chunks to bound the temporaries (a few ints per weight).
_CHUNK_BLOCKS = 1 << 16


def is_supported(qtype: int) -> bool:
    """True when `dequantize` can handle this GGML type (ours or gguf-py's fallback)."""
    try:
        qt = T(qtype)
    except ValueError:
        return False
    return qt in _DEQUANTIZERS or qt in getattr(gguf_quants, "_type_traits", {})


def block_layout(qtype: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGML type."""
    return GGML_QUANT_SIZES[T(qtype)]


def dequantize(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """Stored tensor data (any dtype, C-contiguous) -> float32 array of `shape`."""
    qt = T(qtype)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if qt in _PLAIN:
        return _DEQUANTIZERS[qt](raw[None, :]).reshape(shape)
    fn = _DEQUANTIZERS.get(qt)
    if fn is None:
        return gguf_quants.dequantize(raw.reshape(-1, raw.size), qt).reshape(shape).astype(
            np.float32, copy=False)
    block_size, type_size = block_layout(qtype)
    blocks = raw.reshape(-1, type_size)
    out = np.empty((len(blocks), block_size), dtype=np.float32)
    for start in range(0, len(blocks), _CHUNK_BLOCKS):
        out[start:start + _CHUNK_BLOCKS] = fn(blocks[start:start + _CHUNK_BLOCKS])
    return out.reshape(shape)
