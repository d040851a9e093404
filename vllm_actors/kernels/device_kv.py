"""KV cache formats other than float32 (`kv_quant`) on the device backends (OpenCL, CUDA).

A slot's cache is a `DeviceKV`: K and V rows `[num_blocks, block_size, Hk, row_len]` of
`fmt.storage`, byte for byte what `kv_quant.KVFormat.encode` stores (so a cache written on one
backend reads the same on any other), with the format's decode tables and, for turboquant,
the slot's rotation, all on the device. `reshape_and_cache_kv` (float16, bfloat16, fp8: one
work-item per value) and `reshape_and_cache_tq` (turboquant: one per row) encode on the
device; `paged_attention_kv` decodes each value as it reads it (`kv_quant.cl` / `.cu`).
Turboquant attends in the rotated space as the numpy reference does: q and new keys/values
are rotated (y = x R^T) and the output rotated back (y R) by the float32 matmul kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_actors.kernels import kv_quant

KV_KERNEL_NAMES = ("reshape_and_cache_kv", "reshape_and_cache_tq", "paged_attention_kv")


def kv_defines() -> str:
    """The format kinds of kv_quant as #defines valid in OpenCL C and CUDA."""
    kinds = {"FLOAT32": kv_quant.FLOAT32, "FLOAT16": kv_quant.FLOAT16,
             "BFLOAT16": kv_quant.BFLOAT16, "FP8": kv_quant.FP8,
             "TURBOQUANT": kv_quant.TURBOQUANT}
    return "".join(f"#define KV_{name} {kind}\n" for name, kind in kinds.items())


@dataclass(frozen=True)
class DeviceKV:
    """One cache slot in a quantized format, on the device (see the module docstring).
    `rotate` / `unrotate` (turboquant): the backend's linear weights of R (x -> x R^T) and
    R^T (y -> y R)."""

    k: Any
    v: Any
    fmt: kv_quant.KVFormat
    head_dim: int
    k_lut: Any
    v_lut: Any
    rotate: Any = None
    unrotate: Any = None

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def row_bytes(self) -> int:
        return self.fmt.row_bytes(self.head_dim)

    def fp8_man_bits(self) -> int:
        """fp8's mantissa bits (3: e4m3, 2: e5m2); 0 for the other formats."""
        if self.fmt.kind != kv_quant.FP8:
            return 0
        return 3 if self.fmt.name == "fp8_e4m3" else 2

    def layout_args(self) -> tuple[np.int32, ...]:
        """(kind, row bytes, turboquant's n_high, high bits, low bits) as kernel arguments."""
        n_high, high, low = (self.fmt.split(self.head_dim)
                             if self.fmt.kind == kv_quant.TURBOQUANT else (0, 0, 0))
        return tuple(np.int32(x) for x in (self.fmt.kind, self.row_bytes, n_high, high, low))


def decode_tables(fmt: kv_quant.KVFormat, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 K and V decode tables of the format (one unread zero where it has none: a
    device buffer cannot be empty)."""
    tables = [fmt.lut(head_dim, which) for which in ("k", "v")]
    return tuple(t if len(t) else np.zeros(1, np.float32) for t in tables)
