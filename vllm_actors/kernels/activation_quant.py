"""The activation formats of llama.cpp's CPU semantics (`--gguf-activations quantized`): each
matmul input is quantized per block in the format its weight type pairs with (ggml-cpu's
`vec_dot_type`: Q8_0, Q8_1, Q8_K, or rounded to F16/BF16), byte for byte as ggml's x86 build
writes it (`tests/golden/ggml_quant.npz`). The numpy reference of every backend.

`simulate` gives what a block dot sees, x~ = d_x * q_x, so float kernels compute the semantics
up to summation order; Q4_1/Q5_1 add min . (s - sum x~), since their min multiplies Q8_1's
float16 sum s (ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

T = GGMLQuantizationType

# weight type -> the activation format its dot product takes (ggml-cpu's vec_dot_type)
ACTIVATION_FORMAT: dict[int, str] = {
    T.Q4_0: "q8_0", T.Q5_0: "q8_0", T.Q8_0: "q8_0", T.IQ4_NL: "q8_0",
    T.Q4_1: "q8_1", T.Q5_1: "q8_1",
    T.Q2_K: "q8_k", T.Q3_K: "q8_k", T.Q4_K: "q8_k", T.Q5_K: "q8_k", T.Q6_K: "q8_k",
    T.F16: "f16", T.BF16: "bf16",
}
_F127 = np.float32(127.0)


def activation_format(qtype: int | None) -> str | None:
    """The format a weight of `qtype` takes its inputs in under the quantized semantics;
    None for float32 inputs (F32 weights, and types we convert: see `kernels.cpu.qmatmul`)."""
    return None if qtype is None else ACTIVATION_FORMAT.get(int(qtype))


@dataclass(frozen=True)
class Q8Blocks:
    """One format's blocks of rows `[M, K]`: `q` int8 `[M, nb, B]`, `d` float32 `[M, nb]`
    (the stored scale, float16-rounded for Q8_0/Q8_1), `s` float32 `[M, nb]` (Q8_1's stored
    sum, float16-rounded; else None), `bsums` int16 `[M, nb, 16]` (Q8_K; else None)."""

    fmt: str
    q: np.ndarray
    d: np.ndarray
    s: np.ndarray | None = None
    bsums: np.ndarray | None = None

    def to_bytes(self) -> np.ndarray:
        """The blocks as ggml stores them (uint8 `[M, nb * block bytes]`)."""
        m, nb, _ = self.q.shape
        parts: list[np.ndarray]
        if self.fmt == "q8_k":
            parts = [self.d.astype(np.float32)[..., None].view(np.uint8),
                     self.q.view(np.uint8), self.bsums.view(np.uint8)]
        else:
            parts = [self.d.astype(np.float16)[..., None].view(np.uint8)]
            if self.s is not None:
                parts.append(self.s.astype(np.float16)[..., None].view(np.uint8))
            parts.append(self.q.view(np.uint8))
        return np.concatenate(parts, axis=-1).reshape(m, -1)


def _blocks(x: np.ndarray, size: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % size:
        raise ValueError(f"activations [M, K] with K a multiple of {size}, got {x.shape}")
    return x.reshape(x.shape[0], -1, size)


def quantize_q8_0(x: np.ndarray, with_sum: bool = False) -> Q8Blocks:
    """Q8_0 (Q8_1 with `with_sum`) blocks of 32 of x `[M, K]`, as ggml's AVX path: d = amax /
    127 stored as float16, q = rint(x * 127 / amax) (ties to even); Q8_1's s = float16(d32 *
    sum(q)) with the float32 d."""
    xb = _blocks(x, 32)
    amax = np.abs(xb).max(axis=-1)
    d32 = amax / _F127
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = np.where(amax != 0, _F127 / amax, np.float32(0)).astype(np.float32)
        scaled = np.rint(xb * inv[..., None])
    # cvtps_epi32 gives INT_MIN for what no int32 holds (inf, NaN: an all-subnormal block,
    # whose 127 / amax overflows), and the saturating packs make it -128
    scaled = np.where(np.abs(scaled) < 2.0**31, scaled, -(2.0**31))
    q = np.clip(scaled, -128, 127).astype(np.int8)
    with np.errstate(over="ignore"):
        d = d32.astype(np.float16).astype(np.float32)
    s = None
    if with_sum:   # summed before the packs saturate, in wrapping int32, as ggml does
        total = scaled.astype(np.int64).sum(axis=-1).astype(np.uint32).view(np.int32)
        with np.errstate(over="ignore"):
            s = (d32 * total.astype(np.float32)).astype(np.float16).astype(np.float32)
    return Q8Blocks("q8_1" if with_sum else "q8_0", q, d, s)


def quantize_q8_k(x: np.ndarray) -> Q8Blocks:
    """Q8_K blocks of 256 of x `[M, K]`, as ggml's `quantize_row_q8_K_ref` (what x86 runs):
    the first element of largest magnitude, sign kept, gives iscale = -127 / max; q = min(127,
    rint(iscale * x)); d = 1 / iscale in float32; int16 `bsums` of every 16 quants."""
    xb = _blocks(x, 256)
    first = np.abs(xb).argmax(axis=-1)                  # the first of equal magnitudes
    peak = np.take_along_axis(xb, first[..., None], axis=-1)[..., 0]
    zero = peak == 0
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127.0) / peak).astype(np.float32)
        d = np.where(zero, np.float32(0), np.float32(1.0) / iscale).astype(np.float32)
        scaled = np.rint(xb * iscale[..., None])
    # ggml's `nearest_int` turns inf and NaN (an all-subnormal block) into values whose low
    # byte, all the int8 store keeps, is 0
    q = np.where(np.isfinite(scaled), np.minimum(scaled, 127), 0).astype(np.int8)
    bsums = q.reshape(*q.shape[:2], 16, 16).astype(np.int16).sum(axis=-1, dtype=np.int16)
    return Q8Blocks("q8_k", q, d, bsums=bsums)


def round_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest-even float16 -> float32 (ggml's FP32_TO_FP16 with F16C)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest-even bfloat16 -> float32 (ggml's `ggml_compute_fp32_to_bf16`; NaN
    stays a quiet NaN)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) & np.uint32(0xFFFF0000)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = np.where(nan, (bits | 0x00400000) & 0xFFFF0000, rounded).astype(np.uint32)
    return rounded.view(np.float32)


def quantize(x: np.ndarray, fmt: str) -> Q8Blocks:
    """The blocks of `fmt` ("q8_0", "q8_1", "q8_k")."""
    if fmt == "q8_k":
        return quantize_q8_k(x)
    if fmt in ("q8_0", "q8_1"):
        return quantize_q8_0(x, with_sum=fmt == "q8_1")
    raise ValueError(f"no 8-bit block format {fmt!r}")


def simulate(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(x~, min_delta): the activations as the weight's dot product sees them (dequantized
    blocks, or x rounded to 16 bits), float32 `[M, K]`; for Q8_1 also float32 `[M, K / 32]`,
    s - d16 * sum(q) per block, which the weight's min multiplies (module docstring)."""
    if fmt == "f16":
        return round_f16(x), None
    if fmt == "bf16":
        return round_bf16(x), None
    blocks = quantize(x, fmt)
    values = (blocks.d[..., None] * blocks.q.astype(np.float32)).reshape(len(blocks.q), -1)
    delta = None
    if blocks.s is not None:
        delta = blocks.s - blocks.d * blocks.q.astype(np.int32).sum(axis=-1).astype(np.float32)
    return values, delta


def block_mins(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray | None:
    """Q4_1/Q5_1: each block's min (float16 `m`) as float32 `[N, K / 32]`; None for other
    types (their mins, if any, are exact under `simulate`)."""
    if int(qtype) not in (T.Q4_1, T.Q5_1):
        return None
    rows, cols = int(shape[0]), int(shape[1])
    blocks = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(rows, cols // 32, -1)
    return np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
