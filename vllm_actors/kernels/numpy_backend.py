"""The numpy backend: float32 reference for every other backend, and the CPU path.

Weights are dequantized once at upload (float32 matmuls run on BLAS; float16 or per-step
dequantization would be ~100x slower here). Linear weights are stored transposed, `[in, out]`,
so a step's `x @ W` reads them contiguously.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from vllm_actors.kernels import activation_quant, ggml_attention, ggml_math, kv_quant, quant
from vllm_actors.kernels.lora_ops import lora_add
from vllm_actors.kernels.numpy_attention import NumpyAttention, attend as _attend, \
    decoded_group, encoder_attention
from vllm_actors.kernels.ops import AttentionMetadata, RopeTables, WeightLike, split_rope_cache


def _float32(weight: WeightLike) -> np.ndarray:
    return quant.dequantize(weight.data, weight.qtype, weight.shape)


def available_host_memory() -> int:
    """Bytes of RAM the host can still give (MemAvailable; free pages where unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _erf(x: np.ndarray) -> np.ndarray:
    """float32 erf, computed in float64 (numpy has no erf ufunc; math.erf per element)."""
    flat = x.astype(np.float64).reshape(-1)
    return np.fromiter(map(math.erf, flat), np.float64, len(flat)).astype(np.float32) \
        .reshape(x.shape)


# Up to this many rows `linear` runs one GEMV per row (measured: docs/BENCHMARKS.md).
SMALL_BATCH_ROWS = 4


def _matmul(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x `[M, K]` @ weight `[K, N]`, float32."""
    if 1 < len(x) <= SMALL_BATCH_ROWS:
        # OpenBLAS's GEMM repacks the whole weight for a few rows; row-by-row GEMV reads
        # it as it is (and from cache after the first row).
        y = np.empty((len(x), weight.shape[1]), np.float32)
        for i in range(len(x)):
            np.matmul(x[i], weight, out=y[i])
        return y
    return x @ weight


@dataclass(frozen=True)
class Segment:
    """Output columns [start, stop) of a linear whose inputs take activation format `fmt`
    (`activation_quant`; None: float32), with Q4_1/Q5_1's block mins `[K / 32, cols]`."""

    start: int
    stop: int
    fmt: str | None
    mins: np.ndarray | None


@dataclass(frozen=True)
class QuantizedLinear:
    """A linear weight `[in, out]` (dequantized, float32) computed under
    `--gguf-activations quantized`: each segment's input quantized as its weight type pairs
    (`activation_quant.simulate`)."""

    weight: np.ndarray
    segments: tuple[Segment, ...]


def segments(parts: Sequence[WeightLike]) -> tuple[Segment, ...]:
    """The column segments of stacked `parts`, neighbours of one format merged."""
    out: list[Segment] = []
    start = 0
    for p in parts:
        fmt = getattr(p, "activations", None)
        mins = activation_quant.block_mins(p.data, p.qtype, p.shape) if fmt else None
        stop = start + int(p.shape[0])
        mins_t = None if mins is None else np.ascontiguousarray(mins.T)
        if out and out[-1].fmt == fmt:       # one format: mins for all (q8_1) or none
            prev = out[-1]
            joined = None if mins_t is None else np.concatenate([prev.mins, mins_t], axis=1)
            out[-1] = Segment(prev.start, stop, fmt, joined)
        else:
            out.append(Segment(start, stop, fmt, mins_t))
        start = stop
    return tuple(out)


def quantized_matmul(x: np.ndarray, weight: np.ndarray, segs: Sequence[Segment],
                     matmul: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """x `[M, K]` @ weight `[K, N]` with each segment's input as its format sees it; `matmul`
    multiplies float32 arrays (the backend's own)."""
    simulated: dict[str | None, tuple[np.ndarray, np.ndarray | None]] = {}

    def inputs(fmt: str | None) -> tuple[np.ndarray, np.ndarray | None]:
        if fmt not in simulated:
            simulated[fmt] = (x, None) if fmt is None else activation_quant.simulate(x, fmt)
        return simulated[fmt]

    if len(segs) == 1:
        xs, delta = inputs(segs[0].fmt)
        y = matmul(xs, weight)
        if segs[0].mins is not None:
            y += delta @ segs[0].mins
        return y
    y = np.empty((len(x), weight.shape[1]), np.float32)
    for seg in segs:
        xs, delta = inputs(seg.fmt)
        y[:, seg.start:seg.stop] = matmul(xs, weight[:, seg.start:seg.stop])
        if seg.mins is not None:
            y[:, seg.start:seg.stop] += delta @ seg.mins
    return y


@dataclass(frozen=True)
class LMHead:
    """The LM head in both layouts (measured, docs/BENCHMARKS.md): one row of hidden state
    streams `cols` [D, V] at full memory bandwidth, ~40% faster than GEMV over `rows` [V, D];
    from a few rows on, GEMM over `rows.T` is as fast or faster. Costs a second copy."""

    rows: np.ndarray
    cols: np.ndarray
    segments: tuple[Segment, ...] = ()   # under --gguf-activations quantized

    def matmul(self, hidden: np.ndarray) -> np.ndarray:
        """hidden `[M, D]` -> logits `[M, V]` in the faster layout for M."""
        return hidden @ self.cols if len(hidden) == 1 else hidden @ self.rows.T


class NumpyBackend:
    """Implements `kernels.ops.Backend` with numpy on the host."""

    name = "numpy"

    @staticmethod
    def lora_add(y: np.ndarray, x: np.ndarray, rows: np.ndarray | None, lora: object,
                 ggml: bool = False) -> np.ndarray:
        """The reference: BLAS's float order on float32 inputs under either semantics
        (`lora_ops`; llama.cpp's F16 input rounding is the compiled backend's)."""
        return lora_add(y, x, rows, lora)

    def __init__(self) -> None:
        self._tables: dict[str, np.ndarray] = {}

    # -- weights and buffers -------------------------------------------------------------
    def upload_linear(self, parts: Sequence[WeightLike]) -> np.ndarray | QuantizedLinear:
        weight = np.concatenate([_float32(p) for p in parts], axis=0) if len(parts) > 1 \
            else _float32(parts[0])
        weight = np.ascontiguousarray(weight.T)  # [in, out]
        segs = segments(parts)
        if all(seg.fmt is None for seg in segs):
            return weight
        return QuantizedLinear(weight, segs)

    def upload_table(self, weight: WeightLike) -> np.ndarray:
        table = np.ascontiguousarray(_float32(weight))  # [V, D]
        self._tables[weight.name] = table
        return table

    def upload_lm_head(self, weight: WeightLike) -> LMHead:
        rows = self._tables.get(weight.name)   # the tied embedding, already uploaded
        if rows is None:
            rows = np.ascontiguousarray(_float32(weight))
        segs = segments([weight])
        return LMHead(rows, np.ascontiguousarray(rows.T),
                      () if segs[0].fmt is None else segs)

    def upload_vector(self, weight: WeightLike) -> np.ndarray:
        return np.ascontiguousarray(_float32(weight).reshape(-1))

    def upload_array(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array, dtype=np.float32)

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int,
                          kv_format: kv_quant.KVFormat | None = None) -> list:
        quantized = kv_quant.allocate_kv_cache(kv_format, num_layers, num_blocks, block_size,
                                               num_kv_heads, head_dim)
        if quantized is not None:
            return quantized
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return [(np.zeros(shape, np.float32), np.zeros(shape, np.float32))
                for _ in range(num_layers)]

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def from_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def free_memory(self) -> int:
        return available_host_memory()

    # -- compute ------------------------------------------------------------------------
    def embedding(self, table: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        return table[token_ids]

    def linear(self, x: np.ndarray, weight: np.ndarray | QuantizedLinear,
               bias: np.ndarray | None = None) -> np.ndarray:
        if isinstance(weight, QuantizedLinear):
            y = quantized_matmul(x, weight.weight, weight.segments, _matmul)
        else:
            y = _matmul(x, weight)
        if bias is not None:
            y += bias
        return y

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """ggml's RMSNorm: float32 squares summed in float64, mean rounded to float32, scale
        1 / sqrt(mean + eps) in float32, then (x * scale) * w."""
        mean = (np.square(x).sum(axis=-1, dtype=np.float64) / x.shape[-1]).astype(np.float32)
        mean += np.float32(eps)
        scale = np.divide(np.float32(1.0), np.sqrt(mean, out=mean), out=mean)
        out = x * scale[..., None]
        out *= weight
        return out

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        x += y
        return x

    def add_rms_norm(self, h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
                     ) -> tuple[np.ndarray, np.ndarray]:
        h = self.add(h, delta)
        return h, self.rms_norm(h, weight, eps)

    def split_qkv(self, qkv: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t, q_end, k_end = len(qkv), num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        return (qkv[:, :q_end].reshape(t, num_heads, head_dim),
                qkv[:, q_end:k_end].reshape(t, num_kv_heads, head_dim),
                qkv[:, k_end:].reshape(t, num_kv_heads, head_dim))

    def rope_and_cache(self, qkv: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int,
                       rope: Any, kv_cache: Any, attn: Any, norms: Any = None) -> np.ndarray:
        return split_rope_cache(self, qkv, num_heads, num_kv_heads, head_dim, rope, kv_cache,
                                attn, norms)

    def silu_mul(self, gate_up: np.ndarray, ggml: bool = False) -> np.ndarray:
        if ggml:
            return ggml_math.swiglu(gate_up)
        gate, up = np.split(gate_up, 2, axis=-1)
        out = np.negative(gate)
        np.exp(out, out=out)
        out += np.float32(1.0)
        np.divide(gate, out, out=out)
        out *= up
        return out

    def gelu_mul(self, gate_up: np.ndarray, approximate: bool = True, ggml: bool = False
                 ) -> np.ndarray:
        if ggml and approximate:
            return ggml_math.geglu(gate_up)
        gate, up = np.split(gate_up, 2, axis=-1)
        out = self.gelu(np.array(gate), approximate)
        out *= up
        return out

    def gelu(self, x: np.ndarray, approximate: bool = True) -> np.ndarray:
        if approximate:   # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            inner = x * x
            inner *= np.float32(0.044715)
            inner += np.float32(1.0)
            inner *= x
            inner *= np.float32(math.sqrt(2.0 / math.pi))
            np.tanh(inner, out=inner)
        else:             # 0.5 x (1 + erf(x / sqrt(2)))
            inner = _erf(x * np.float32(1.0 / math.sqrt(2.0)))
        inner += np.float32(1.0)
        inner *= x
        inner *= np.float32(0.5)
        return inner

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                   eps: float) -> np.ndarray:
        centered = x - x.mean(axis=-1, keepdims=True, dtype=np.float32)
        var = np.einsum("...i,...i->...", centered, centered) / np.float32(x.shape[-1])
        var += np.float32(eps)
        inv = np.sqrt(var, out=var)
        np.divide(np.float32(1.0), inv, out=inv)
        centered *= inv[..., None]
        centered *= weight
        if bias is not None:
            centered += bias
        return centered

    def scale(self, x: np.ndarray, factor: float) -> np.ndarray:
        x *= np.float32(factor)
        return x

    def prepare_rope(self, positions: np.ndarray, tables: RopeTables
                     ) -> tuple[np.ndarray, np.ndarray, int, bool, bool]:
        return (tables.cos[positions][:, None, :], tables.sin[positions][:, None, :],
                tables.rotary_dim, tables.interleaved, tables.fused)

    def rope(self, x: np.ndarray, rope: tuple[np.ndarray, np.ndarray, int, bool, bool]
             ) -> np.ndarray:
        cos, sin, rotary_dim, interleaved, fused = rope
        if interleaved:
            x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        else:
            half = rotary_dim // 2
            x1, x2 = x[..., :half], x[..., half:rotary_dim]
        if fused:     # ggml's fma(x1, cos, -(x2 sin)), fma(x1, sin, x2 cos), through float64
            wide = x1.astype(np.float64)
            new1 = (wide * cos - (x2 * sin)).astype(np.float32)
            x2[...] = (wide * sin + (x2 * cos)).astype(np.float32)
            x1[...] = new1
            return x
        x1_sin = x1 * sin
        x2_sin = x2 * sin
        x1 *= cos
        x1 -= x2_sin
        x2 *= cos
        x2 += x1_sin
        return x

    def prepare_attention(self, meta: AttentionMetadata) -> "NumpyAttention":
        return NumpyAttention.build(meta)

    def reshape_and_cache(self, k: np.ndarray, v: np.ndarray,
                          kv_cache: tuple[np.ndarray, np.ndarray],
                          attn: "NumpyAttention") -> None:
        if isinstance(kv_cache, kv_quant.QuantizedKV):
            kv_cache.write(k, v, attn.slot_mapping)
            return
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[2:]
        k_cache.reshape(-1, num_kv_heads, head_dim)[attn.slot_mapping] = k
        v_cache.reshape(-1, num_kv_heads, head_dim)[attn.slot_mapping] = v

    def encoder_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                          bounds: np.ndarray, scale: float) -> np.ndarray:
        return encoder_attention(q, k, v, bounds, scale)

    def paged_attention(self, q: np.ndarray, kv_cache: tuple[np.ndarray, np.ndarray],
                        attn: "NumpyAttention", scale: float, window: int = 0,
                        softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
        """A quantized cache (`kv_quant`) is read by decoding each group's blocks to float32
        (this is the reference; the compiled backends decode inside their loops); turboquant
        attends in its rotated space."""
        quantized = isinstance(kv_cache, kv_quant.QuantizedKV)
        if quantized and ggml_attention.reads(kv_cache.fmt, q.shape[-1], softcap, sinks):
            m = attn.meta
            return ggml_attention.attend(q, kv_cache.k, kv_cache.v, m.query_start_loc,
                                         m.seq_lens, m.block_tables, m.block_size, scale,
                                         window, prompt_lens=m.prompt_lens)
        round16 = None
        if quantized:
            q = kv_cache.rotate(q)
            if kv_cache.fmt.ggml_products:
                round16 = (activation_quant.round_f16 if kv_cache.fmt.kind == kv_quant.FLOAT16
                           else activation_quant.round_bf16)
        if len(attn.groups) == 1 and attn.groups[0].covers_all:
            out = _attend(q, *decoded_group(kv_cache, attn.groups[0]), scale, window, softcap,
                          sinks, round16)
        else:
            out = np.empty_like(q)
            for group in attn.groups:
                out[group.token_index] = _attend(q[group.token_index],
                                                 *decoded_group(kv_cache, group), scale,
                                                 window, softcap, sinks, round16)
        return kv_cache.unrotate(out) if quantized else out

    def lm_head(self, hidden: np.ndarray, head: LMHead, rows: np.ndarray,
                on_device: bool = False) -> np.ndarray:
        hidden = hidden[rows]
        if head.segments:    # one segment: the whole head, so `matmul` needs no weight
            return quantized_matmul(hidden, head.cols, head.segments,
                                    lambda x, _: head.matmul(x))
        return head.matmul(hidden)
