"""`kernels/cpu/krow6.py`, a decode step's Q6_K linear on weights stored 16 rows interleaved,
against a direct computation of ggml's `vec_dot_q6_K_q8_K` (its AVX2 form): each weight's
6-bit code and scale unpacked from the stored planes with numpy, the 8 integer lanes of a
superblock in int64, then acc_t = fma(d_w d_x, lane t, acc_t) with one rounding and the 8
lanes added as `hsum_float_8` adds them. Bit for bit on every SIMD path this host runs, for
row counts that fill one pass of 4 rows of x, leave 1 to 3 over, or both; and the interleaved
layout through the other K-quant kernels (ggml's tiled matmul at 8+ rows, a step mixing
both), which must give what they give on the stored rows.
"""

from __future__ import annotations

import numba
import numpy as np
from gguf import GGMLQuantizationType as QT
from quant_blocks import q6_k_codes, random_blocks

from vllm_actors.kernels.cpu import activations, isa, krow, ktiled, qmatmul, qmatmul_int_k
from vllm_actors.kernels.cpu.intrinsics import fma_f32


@numba.njit(cache=True)
def _epilogue(lanes, dwx, out):  # type: ignore[no-untyped-def]
    """lanes [M, N, nsb, 8] int64, dwx [M, N, nsb] float32 -> out [M, N]: ggml's float epilogue."""
    m, n, nsb, _ = lanes.shape
    for i in range(m):
        for r in range(n):
            acc = np.zeros(8, np.float32)
            for sb in range(nsb):
                for t in range(8):
                    acc[t] = fma_f32(dwx[i, r, sb], np.float32(lanes[i, r, sb, t]), acc[t])
            out[i, r] = ((acc[4] + acc[0]) + (acc[6] + acc[2])) + ((acc[5] + acc[1])
                                                                 + (acc[7] + acc[3]))


def _vec_dot(w: qmatmul.QuantMatrix, x: activations.Q8KRows) -> np.ndarray:
    n, nsb, m = w.rows, w.cols // 256, x.qs.shape[0]
    codes = q6_k_codes(w.planes[0], w.planes[1]).astype(np.int64).reshape(n, nsb, 8, 8, 4)
    scales = w.planes[2].astype(np.int64).reshape(n, nsb, 8, 2)   # s_(2c + h)
    xq = x.qs.astype(np.int64).reshape(m, nsb, 8, 8, 4)
    dots = np.einsum("nbctu,mbctu->mnbct", codes, xq)
    main = (dots * scales[None, :, :, :, np.arange(8) // 4]).sum(axis=3)
    b = x.bsums.astype(np.int64).reshape(m, 1, nsb, 8, 2)
    lanes = main - 32 * (scales.reshape(1, n, nsb, 8, 2) * b).sum(axis=4)
    dw = w.planes[3].view(np.float16).astype(np.float32)
    dwx = (dw[None] * x.d[:, None, :]).astype(np.float32)
    out = np.empty((m, n), np.float32)
    _epilogue(lanes, dwx, out)
    return out


def test_one_row_requests_equal_vec_dot_on_every_path():
    """Row counts 1 .. 7 (one pass of 4, then 1 to 3 over), x quantized before the call or
    inside it, with a zero row and a superblock of ties; and the layout where it says."""
    rng = np.random.default_rng(66)
    n, k = 48, 512
    stored = qmatmul.pack(random_blocks(QT.Q6_K, n, k, rng), QT.Q6_K, (n, k))
    w = qmatmul.interleave(stored)
    assert w.interleaved and all(p.ctypes.data % 64 == 0 for p in w.planes)
    assert not qmatmul.interleave(stored, integer=False).interleaved
    r, sb, word = rng.integers(0, n, 64), rng.integers(0, 2, 64), rng.integers(0, 16, 64)
    at = 1024 * (r // 16 * 2 + sb) + 64 * word + 4 * (r % 16)
    assert np.array_equal(w.planes[1].reshape(-1)[at], stored.planes[1][r, 64 * sb + 4 * word])
    at = 256 * (r // 16 * 2 + sb) + 64 * (word // 4) + 4 * (r % 16) + word % 4
    assert np.array_equal(w.planes[2].reshape(-1)[at], stored.planes[2][r, 16 * sb + word])
    at = 32 * (r // 16) + 16 * sb + r % 16
    assert np.array_equal(w.planes[3].reshape(-1)[at], stored.planes[3][r, sb])
    xf = (rng.standard_normal((7, k)) * 4).astype(np.float32)
    xf[1], xf[2, :256] = 0.0, -2.5
    xq = activations.quantize_q8_k(xf)
    want = _vec_dot(stored, xq)
    for path in isa.available():
        for m in range(1, 8):
            got = krow.matmul(w, activations.quantize_q8_k(xf[:m]), path=path)
            assert np.array_equal(got.view(np.uint32), want[:m].view(np.uint32)), (path, m)
        got = qmatmul_int_k.matmul_float(w, xf, path, np.ones(7, np.int64))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), path


def test_the_other_kernels_read_the_interleaved_rows():
    """ggml's tiled matmul (a request of 9 rows) and a step of requests of 1, 2 and 9 rows
    give on the interleaved layout what they give on the stored rows. On the host's path
    only: reading the layout does not depend on the path (`ktiled.decode_interleaved_q6_k`,
    `widen_interleaved`), and what follows is `test_ktiled.py`'s on every path."""
    rng = np.random.default_rng(67)
    n, k = 32, 512
    stored = qmatmul.pack(random_blocks(QT.Q6_K, n, k, rng), QT.Q6_K, (n, k))
    w = qmatmul.interleave(stored)
    xq = activations.quantize_q8_k((rng.standard_normal((12, k)) * 4).astype(np.float32))
    nine = activations.Q8KRows(xq.qs[:9], xq.d[:9], xq.bsums[:9])
    requests = np.array([1, 2, 9])
    want = ktiled.matmul(stored, nine, ktiled.TILED)
    got = ktiled.matmul(w, nine, ktiled.TILED)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    want = qmatmul_int_k.matmul(stored, xq, requests=requests)
    got = qmatmul_int_k.matmul(w, xq, requests=requests)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
