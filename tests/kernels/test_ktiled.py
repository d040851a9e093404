"""`kernels/cpu/ktiled.py`, the K-quant matmuls of many rows of x (ggml's tiled matmul on Q4_K,
Q5_K and Q6_K, and its repacked Q4_K GEMM), against a direct computation: each weight's
integer code, scale and min unpacked from the planes with numpy, the exact integer sums in
int64, then the float epilogue of that order element by element with one rounding per fused
multiply-add. Bit for bit, on every SIMD path this host runs, with a partial chunk of weight
rows and a row count that fills no vector. `qmatmul_int_k.matmul` must send such spans there.
"""

from __future__ import annotations

from dataclasses import replace

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from quant_blocks import q6_k_codes, random_blocks

from vllm_actors.kernels.cpu import activations, isa, krow, ktiled, qmatmul, qmatmul_int_k
from vllm_actors.kernels.cpu.intrinsics import fma_f32, realign_stack
from vllm_actors.kernels.cpu.qmatmul_layout import aligned_empty
from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT, line_aligned


def _codes(w: qmatmul.QuantMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(codes [N, nsb, S, 256 / S], scales [N, nsb, S], mins [N, nsb, 8] or None): S sub-blocks
    per superblock, the codes unsigned (Q6_K's still with its offset of 32)."""
    n, nsb = w.rows, w.cols // 256
    if w.qtype == QT.Q6_K:
        codes = q6_k_codes(w.planes[0], w.planes[1]).reshape(n, nsb, 16, 16)
        return codes, w.planes[2].reshape(n, nsb, 16), None
    planes = w.planes if w.qtype == QT.Q4_K else w.planes[1:]
    qs, sc, mn = planes[0], planes[1], planes[2]
    pairs = qs.reshape(n, nsb, 4, 1, 32)
    codes = np.concatenate([pairs & 15, pairs >> 4], axis=3).reshape(n, nsb, 8, 32)
    if w.qtype == QT.Q5_K:
        qh = w.planes[0].reshape(n, nsb, 1, 32)
        codes = codes | (((qh >> np.arange(8).reshape(1, 1, 8, 1)) & 1) << 4)
    return codes, sc.reshape(n, nsb, 8), mn.reshape(n, nsb, 8)


def _integers(w: qmatmul.QuantMatrix, x: activations.Q8KRows, per: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """(totals, min sums) [N, M, nsb, 8 / per] int64: per `per` sub-blocks of 32 weights (8: a
    superblock), sum of scale * (codes . x - 32 x's sum [Q6_K]) and sum of min * x's sum."""
    codes, scales, mins = _codes(w)
    n, nsb, subs, size = codes.shape
    m = x.qs.shape[0]
    xq = x.qs.astype(np.int64).reshape(m, nsb, subs, size)
    xs = x.bsums.astype(np.int64).reshape(m, nsb, subs, -1).sum(axis=3)
    dots = np.einsum("nbsj,mbsj->nmbs", codes.astype(np.int64), xq)
    if w.qtype == QT.Q6_K:
        dots -= 32 * xs[None]
    totals = (dots * scales.astype(np.int64)[:, None]).reshape(n, m, nsb, -1, subs * per // 8)
    if mins is None:
        return totals.sum(axis=4), np.zeros_like(totals.sum(axis=4))
    min_sums = (mins.astype(np.int64)[:, None] * xs[None]).reshape(n, m, nsb, -1, per)
    return totals.sum(axis=4), min_sums.sum(axis=4)


@numba.njit(cache=True)
def _epilogue(gemm, totals, mins, dw, dm, dx):  # type: ignore[no-untyped-def]
    """out[M, N] from the integers: TILED acc = fma(fnmadd(dmin, mins, total * d), d_x, acc)
    per superblock; the repacked kernels (`gemm`) acc = fma(total, d d_x, acc), am =
    fma(mins, dmin d_x, am) per part (a pair of sub-blocks, or a superblock), acc - am."""
    n, m, nsb, parts = totals.shape
    out = np.zeros((m, n), np.float32)
    for i in range(n):
        for j in range(m):
            acc, am = np.float32(0.0), np.float32(0.0)
            for b in range(nsb):
                for p in range(parts):
                    t, s = np.float32(totals[i, j, b, p]), np.float32(mins[i, j, b, p])
                    if gemm:
                        acc = fma_f32(t, np.float32(dw[i, b] * dx[j, b]), acc)
                        am = fma_f32(s, np.float32(dm[i, b] * dx[j, b]), am)
                    else:
                        r = fma_f32(-dm[i, b], s, np.float32(t * dw[i, b]))
                        acc = fma_f32(r, dx[j, b], acc)
            out[j, i] = acc - am if gemm else acc
    return out


def _direct(w: qmatmul.QuantMatrix, x: activations.Q8KRows, order: int) -> np.ndarray:
    gemm = order != ktiled.TILED          # the repacked kernels' epilogue
    totals, mins = _integers(w, x, 2 if order == ktiled.GEMM else 8)
    d_plane = w.planes[3] if w.qtype == QT.Q6_K else w.planes[-2]
    dw = HALF_LUT[d_plane]
    dm = HALF_LUT[w.planes[-1]] if w.qtype != QT.Q6_K else np.zeros_like(dw)
    return _epilogue(gemm, totals, mins, dw, dm, x.d)


@pytest.mark.parametrize("qtype, order", [(QT.Q4_K, ktiled.TILED), (QT.Q5_K, ktiled.TILED),
                                          (QT.Q6_K, ktiled.TILED), (QT.Q4_K, ktiled.GEMM),
                                          (QT.Q4_K, ktiled.GEMV)])
def test_equals_the_direct_computation_on_every_path(qtype, order):
    rng = np.random.default_rng(int(qtype) + 10 * order)
    n, k, m = 37, 512, 19                  # 37 rows: two full chunks of 16 and a partial one
    w = qmatmul.pack(random_blocks(qtype, n, k, rng), qtype, (n, k))
    for plane in w.planes[:1 if qtype == QT.Q4_K else 2]:    # 16 rows of the largest codes
        plane[:16] = 0xFF
    xf = (rng.standard_normal((m, k)) * 4).astype(np.float32)
    xf[0] = -2.5                        # against them, the largest integer sums (AVX2's int16)
    x = activations.quantize_q8_k(xf)
    assert (x.qs[0] == -127).all()
    want = _direct(w, x, order)
    for path in isa.available():
        got = ktiled.matmul(w, x, order, path)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), path
    if "avx2" in isa.available():      # where llama.cpp runs these kernels, so do we:
        # a request of 19 rows (the repacked GEMM on 16 of them), or 19 one-row requests
        repacked = replace(w, ggml_repacked=order != ktiled.TILED)
        requests = np.ones(m, np.int64) if order == ktiled.GEMV else np.array([m])
        got = qmatmul_int_k.matmul(repacked, x, requests=requests)
        if order == ktiled.GEMM:
            got, want = got[:16], want[:16]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_one_row_in_registers_equals_the_direct_computation():
    """`krow`, a decode step's rows (1 to `krow.MAX_ROWS`) against a repacked Q4_K (the
    GEMV's order) whose rows `qmatmul.interleave` stored 16 to a vector, 16 weight rows
    decoded in registers; x quantized inside the call or before it, with a zero row and a
    superblock of ties at the largest quant against rows of codes 15 (the largest integer
    sums, which AVX2 keeps in int16 until a sub-block ends). The interleaved bytes are where
    the layout says, on a cache line."""
    rng = np.random.default_rng(44)
    n, k = 48, 512
    stored = replace(qmatmul.pack(random_blocks(QT.Q4_K, n, k, rng), QT.Q4_K, (n, k)),
                     ggml_repacked=True)
    stored.planes[0][:16] = 0xFF    # every code 15: against x's row of ties, the largest sums
    w = qmatmul.interleave(stored)
    assert w.interleaved and all(p.ctypes.data % 64 == 0 for p in w.planes)
    nsb = k // 256
    r, sb, word = rng.integers(0, n, 64), rng.integers(0, nsb, 64), rng.integers(0, 32, 64)
    at = 2048 * (r // 16 * nsb + sb) + 64 * word + 4 * (r % 16)
    assert np.array_equal(w.planes[0].reshape(-1)[at], stored.planes[0][r, 128 * sb + 4 * word])
    sub = word % 8          # a scale or min, and d and dmin: 16 rows side by side
    at = 8 * (r // 16 * 16 * nsb + 16 * sb) + 64 * (sub // 4) + 4 * (r % 16) + sub % 4
    for i in (1, 2):
        assert np.array_equal(w.planes[i].reshape(-1)[at], stored.planes[i][r, 8 * sb + sub])
    at = r // 16 * 16 * nsb + 16 * sb + r % 16
    for i in (3, 4):
        assert np.array_equal(w.planes[i].reshape(-1)[at], stored.planes[i][r, sb])
    assert qmatmul.interleave(replace(stored, ggml_repacked=False)).interleaved is False
    xf = (rng.standard_normal((3, k)) * 4).astype(np.float32)
    xf[1], xf[2, :256] = 0.0, -2.5
    want = _direct(stored, activations.quantize_q8_k(xf), ktiled.GEMV)
    for path in isa.available():
        for rows in (slice(0, 1), slice(1, 2), slice(2, 3), slice(0, 3)):   # 1 and 3 rows
            for got in (krow.matmul(w, floats=xf[rows], path=path),
                        krow.matmul(w, activations.quantize_q8_k(xf[rows]), path=path)):
                assert np.array_equal(got.view(np.uint32), want[rows].view(np.uint32)), path
        for order in (ktiled.GEMV, ktiled.GEMM):      # the many-row kernels on that layout
            many = ktiled.matmul(w, activations.quantize_q8_k(xf), order, path)
            assert np.array_equal(many, ktiled.matmul(stored, activations.quantize_q8_k(xf),
                                                      order, path)), path
        assert np.array_equal(many[:, :3].view(np.uint32), _direct(
            stored, activations.quantize_q8_k(xf), ktiled.GEMM)[:, :3].view(np.uint32))
    both = qmatmul.concat([w, w])       # fused parts keep the layout and the order
    assert both.interleaved and both.ggml_repacked
    assert np.array_equal(krow.matmul(both, floats=xf[:1]), np.concatenate([want[:1]] * 2, 1))
    if "avx2" in isa.available():      # the decode step's linears go there, at every count
        got = qmatmul_int_k.matmul_float(w, xf[:1])
        assert np.array_equal(got[0].view(np.uint32), want[0].view(np.uint32))
        assert ("krow", isa.selected_code(), 1) in w.memo
        xf5 = np.concatenate([xf, xf[:2]])
        for m in (3, krow.MAX_ROWS, krow.MAX_ROWS + 1):      # `krow`, then `ktiled`
            got = qmatmul_int_k.matmul_float(w, xf5[:m], requests=np.ones(m, np.int64))
            assert np.array_equal(got, want[[0, 1, 2, 0, 1][:m]])
        five = activations.quantize_q8_k(np.concatenate([xf, xf[:2]]))
        assert np.array_equal(qmatmul_int_k.matmul(w, five, requests=[4, 1]),
                              qmatmul_int_k.matmul(stored, five, requests=[4, 1]))
        assert qmatmul_int_k.matmul_float_lora(w, xf[:1], None, False) is None
        with pytest.raises(ValueError, match="interleaved"):
            krow.matmul(stored, floats=xf[:1])


@numba.njit
def _scratch_offset(n):  # type: ignore[no-untyped-def]
    a = line_aligned(n, np.int32)
    return a.ctypes.data % 64, a.size


@numba.njit
def _realigned():  # type: ignore[no-untyped-def]
    realign_stack()


def test_outputs_and_scratch_start_on_a_cache_line():
    """The many-row kernels load and store their outputs and scratch as 64-byte vectors:
    numpy's arrays start 16 bytes into a line and numba's 32 as often as not, and each such
    access then touched two lines; a body's vector spills likewise, unless it realigns its
    stack (`intrinsics.realign_stack`)."""
    rng = np.random.default_rng(3)
    for shape, dtype in (((3, 5), np.float32), ((1000,), np.int16)):
        a = aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.ctypes.data % 64 == 0
    for n in (1, 100, 4096):
        assert _scratch_offset(n) == (0, n)
    w = replace(qmatmul.pack(random_blocks(QT.Q4_K, 32, 256, rng), QT.Q4_K, (32, 256)),
                ggml_repacked=True)
    xf = rng.standard_normal((2, 256)).astype(np.float32)
    assert ktiled.matmul(w, activations.quantize_q8_k(xf), ktiled.GEMM).ctypes.data % 64 == 0
    _realigned()
    assert '"stackrealign"' in _realigned.inspect_llvm(_realigned.signatures[0])
