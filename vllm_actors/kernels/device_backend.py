"""What the OpenCL and CUDA backends share: every op of `kernels.ops` as launches of kernels
with the same names and arguments (`opencl/ops.cl`, `cuda/ops.cu`); a subclass supplies the
buffers and `_launch`.

Weights and the KV cache live on the device. Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and Q2_K..Q6_K
linear weights stay in their GGUF blocks and are dequantized inside the matmul kernel
(`linear_quant.cl` / `.cu`), F16 and BF16 weights stay 16-bit (widened to float32 in the
kernel); other types are dequantized once at upload to float32. Per step only token ids, positions, slot mapping and block tables go up,
and only the sampled rows' logits come back.

A launch names its logical index space, innermost first (`items`): one work-item / thread
each, or, for the kernels in a subclass's `GROUPS`, one cooperating group per item along x.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any, Sequence

import numpy as np

from vllm_actors.kernels import quant
from vllm_actors.kernels.ops import AttentionMetadata, RopeTables, WeightLike

# GGML type id -> (matmul kernel that reads its blocks, values per block)
QUANT_KERNELS = {8: ("linear_q8_0", 32), 2: ("linear_q4_0", 32), 3: ("linear_q4_1", 32),
                 6: ("linear_q5_0", 32), 7: ("linear_q5_1", 32), 10: ("linear_q2_k", 256),
                 11: ("linear_q3_k", 256), 12: ("linear_q4_k", 256), 13: ("linear_q5_k", 256),
                 14: ("linear_q6_k", 256)}
# Every kernel both ops.cl and ops.cu define, by the name launches use.
KERNEL_NAMES = ("embedding", "rms_norm", "add_inplace", "silu_mul", "split_qkv", "rope",
                "reshape_and_cache", "paged_attention", "gather_rows", "linear_f32",
                "linear_f16", "linear_bf16", "linear_q8_0", "linear_q4_0", "linear_q4_1",
                "linear_q5_0", "linear_q5_1", "linear_q2_k", "linear_q3_k", "linear_q4_k",
                "linear_q5_k", "linear_q6_k", "argmax_rows", "apply_temperature", "mask_below")
# Kernel source files of each device package, built as one program in this order.
SOURCE_FILES = {"cl": ("ops.cl", "linear_quant.cl"), "cu": ("ops.cu", "linear_quant.cu")}
# 16-bit float storage (GGML F16 = 1, BF16 = 30): kept as stored, widened in the kernel
HALF_KERNELS = {1: ("linear_f16", np.float16), 30: ("linear_bf16", np.uint16)}
MAX_HEAD_DIM = 256


def kernel_source(ext: str) -> str:
    """The whole kernel program of the OpenCL ("cl") or CUDA ("cu") package, one text."""
    package = resources.files("vllm_actors.kernels." + {"cl": "opencl", "cu": "cuda"}[ext])
    return "\n".join(package.joinpath(name).read_text() for name in SOURCE_FILES[ext])


@dataclass(frozen=True)
class Linear:
    """A linear weight on the device: raw GGUF blocks (`kernel` dequantizes) or float32."""

    data: Any
    kernel: str
    out_features: int
    in_features: int


@dataclass(frozen=True)
class StepAttention:
    slots: Any          # [T] int64
    token_req: Any      # [T] int32, request row of each token
    token_pos: Any      # [T] int32, absolute position of each token
    block_tables: Any   # [B, max_blocks] int32
    max_blocks: int
    block_size: int


class DeviceBackend:
    """Implements `kernels.ops.Backend` for a device; see the module docstring."""

    name = "device"
    GROUPS: dict[str, int] = {}

    # -- provided by the subclass ------------------------------------------------------------
    def _put(self, array: np.ndarray) -> Any:
        """A per-step host array on the device."""
        raise NotImplementedError

    def _keep(self, array: np.ndarray) -> Any:
        """A weight: its own buffer for the engine's life, counted in free_memory."""
        raise NotImplementedError

    def _empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        raise NotImplementedError

    def _zeros(self, shape: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def _launch(self, name: str, items: tuple[int, ...], *args: Any) -> None:
        raise NotImplementedError

    def to_host(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def free_memory(self) -> int:
        raise NotImplementedError

    def from_host(self, x: np.ndarray) -> Any:
        return self._put(np.asarray(x, np.float32))

    # -- weights and buffers -------------------------------------------------------------
    def upload_linear(self, parts: Sequence[WeightLike]) -> Linear:
        out = sum(p.shape[0] for p in parts)
        k = parts[0].shape[-1]
        # fused parts keep their stored form only when they share it
        qtype = parts[0].qtype if len({p.qtype for p in parts}) == 1 else None
        kernel, block = QUANT_KERNELS.get(qtype, (None, 0))
        if kernel is not None and k % block == 0:
            blocks = np.concatenate([np.asarray(p.data).reshape(p.shape[0], -1) for p in parts])
            return Linear(self._keep(blocks), kernel, out, k)
        if qtype in HALF_KERNELS:
            kernel, dtype = HALF_KERNELS[qtype]
            data = np.concatenate([np.asarray(p.data).view(dtype).reshape(p.shape[0], k)
                                   for p in parts])
            return Linear(self._keep(data), kernel, out, k)
        weight = np.concatenate([quant.dequantize(p.data, p.qtype, p.shape) for p in parts])
        return Linear(self._keep(weight.astype(np.float32)), "linear_f32", out, k)

    def upload_table(self, weight: WeightLike) -> Any:
        return self._keep(quant.dequantize(weight.data, weight.qtype, weight.shape))

    def upload_lm_head(self, weight: WeightLike) -> Linear:
        return self.upload_linear([weight])

    def upload_vector(self, weight: WeightLike) -> Any:
        return self._keep(quant.dequantize(weight.data, weight.qtype, weight.shape).reshape(-1))

    def upload_array(self, array: np.ndarray) -> Any:
        return self._keep(np.asarray(array, np.float32))

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int) -> list[tuple[Any, Any]]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return [(self._zeros(shape), self._zeros(shape)) for _ in range(num_layers)]

    # -- compute ------------------------------------------------------------------------
    def embedding(self, table: Any, token_ids: np.ndarray) -> Any:
        dim = table.shape[1]
        out = self._empty((len(token_ids), dim))
        self._launch("embedding", (dim, len(token_ids)), table,
                     self._put(np.asarray(token_ids, np.int32)), out, np.int32(dim))
        return out

    def linear(self, x: Any, weight: Linear, bias: Any | None = None) -> Any:
        t = x.shape[0]
        y = self._empty((t, weight.out_features))
        self._launch(weight.kernel, (weight.out_features, t), x, weight.data,
                     y if bias is None else bias, y, np.int32(weight.in_features),
                     np.int32(weight.out_features), np.int32(bias is not None))
        return y

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        n = x.shape[-1]
        out = self._empty(x.shape)
        self._launch("rms_norm", (x.size // n,), x, weight, out, np.int32(n), np.float32(eps))
        return out

    def add(self, x: Any, y: Any) -> Any:
        self._launch("add_inplace", (x.size,), x, y, np.int64(x.size))
        return x

    def add_rms_norm(self, h: Any, delta: Any, weight: Any, eps: float) -> tuple[Any, Any]:
        h = self.add(h, delta)
        return h, self.rms_norm(h, weight, eps)

    def split_qkv(self, qkv: Any, num_heads: int, num_kv_heads: int, head_dim: int
                  ) -> tuple[Any, Any, Any]:
        t = qkv.shape[0]
        q = self._empty((t, num_heads, head_dim))
        k = self._empty((t, num_kv_heads, head_dim))
        v = self._empty((t, num_kv_heads, head_dim))
        self._launch("split_qkv", (qkv.shape[1], t), qkv, q, k, v,
                     np.int32(num_heads * head_dim), np.int32(num_kv_heads * head_dim))
        return q, k, v

    def silu_mul(self, gate_up: Any) -> Any:
        t, f = gate_up.shape[0], gate_up.shape[1] // 2
        out = self._empty((t, f))
        self._launch("silu_mul", (f, t), gate_up, out, np.int32(f))
        return out

    def prepare_rope(self, positions: np.ndarray, tables: RopeTables) -> tuple[Any, ...]:
        return (self._put(np.asarray(positions, np.int32)), tables, len(positions))

    def rope(self, x: Any, rope: tuple[Any, ...]) -> Any:
        positions, tables, t = rope
        heads, head_dim = x.shape[1], x.shape[2]
        self._launch("rope", (tables.rotary_dim // 2, heads, t), x, positions, tables.cos,
                     tables.sin, np.int32(heads), np.int32(head_dim),
                     np.int32(tables.rotary_dim), np.int32(tables.interleaved))
        return x

    def prepare_attention(self, meta: AttentionMetadata) -> StepAttention:
        q_lens = np.diff(meta.query_start_loc)
        token_req = np.repeat(np.arange(len(q_lens), dtype=np.int32), q_lens)
        offsets = np.arange(len(token_req)) - np.repeat(meta.query_start_loc[:-1], q_lens)
        token_pos = (np.repeat(meta.seq_lens - q_lens, q_lens) + offsets).astype(np.int32)
        tables = np.ascontiguousarray(meta.block_tables, np.int32)
        return StepAttention(self._put(np.asarray(meta.slot_mapping, np.int64)),
                             self._put(token_req), self._put(token_pos), self._put(tables),
                             tables.shape[1], meta.block_size)

    def reshape_and_cache(self, k: Any, v: Any, kv_cache: tuple[Any, Any],
                          attn: StepAttention) -> None:
        t, width = k.shape[0], k.shape[1] * k.shape[2]
        self._launch("reshape_and_cache", (width, t), k, v, kv_cache[0], kv_cache[1],
                     attn.slots, np.int32(width))

    def paged_attention(self, q: Any, kv_cache: tuple[Any, Any], attn: StepAttention,
                        scale: float) -> Any:
        t, heads, head_dim = q.shape
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim {head_dim} is larger than {MAX_HEAD_DIM}, the most the "
                             f"{self.name} attention kernel handles")
        out = self._empty(q.shape)
        self._launch("paged_attention", (heads, t), q, kv_cache[0], kv_cache[1],
                     attn.token_req, attn.token_pos, attn.block_tables, out, np.int32(heads),
                     np.int32(kv_cache[0].shape[2]), np.int32(head_dim),
                     np.int32(attn.block_size), np.int32(attn.max_blocks), np.float32(scale))
        return out

    def lm_head(self, hidden: Any, head: Linear, rows: np.ndarray, on_device: bool = False
                ) -> Any:
        if not len(rows):
            return np.zeros((0, head.out_features), np.float32)
        width = hidden.shape[1]
        picked = self._empty((len(rows), width))
        self._launch("gather_rows", (width, len(rows)), hidden,
                     self._put(np.asarray(rows, np.int32)), picked, np.int32(width))
        logits = self.linear(picked, head)
        return logits if on_device else self.to_host(logits)

    # -- sampling helpers (on device logits [rows, V]) -----------------------------------
    def argmax(self, logits: Any) -> np.ndarray:
        """Greedy ids [rows] (ties to the lowest id, as numpy's argmax); -1 for a row with a
        non-finite logit."""
        out = self._empty((logits.shape[0],), np.int32)
        self._launch("argmax_rows", (logits.shape[0],), logits, np.int32(logits.shape[1]), out)
        return self.to_host(out)

    def apply_temperature(self, logits: Any, temperature: np.ndarray) -> Any:
        """Divide each row by its temperature in place (0 leaves a greedy row alone)."""
        self._launch("apply_temperature", (logits.shape[1], logits.shape[0]), logits,
                     self._put(np.asarray(temperature, np.float32)), np.int32(logits.shape[1]))
        return logits

    def mask_below(self, logits: Any, threshold: np.ndarray) -> Any:
        """Set logits below each row's threshold (a top-k / top-p cut) to -inf in place."""
        self._launch("mask_below", (logits.shape[1], logits.shape[0]), logits,
                     self._put(np.asarray(threshold, np.float32)), np.int32(logits.shape[1]))
        return logits
