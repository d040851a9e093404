"""Attention over a float16 cache as llama.cpp's CPU path computes it (flash attention off,
its default), for the quantized GGUF semantics on the numpy and cpu backends.

Per query row (ggml's non-flash graph: mul_mat, soft_max, mul_mat):
- Q rounded to float16; scores = K . Q as ggml multiplies float16 rows: a step of several
  query tokens through llamafile's tinyBLAS (16 lanes, one fused multiply-add chain per lane
  over the row, then `_mm512_reduce_add_ps`), a one-token step through `ggml_vec_dot_f16`
  (4 accumulators of 16 lanes over chunks of 64, combined, then the same reduction);
- soft_max: scores * scale, masked keys -inf, exp by `ggml_math.expf16` per 16 keys, each
  16's sum reduced in float32 and added in float64; probabilities scaled by float32(1 / sum)
  and rounded to float16;
- out = P . V in the same two orders over the context (the cache is padded to 256 cells in
  llama.cpp; the padding is zeros, which add nothing).
Keys past a sliding window are masked as llama.cpp masks them. The 16-lane orders are those
of a llama.cpp built with AVX-512 (`ggml_math.ggml_width`); bench/llamacpp_tensors.py shows
them bit for bit on llama.cpp's inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numba import prange

from vllm_actors.kernels.cpu.activations import _f16_bits
from vllm_actors.kernels.cpu.intrinsics import fma_f32
from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.ggml_math import expf16

LANES = 16
PAD = 256                    # llama.cpp's KV cells per padding step (n_kv)


class GgmlCache(NamedTuple):
    """A float16 (K, V) cache slot `[num_blocks, block_size, Hk, Dh]` (uint16 bits) that
    attention reads the llama.cpp way (`KVFormat.ggml_products`)."""

    k: np.ndarray
    v: np.ndarray


@numba.njit(inline="always", cache=True)
def _reduce16(a):  # type: ignore[no-untyped-def]
    """a[0] + ... + a[15] as GCC's `_mm512_reduce_add_ps`: halves, quarters, then pairs."""
    t0, t1, t2, t3 = a[8] + a[0], a[9] + a[1], a[10] + a[2], a[11] + a[3]
    t4, t5, t6, t7 = a[12] + a[4], a[13] + a[5], a[14] + a[6], a[15] + a[7]
    return ((t4 + t0) + (t6 + t2)) + ((t5 + t1) + (t7 + t3))


@numba.njit(inline="always", cache=True)
def _dot(x, y, n, one_token, acc):  # type: ignore[no-untyped-def]
    """x . y over n elements (x, y float32 holding float16 values; n a multiple of 16; acc
    scratch of 64): tinyBLAS's order, or `ggml_vec_dot_f16`'s for a one-token step."""
    for i in range(64):
        acc[i] = 0.0
    if not one_token:
        for s in range(0, n, LANES):
            for lane in range(LANES):
                acc[lane] = fma_f32(x[s + lane], y[s + lane], acc[lane])
        return _reduce16(acc)
    whole = n - n % 64
    for s in range(0, whole, 64):
        for j in range(64):
            acc[j] = fma_f32(x[s + j], y[s + j], acc[j])
    for lane in range(LANES):
        acc[lane] = (acc[lane] + acc[32 + lane]) + (acc[16 + lane] + acc[48 + lane])
    total = np.float64(_reduce16(acc))
    for i in range(whole, n):
        total += np.float64(x[i] * y[i])
    return np.float32(total)


@numba.njit(cache=True)
def _softmax16(s, n, lut):  # type: ignore[no-untyped-def]
    """s[:n] (n a multiple of 16) -> float16-rounded probabilities, as ggml's soft_max."""
    top = -np.inf
    for i in range(n):
        top = max(top, s[i])
    chunk = np.empty(LANES, np.float32)
    total = 0.0
    for c in range(0, n, LANES):
        for lane in range(LANES):
            chunk[lane] = expf16(np.float32(s[c + lane] - top))
            s[c + lane] = chunk[lane]
        total += np.float64(_reduce16(chunk))
    inv = np.float32(1.0 / total)
    for i in range(n):
        s[i] = _half(np.float32(s[i] * inv), lut)


@numba.njit(inline="always", cache=True)
def _half(x, lut):  # type: ignore[no-untyped-def]
    """x rounded to the nearest float16 (ties to even), as a float32."""
    return lut[_f16_bits(x)]


@kernel(parallel=True, exact=True)
def _attend(q, kc, vc, lut, token_req, token_pos, q_lens, tables, block_size, scale, window,
            out):  # type: ignore[no-untyped-def]
    t_count, heads, dh = q.shape
    hk = kc.shape[2]
    g = heads // hk
    for th in prange(t_count * heads):
        t, h = th // heads, th % heads
        r, pos, kvh = token_req[t], token_pos[t], h // g
        n = ((pos + 1 + PAD - 1) // PAD) * PAD          # llama.cpp's padded cells
        one_token = q_lens[r] == 1
        qh = np.empty(dh, np.float32)
        for d in range(dh):
            qh[d] = _half(q[t, h, d], lut)
        keys = np.zeros(dh, np.float32)
        acc = np.empty(64, np.float32)
        s = np.empty(n, np.float32)
        for j in range(n):
            if j > pos or (window > 0 and j <= pos - window):
                s[j] = -np.inf
                continue
            blk = tables[r, j // block_size]
            for d in range(dh):
                keys[d] = lut[kc[blk, j % block_size, kvh, d]]
            s[j] = np.float32(_dot(keys, qh, dh, one_token, acc) * scale)
        _softmax16(s, n, lut)
        vals = np.zeros(n, np.float32)
        for d in range(dh):
            for j in range(pos + 1):
                blk = tables[r, j // block_size]
                vals[j] = lut[vc[blk, j % block_size, kvh, d]] if s[j] != 0 else 0.0
            out[t, h, d] = _dot(vals, s, n, one_token, acc)


def reads(fmt, softcap: float, sinks) -> bool:  # type: ignore[no-untyped-def]
    """Whether attention over a cache of `fmt` takes this path: llama.cpp's products on a
    float16 cache where the host's llama.cpp is 16 lanes wide, with no soft-cap or sinks
    (those keep the backend's own attention, rounded as ggml rounds: `KVFormat`)."""
    from vllm_actors.kernels import kv_quant
    from vllm_actors.kernels.ggml_math import ggml_width
    return (fmt is not None and fmt.ggml_products and fmt.kind == kv_quant.FLOAT16
            and ggml_width() == LANES and not softcap and sinks is None)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, query_start_loc: np.ndarray,
           seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int, scale: float,
           window: int = 0) -> np.ndarray:
    """q [T, H, Dh] float32 over the float16 cache slot k, v (uint16 bits, `[num_blocks,
    block_size, Hk, Dh]`) -> [T, H, Dh], as llama.cpp computes it (module docstring)."""
    from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT
    q_lens = np.diff(query_start_loc).astype(np.int64)
    token_req = np.repeat(np.arange(len(q_lens)), q_lens)
    start = np.asarray(seq_lens, np.int64) - q_lens                  # context before the step
    token_pos = (np.arange(int(query_start_loc[-1])) - np.repeat(query_start_loc[:-1], q_lens)
                 + np.repeat(start, q_lens))
    out = np.empty(q.shape, np.float32)
    _attend(np.ascontiguousarray(q, np.float32), k, v, HALF_LUT, token_req, token_pos, q_lens,
            np.ascontiguousarray(block_tables, np.int32), block_size, np.float32(scale),
            int(window), out)
    return out
