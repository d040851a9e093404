"""The float semantics' weight types as codecs, so that each many-row matmul driver
(`qmatmul_multi`, `qmatmul_fused`, `qmatmul_gemm`) is written once for every type.

A `Codec` is a compile-time marker (numba types each as its own `CodecType`) whose overloads
give a driver the type's code when it compiles:
- `decode_block(codec, planes, lut, row, b, w, wi, ahead)`: block b (32 columns) of weight
  `row` as floats at w[wi:] (w = d q + m, `qmatmul_simd`'s 8-lane decoders), the same block
  of row `ahead` hinted into L2; inlined, each decoder one straight run (the hint rides in
  it: an overload of its own lengthened the multi-row GEMV's compile).
- `weight_tile(codec, planes, lut, a, b, k, run)`: rows [a, b) as float32 (the rows kernel
  into a new tile; F32's rows themselves); a call, once a tile.
`planes` is the tuple the rows kernel takes (`qmatmul._kernel_args(w, rows=True)`). Types
sharing a rows kernel share one GEMM (`Codec.tiles`) but decode apart: a decoder that chose
at run time warned at every compile or ran slower (docs/BENCHMARKS.md, "The float
semantics' many-row drivers written once").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import types
from numba.extending import (NativeValue, models, overload, register_model, typeof_impl,
                             unbox)

from vllm_actors.kernels.cpu.jit import JIT_OPTIONS
from vllm_actors.kernels.cpu.qmatmul_float import gemv_f32, gemv_half, rows_f32, rows_half
from vllm_actors.kernels.cpu.qmatmul_k23 import gemv_q2_k, gemv_q3_k, rows_q2_k, rows_q3_k
from vllm_actors.kernels.cpu.qmatmul_k45 import (gemv_q4_k, gemv_q5_k, gemv_q6_k, rows_q6_k,
                                                 rows_q45_k)
from vllm_actors.kernels.cpu.qmatmul_legacy import (gemv_q4, gemv_q5, gemv_q8_0, rows_q4,
                                                    rows_q5, rows_q8_0)
from vllm_actors.kernels.cpu.qmatmul_prims import prefetch
from vllm_actors.kernels.cpu.qmatmul_simd import vbits, vi8, vnib, vq5


class Codec:
    """A weight type's kernels: `rows` (rows dequantized, `qmatmul.take_rows` and the GEMM's
    tiles), `gemv` (one row of x), and `tiles`, the codec the GEMM compiles for (one of the
    types sharing its rows kernel, so that they share one compile). Codecs are kept by name
    (`NAMED`), which is all the overloads see."""

    def __init__(self, name: str, rows: Callable[..., None], gemv: Callable[..., None],
                 tiles: "Codec | None" = None) -> None:
        self.name, self.rows, self.gemv = name, rows, gemv
        self.tiles = tiles or self
        NAMED[name] = self

    @property
    def blocks(self) -> bool:
        """Whether `decode_block` serves this type (the multi-row GEMV, the fused GEMM)."""
        return self.name in _DECODERS

    def __repr__(self) -> str:
        return f"Codec({self.name})"


class CodecType(types.Dummy):
    """numba's type of one `Codec`: the overloads choose their code by `name`."""

    def __init__(self, name: str) -> None:
        self.codec_name = name
        super().__init__(name=f"Codec({name})")


@typeof_impl.register(Codec)
def _typeof_codec(val: Codec, c: Any) -> CodecType:
    return CodecType(val.name)


register_model(CodecType)(models.OpaqueModel)


@unbox(CodecType)
def _unbox_codec(typ: CodecType, obj: Any, c: Any) -> NativeValue:
    return NativeValue(c.context.get_dummy_value())


NAMED: dict[str, Codec] = {}
F32 = Codec("f32", rows_f32, gemv_f32)
HALF = Codec("half", rows_half, gemv_half)
Q4_0 = Codec("q4_0", rows_q4, gemv_q4)          # Q4_0/Q4_1, Q5_0/Q5_1: one rows and GEMV
Q4_1 = Codec("q4_1", rows_q4, gemv_q4, Q4_0)    # kernel each, told apart by an empty mins
Q5_0 = Codec("q5_0", rows_q5, gemv_q5)          # plane; decoders of their own
Q5_1 = Codec("q5_1", rows_q5, gemv_q5, Q5_0)
Q8_0 = Codec("q8_0", rows_q8_0, gemv_q8_0)
Q2_K = Codec("q2_k", rows_q2_k, gemv_q2_k)
Q3_K = Codec("q3_k", rows_q3_k, gemv_q3_k)
Q4_K = Codec("q4_k", rows_q45_k, gemv_q4_k)     # Q4_K/Q5_K: one rows kernel, told apart by
Q5_K = Codec("q5_k", rows_q45_k, gemv_q5_k, Q4_K)   # an empty plane of fifth bits
Q6_K = Codec("q6_k", rows_q6_k, gemv_q6_k)


def _name(codec: Any) -> str | None:
    return codec.codec_name if isinstance(codec, CodecType) else None


def decode_block(codec, planes, lut, row, b, w, wi, ahead):  # type: ignore[no-untyped-def]
    """Block b of weight `row` as 32 float32 weights at w[wi:] (the overloads below)."""


def weight_tile(codec, planes, lut, a, b, k, run):  # type: ignore[no-untyped-def]
    """Weight rows [a, b) as float32 `[b - a, k]` (the overloads below)."""


@overload(decode_block, inline="always", jit_options=JIT_OPTIONS)
def _decode_block(codec, planes, lut, row, b, w, wi, ahead):  # type: ignore[no-untyped-def]
    """The codec's decoder below (each one straight run: a decoder that chose among values
    at run time made numba's inlining warn at every compile, one calling a helper compiled
    slower)."""
    return _DECODERS.get(_name(codec))


def _q4_0(codec, planes, lut, row, b, w, wi, ahead):  # type: ignore[no-untyped-def]
    """w = d (q - 8), the block's 16 bytes low nibbles first."""
    qs, d, _ = planes
    q = row * qs.shape[1] + 16 * b
    prefetch(qs, q + (ahead - row) * qs.shape[1])
    dv = lut[d[row, b]]
    mv = np.float32(-8) * dv
    for c in range(4):
        vnib(w, wi + 8 * c, qs, q + 8 * (c & 1), 4 * (c >> 1), dv, mv)


def _q4_1(codec, planes, lut, row, b, w, wi, ahead):  # type: ignore[no-untyped-def]
    """w = d q + m."""
    qs, d, mn = planes
    q = row * qs.shape[1] + 16 * b
    prefetch(qs, q + (ahead - row) * qs.shape[1])
    dv = lut[d[row, b]]
    mv = lut[mn[row, b]]
    for c in range(4):
        vnib(w, wi + 8 * c, qs, q + 8 * (c & 1), 4 * (c >> 1), dv, mv)


def _q5_0(codec, planes, lut, row, b, w, wi, ahead):  # type: ignore[no-untyped-def]
    """w = d (q - 16); bit j of qh[row, b] is element j's fifth."""
    qs, qh, d, _ = planes
    q = row * qs.shape[1] + 16 * b
    prefetch(qs, q + (ahead - row) * qs.shape[1])
    dv = lut[d[row, b]]
    mv = np.float32(-16) * dv
    h = qh[row, b]
    for c in range(4):
        vq5(w, wi + 8 * c, qs, q + 8 * (c & 1), 4 * (c >> 1), h, 8 * c, dv, mv)


def _q5_1(codec, planes, lut, row, b, w, wi, ahead):  # type: ignore[no-untyped-def]
    """w = d q + m."""
    qs, qh, d, mn = planes
    q = row * qs.shape[1] + 16 * b
    prefetch(qs, q + (ahead - row) * qs.shape[1])
    dv = lut[d[row, b]]
    mv = lut[mn[row, b]]
    h = qh[row, b]
    for c in range(4):
        vq5(w, wi + 8 * c, qs, q + 8 * (c & 1), 4 * (c >> 1), h, 8 * c, dv, mv)


def _q8_0(codec, planes, lut, row, b, w, wi, ahead):  # type: ignore[no-untyped-def]
    qs, d = planes
    q = row * qs.shape[1] + 32 * b
    prefetch(qs, q + (ahead - row) * qs.shape[1])
    dv = lut[d[row, b]]
    for c in range(4):
        vi8(w, wi + 8 * c, qs, q + 8 * c, dv)


def _q4_k(codec, planes, lut, row, b, w, wi, ahead):  # type: ignore[no-untyped-def]
    """Block b is sub-block b % 8 of superblock b // 8: w = d sc q - dmin mn, q the low (b
    even) or high (b odd) nibbles of qs[128 (b // 8) + 32 ((b % 8) // 2) ..]."""
    _, qs, sc, mn, d, dmin = planes
    sb = b >> 3
    q = row * qs.shape[1] + 128 * sb + 32 * ((b & 7) >> 1)
    prefetch(qs, q + (ahead - row) * qs.shape[1])
    scale = lut[d[row, sb]] * np.float32(sc[row, b])
    low = -(lut[dmin[row, sb]] * np.float32(mn[row, b]))
    for c in range(4):
        vnib(w, wi + 8 * c, qs, q + 8 * c, 4 * (b & 1), scale, low)


def _q5_k(codec, planes, lut, row, b, w, wi, ahead):  # type: ignore[no-untyped-def]
    """Q4_K's nibbles, with bit b % 8 of qh[32 (b // 8) + i] as weight i's fifth."""
    qh, qs, sc, mn, d, dmin = planes
    sb = b >> 3
    q = row * qs.shape[1] + 128 * sb + 32 * ((b & 7) >> 1)
    prefetch(qs, q + (ahead - row) * qs.shape[1])
    h = row * qh.shape[1] + 32 * sb
    scale = lut[d[row, sb]] * np.float32(sc[row, b])
    low = -(lut[dmin[row, sb]] * np.float32(mn[row, b]))
    for c in range(4):
        vbits(w, wi + 8 * c, qs, q + 8 * c, 4 * (b & 1), qh, h + 8 * c, b & 7, 1, scale, low)


def _q6_k(codec, planes, lut, row, b, w, wi, ahead):  # type: ignore[no-untyped-def]
    """With h = (b // 4) % 2 and j = b % 4, weight i of block b is d scales[16 (b // 8) +
    8 h + 2 j + i // 16] (q - 32), q = nibble j // 2 of ql[128 (b // 8) + 64 h + 32 (j % 2)
    + i] | ((qh[64 (b // 8) + 32 h + i] >> 2 j) & 3) << 4."""
    ql, qh, scales, d = planes
    sb = b >> 3
    h = (b >> 2) & 1
    j = b & 3
    lq = row * ql.shape[1] + 128 * sb + 64 * h + 32 * (j & 1)
    prefetch(ql, lq + (ahead - row) * ql.shape[1])
    hq = row * qh.shape[1] + 64 * sb + 32 * h
    s = 16 * sb + 8 * h + 2 * j
    dv = lut[d[row, sb]]
    sa = dv * np.float32(scales[row, s])          # weights 0-15 of the block
    sz = dv * np.float32(scales[row, s + 1])      # weights 16-31
    ba = np.float32(-32) * sa
    bz = np.float32(-32) * sz
    ls = 4 * (j >> 1)
    vbits(w, wi, ql, lq, ls, qh, hq, 2 * j, 3, sa, ba)
    vbits(w, wi + 8, ql, lq + 8, ls, qh, hq + 8, 2 * j, 3, sa, ba)
    vbits(w, wi + 16, ql, lq + 16, ls, qh, hq + 16, 2 * j, 3, sz, bz)
    vbits(w, wi + 24, ql, lq + 24, ls, qh, hq + 24, 2 * j, 3, sz, bz)


_DECODERS = {"q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0,
             "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


@overload(weight_tile, jit_options=JIT_OPTIONS)
def _weight_tile(codec, planes, lut, a, b, k, run):  # type: ignore[no-untyped-def]
    name = _name(codec)
    if name == "f32":
        def impl(codec, planes, lut, a, b, k, run):  # type: ignore[no-untyped-def]
            return planes[0][a:b]
        return impl
    if name not in NAMED:
        return None
    rows = NAMED[name].rows

    def tile(codec, planes, lut, a, b, k, run):  # type: ignore[no-untyped-def]
        buf = np.empty((b - a, k), dtype=np.float32)
        rows(*planes, lut, np.arange(a, b), buf, run)
        return buf
    return tile

