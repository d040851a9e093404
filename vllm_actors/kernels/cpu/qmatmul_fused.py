"""The GEMM for small M (batched decode: up to `FUSED_MAX_M` rows of x), with the weights
decoded inside the loop: `out[M, N] = x[M, K] @ W.T`, x packed into panels as for
`qmatmul_gemm`.

Per task (a tile of weight rows, `prange`), per group of four weight rows, per 32-column block
of K: the four rows' 32 weights are decoded into a stack tile (`w`, 128 floats, in L1) by the
type's codec (`qmatmul_codec.decode_block`, 8-lane vector decoders), then `block_fma`
multiplies them into every panel's 4x16 accumulators (held in registers across the block's 32
columns, kept in `acc` between blocks). No float32 copy of W is written or read back, which is
what the dequantize-then-multiply GEMM pays (docs/BENCHMARKS.md, "Compiled CPU backend: kernel
layout and dispatch"). Types: those whose codec has `blocks` (Q4_0/Q4_1, Q5_0/Q5_1, Q8_0,
Q4_K/Q5_K, Q6_K); the others (float types, Q2_K, Q3_K) use `qmatmul_gemm` at every M.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_codec import decode_block
from vllm_actors.kernels.cpu.qmatmul_prims import stack_f32


@kernel(inline=True)
def block_fma(w, xp, acc, k0):  # type: ignore[no-untyped-def]
    """acc[t, 16 r + j] += sum_i w[32 r + i] * xp[t, k0 + i, j] (four decoded rows)."""
    reg = stack_f32(64)
    for t in range(xp.shape[0]):
        for j in range(64):
            reg[j] = acc[t, j]
        for i in range(32):
            kk = k0 + i
            w0 = w[i]
            w1 = w[32 + i]
            w2 = w[64 + i]
            w3 = w[96 + i]
            for j in range(16):
                xv = xp[t, kk, j]
                reg[j] += w0 * xv
                reg[16 + j] += w1 * xv
                reg[32 + j] += w2 * xv
                reg[48 + j] += w3 * xv
        for j in range(64):
            acc[t, j] = reg[j]


@kernel(inline=True)
def store_group(acc, out, a, n):  # type: ignore[no-untyped-def]
    """Rows a..a+3 (those < n) of the result out of acc, and acc zeroed for the next group."""
    m = out.shape[0]
    for t in range(acc.shape[0]):
        mc = min(16, m - 16 * t)
        for r in range(min(4, n - a)):
            for j in range(mc):
                out[16 * t + j, a + r] = acc[t, 16 * r + j]
        for j in range(64):
            acc[t, j] = 0


@kernel(parallel=True)
def fused(codec, planes, lut, xp, out, tile):  # type: ignore[no-untyped-def]
    """out = x @ W.T (x as panels xp) for a codec with `blocks`, W's planes as its rows
    kernel takes them: per task a tile of weight rows, per group of 4 rows and block of 32
    columns, the 4 rows' block decoded (`qmatmul_codec.decode_block`) into a stack tile and
    multiplied into every panel (`block_fma`)."""
    n = out.shape[1]
    for t in prange((n + tile - 1) // tile):
        acc = np.zeros((xp.shape[0], 64), dtype=np.float32)
        w = stack_f32(128)
        for a in range(t * tile, min(n, t * tile + tile), 4):
            for c in range(xp.shape[1] // 32):
                for r in range(4):
                    row = min(a + r, n - 1)
                    decode_block(codec, planes, lut, row, c, w, 32 * r, min(row + 4, n - 1))
                block_fma(w, xp, acc, 32 * c)
            store_group(acc, out, a, n)
