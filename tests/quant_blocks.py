"""Random GGUF blocks of any quant type (gguf-py quantizes only the 32-weight types), with
finite float16 scales, for kernel tests that compare two paths on the same weights."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from vllm_actors.kernels import quant


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of random blocks, their d / m / dmin in [0.001, 0.01]."""
    block_size, type_size = quant.block_layout(qtype)
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for name, offset in quant.BLOCK_OFFSETS[qtype].items():
        if name in ("d", "m", "dmin"):
            scales = rng.uniform(0.001, 0.01, len(blocks)).astype(np.float16)
            blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def q6_k_codes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """A stored Q6_K's unsigned 6-bit codes (offset 32 kept) `[N, 256 nsb]` in weight order,
    from its low-bit `[N, 128 nsb]` and high-bit `[N, 64 nsb]` planes: in each half of 128,
    weight 32 j + l from nibble j // 2 of low byte 32 (j % 2) + l and bits 2 j of high byte l."""
    n, nsb = ql.shape[0], ql.shape[1] // 128
    low, high = ql.reshape(n, nsb, 2, 2, 32), qh.reshape(n, nsb, 2, 32)
    quarters = [((low[:, :, :, j % 2] >> (4 * (j // 2))) & 15) | (((high >> (2 * j)) & 3) << 4)
                for j in range(4)]
    return np.stack(quarters, axis=3).reshape(n, -1)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> IQ4_NL blocks [rows, bytes per row] (gguf-py has no IQ4_NL
    quantizer): per 32 weights d = the largest-magnitude weight / -127, each weight the
    nearest of the table's values times d. A valid encoding, not llama.cpp's search."""
    table = np.array(gguf_quants.IQ4_NL.kvalues, np.float32)
    x = np.asarray(w, np.float32).reshape(-1, 32)
    peak = x[np.arange(len(x)), np.abs(x).argmax(axis=1)]
    d = (peak / np.float32(-127.0)).astype(np.float16)
    scale = d.astype(np.float32)
    inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    index = np.abs(x[:, :, None] * inverse[:, None, None] - table).argmin(axis=-1)
    index = index.astype(np.uint8)
    qs = index[:, :16] | (index[:, 16:] << 4)
    return np.concatenate([d[:, None].view(np.uint8), qs], axis=1).reshape(w.shape[0], -1)
