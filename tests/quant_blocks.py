"""Random GGUF blocks of any quant type (gguf-py quantizes only the 32-weight types), with
finite float16 scales, for kernel tests that compare two paths on the same weights."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

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
