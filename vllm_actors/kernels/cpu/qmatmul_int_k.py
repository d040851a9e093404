"""The integer GEMV of the K-quants (Q4_K, Q5_K, Q6_K) on x's Q8_K blocks
(`activations.quantize_q8_k`), as llama.cpp's `vec_dot_q*_K_q8_K`: per superblock of 256,
the weights' unsigned quants times x's int8 quants times the sub-block scales as exact int32
lanes (`qdot.kdot`), then scaled by d_w * d_x into 8 float lanes (`qdot.kflush`).

With q the stored quants of x, d_x its scale and b_j its sums of 16 (`bsums`), per superblock:
  Q4_K, Q5_K: d_w d_x sum_s sc_s (w_s . q_s) - dmin_w d_x sum_s mn_s (b_2s + b_2s+1)
  Q6_K:       d_w d_x (sum_j scales_j (w_j . q_j) - 32 sum_j scales_j b_j)
(s the 8 sub-blocks of 32, j the 16 of 16; the layouts are `qmatmul_k45`'s). The integer
parts are llama.cpp's exactly; the floats differ from its only in summation order. Parallel
over pairs of weight rows, as the other GEMVs.
"""

from __future__ import annotations

import numba
import numpy as np
from gguf import GGMLQuantizationType
from numba import prange

from vllm_actors.kernels.cpu import activations, isa
from vllm_actors.kernels.cpu.intrinsics import stack_i32
from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qdot import kdot, kflush
from vllm_actors.kernels.cpu.qmatmul import SERIAL_MAX_WORK, QuantMatrix, prefetch_rows
from vllm_actors.kernels.cpu.qmatmul_int import MAX_ROWS, call
from vllm_actors.kernels.cpu.qmatmul_prims import (
    HALF_LUT,
    limit_threads,
    prefetch,
    restore_threads,
    stack_f32,
)

T = GGMLQuantizationType
KINDS = {T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}
_NO_BITS = np.zeros((0, 0), np.uint8)


@numba.njit(inline="always", cache=True)
def _sub_block_pair(path, kind, iacc, ai, qs, qo, qh, ho, gg, xq, xo, sc, j):  # type: ignore[no-untyped-def]
    """Sub-blocks 2gg (low nibbles, bit 2gg of qh) and 2gg + 1 (high nibbles) of one row."""
    kdot(path, kind, iacc, ai, qs, qo, 0, qh, ho, 2 * gg, xq, xo, sc[j], sc[j])
    kdot(path, kind, iacc, ai, qs, qo, 4, qh, ho, 2 * gg + 1, xq, xo + 32, sc[j + 1], sc[j + 1])


@kernel(parallel=True, exact=True)
def gemv_k45(path, kind, qs, qh, sc, mn, d, dmin, lut, xq, xd, xb, out, dist, threads):  # type: ignore[no-untyped-def]
    """out[M, N] = x @ W.T under the quantized semantics, W Q4_K (kind 4, qh empty) or Q5_K."""
    numba.literally(path)
    numba.literally(kind)
    prev = limit_threads(threads)
    n, rb = qs.shape
    k = xq.shape[1]
    hb = qh.shape[1]
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * rb
        p1 = min(r0 + dist + 1, n - 1) * rb
        acc = stack_f32(16)
        iacc = stack_i32(16)
        for m in range(xq.shape[0]):
            for i in range(16):
                acc[i] = 0
                iacc[i] = 0
            off0 = np.float32(0)
            off1 = np.float32(0)
            for sb in range(rb // 128):
                for gg in range(4):
                    o = 128 * sb + 32 * gg
                    prefetch(qs, p0 + o)
                    prefetch(qs, p1 + o)
                    xo = m * k + 256 * sb + 64 * gg
                    j = 8 * sb + 2 * gg
                    _sub_block_pair(path, kind, iacc, 0, qs, r0 * rb + o, qh, r0 * hb + 32 * sb,
                                    gg, xq, xo, sc[r0], j)
                    _sub_block_pair(path, kind, iacc, 8, qs, r1 * rb + o, qh, r1 * hb + 32 * sb,
                                    gg, xq, xo, sc[r1], j)
                dx = xd[m, sb]
                kflush(acc, 0, iacc, 0, lut[d[r0, sb]] * dx)
                kflush(acc, 8, iacc, 8, lut[d[r1, sb]] * dx)
                m0 = np.int32(0)
                m1 = np.int32(0)
                for s in range(8):
                    bs = np.int32(xb[m, 16 * sb + 2 * s]) + np.int32(xb[m, 16 * sb + 2 * s + 1])
                    m0 += np.int32(mn[r0, 8 * sb + s]) * bs
                    m1 += np.int32(mn[r1, 8 * sb + s]) * bs
                off0 += lut[dmin[r0, sb]] * dx * np.float32(m0)
                off1 += lut[dmin[r1, sb]] * dx * np.float32(m1)
            out[m, r0] = acc[0:8].sum() - off0
            if r0 + 1 < n:
                out[m, r0 + 1] = acc[8:16].sum() - off1
    restore_threads(prev)


@numba.njit(inline="always", cache=True)
def _q6_half(path, iacc, ai, ql, qo, qh, ho, xq, xo, scales, j):  # type: ignore[no-untyped-def]
    """Weights 128h..128h+127 of one row's superblock: quarter t reads nibble t//2 of
    ql[qo + 32(t%2) + l] and bits 2t of qh[ho + l], scales j + 2t (l < 16) and j + 2t + 1."""
    kdot(path, 6, iacc, ai, ql, qo, 0, qh, ho, 0, xq, xo, scales[j], scales[j + 1])
    kdot(path, 6, iacc, ai, ql, qo + 32, 0, qh, ho, 2, xq, xo + 32, scales[j + 2],
         scales[j + 3])
    kdot(path, 6, iacc, ai, ql, qo, 4, qh, ho, 4, xq, xo + 64, scales[j + 4], scales[j + 5])
    kdot(path, 6, iacc, ai, ql, qo + 32, 4, qh, ho, 6, xq, xo + 96, scales[j + 6],
         scales[j + 7])


@kernel(parallel=True, exact=True)
def gemv_q6_k(path, kind, ql, qh, scales, d, lut, xq, xd, xb, out, dist, threads):  # type: ignore[no-untyped-def]
    """out[M, N] = x @ W.T under the quantized semantics, W Q6_K (`kind` 6)."""
    numba.literally(path)
    numba.literally(kind)
    prev = limit_threads(threads)
    n, rb = ql.shape
    k = xq.shape[1]
    hb = qh.shape[1]
    for g in prange((n + 1) // 2):
        r0 = 2 * g
        r1 = min(r0 + 1, n - 1)
        p0 = min(r0 + dist, n - 1) * rb
        p1 = min(r0 + dist + 1, n - 1) * rb
        acc = stack_f32(16)
        iacc = stack_i32(16)
        for m in range(xq.shape[0]):
            for i in range(16):
                acc[i] = 0
                iacc[i] = 0
            for sb in range(rb // 128):
                for h in range(2):
                    o = 128 * sb + 64 * h
                    prefetch(ql, p0 + o)
                    prefetch(ql, p1 + o)
                    ho = 64 * sb + 32 * h
                    xo = m * k + 256 * sb + 128 * h
                    j = 16 * sb + 8 * h
                    _q6_half(path, iacc, 0, ql, r0 * rb + o, qh, r0 * hb + ho, xq, xo,
                             scales[r0], j)
                    _q6_half(path, iacc, 8, ql, r1 * rb + o, qh, r1 * hb + ho, xq, xo,
                             scales[r1], j)
                s0 = np.int32(0)
                s1 = np.int32(0)
                for j in range(16 * sb, 16 * sb + 16):
                    s0 += np.int32(scales[r0, j]) * np.int32(xb[m, j])
                    s1 += np.int32(scales[r1, j]) * np.int32(xb[m, j])
                iacc[0] -= 32 * s0
                iacc[8] -= 32 * s1
                dx = xd[m, sb]
                kflush(acc, 0, iacc, 0, lut[d[r0, sb]] * dx)
                kflush(acc, 8, iacc, 8, lut[d[r1, sb]] * dx)
            out[m, r0] = acc[0:8].sum()
            if r0 + 1 < n:
                out[m, r0 + 1] = acc[8:16].sum()
    restore_threads(prev)


def supports(qtype: int, rows: int) -> bool:
    """Whether the backend should take `matmul` for a weight of `qtype` at `rows` rows of x
    (one row, as `qmatmul_int`: the GEMV decodes each block again per row)."""
    return qtype in KINDS and rows <= MAX_ROWS


def matmul(w: QuantMatrix, x: activations.Q8KRows, path: str | None = None) -> np.ndarray:
    """x's Q8_K blocks `[M, K]` -> `[M, N]` under the quantized semantics, W of a type in
    `KINDS`. `path` forces a SIMD path (default `isa.selected()`)."""
    kind = KINDS[w.qtype]
    m = x.qs.shape[0]
    out = np.empty((m, w.rows), np.float32)
    threads = 1 if w.rows * w.cols * m <= SERIAL_MAX_WORK else 0
    code = isa.code(path or isa.selected())
    tail = (HALF_LUT, x.qs, x.d, x.bsums, out, prefetch_rows(w), threads)
    if kind == 6:
        call(gemv_q6_k, code, kind, *w.planes, *tail)
    elif kind == 5:
        call(gemv_k45, code, kind, w.planes[1], w.planes[0], *w.planes[2:], *tail)
    else:
        call(gemv_k45, code, kind, w.planes[0], _NO_BITS, *w.planes[1:], *tail)
    return out
