"""What the llama.cpp-order attention's work items share, at either width (16 lanes:
`ggml_attention`, 8: `ggml_attention8`): float16 cache cells read as float32, floats rounded
to float16, the row max and soft_max's first pass, each key's place in a cache slot, the
query tile, and the C signature of a work item's callback."""

from __future__ import annotations

import numba
import numpy as np
from numba import types

from vllm_actors.kernels.cpu.activations import _round_half
from vllm_actors.kernels.cpu.attention_math import half_to_f32
from vllm_actors.kernels.cpu.intrinsics import (
    HARDWARE_HALF,
    bits_to_f32,
    f32_to_bits,
    hardware_half_to_f32,
    stack_f32,
)
from vllm_actors.kernels.ggml_math import NORMAL_HIGH, NORMAL_LOW

LANES = 16                   # the row max's select lanes
_MIN_NORMAL_F16 = np.float32(2.0 ** -14)
TILE = 32                    # query tokens scored together (their K and V rows decoded once)

if HARDWARE_HALF:
    @numba.njit(inline="always", cache=True)
    def _cell(h):  # type: ignore[no-untyped-def]
        """A cache cell's float16 bits -> float32, in hardware: a loop of them vectorizes."""
        return hardware_half_to_f32(h)
else:
    _cell = half_to_f32


@numba.njit(inline="always", cache=True)
def _row_max(s, n):  # type: ignore[no-untyped-def]
    """max(s[:n]) (n a multiple of 16) by a select in 16 lanes, then across them (a select
    keeps NaNs out as the one-lane loop did; which zero a tie of +0 and -0 keeps changes no
    x - max's exp)."""
    lanes = stack_f32(LANES)
    for lane in range(LANES):
        lanes[lane] = -np.inf
    for c in range(0, n, LANES):
        for lane in range(LANES):
            v = s[c + lane]
            lanes[lane] = v if v > lanes[lane] else lanes[lane]
    top = np.float32(-np.inf)
    for lane in range(LANES):
        v = lanes[lane]
        top = v if v > top else top
    return top


@numba.njit(inline="always", cache=True)
def shifted_exps(s, n, e, exp_normal):  # type: ignore[no-untyped-def]
    """soft_max's first pass over s[:n] (n a multiple of 16): s - max(s) in float32 into s,
    `exp_normal` of it (a branch-free exp of one width's `ggml_v_expf` over its normal range)
    into e, as one loop LLVM vectorizes; returns (first, last), where the elements outside
    that range lie (last -1: none), for the caller to redo."""
    top = _row_max(s, n)
    # tracked in int32 (int64 lanes, half as many a vector, made it cost more than the exp)
    first, last, none = np.int32(n), np.int32(-1), np.int32(n)
    for i in range(n):
        x = np.float32(s[i] - top)
        s[i] = x
        e[i] = exp_normal(x)
        outside = not NORMAL_LOW <= x <= NORMAL_HIGH
        first = min(first, np.int32(i) if outside else none)
        last = max(last, np.int32(i) if outside else np.int32(-1))
    return first, last


@numba.njit(inline="always", cache=True)
def _half_unit(x):  # type: ignore[no-untyped-def]
    """x in [0, 1] rounded to the nearest float16 (ties to even), as a float32, without a
    branch (a loop of them vectorizes): below 2^-14, float16's subnormal step 2^-24 is
    float32's step at 0.5, so adding and taking off 0.5 rounds there; above, the mantissa
    is rounded to 10 bits on the integer bits."""
    b = f32_to_bits(x)
    normal = bits_to_f32((b + np.uint32(0xFFF) + ((b >> np.uint32(13)) & np.uint32(1)))
                         & np.uint32(0xFFFFE000))
    tiny = np.float32(np.float32(x + np.float32(0.5)) - np.float32(0.5))
    return tiny if x < _MIN_NORMAL_F16 else normal


@numba.njit(inline="always", cache=True)
def _half(x, lut):  # type: ignore[no-untyped-def]
    """x rounded to the nearest float16 (ties to even), as a float32: F16C's conversions
    where the CPU has them (a query row's loop vectorizes; the table's lookups came from
    L2, 1.3 ms of a 512-token Gemma layer on one thread), else the bits and the table."""
    return _round_half(x, lut)


@numba.njit(cache=True)
def _key_offsets(table, block_size, cells, hk, dh, kvh, last, koff):  # type: ignore[no-untyped-def]
    """koff[j] = where key j's row of KV head kvh starts in a flat cache slot `[num_blocks,
    cells, Hk, Dh]`, for keys j <= last: found once a work item, block by block (no
    division a key, where the scores and values had two)."""
    j = 0
    while j <= last:
        base = (table[j // block_size] * cells * hk + kvh) * dh
        for c in range(min(block_size, last + 1 - j)):
            koff[j + c] = base + c * hk * dh
        j += block_size


_F32P, _U16P, _I64P = (types.CPointer(t) for t in (types.float32, types.uint16, types.int64))
_I64 = types.int64
# A work item's arguments: q and its shape; the K and V cache slots and their shape; the float16
# table; query starts, lengths, context before the step, requests; block tables and their
# width; block size, scale, window; the item (request, KV head, first token); out
_ITEM_ARGS = (_F32P, _I64, _I64, _I64, _U16P, _U16P, _I64, _I64, _I64, _F32P, _I64P, _I64P,
              _I64P, _I64, types.CPointer(types.int32), _I64, _I64, types.float32, _I64,
              _I64, _I64, _I64, _F32P)
