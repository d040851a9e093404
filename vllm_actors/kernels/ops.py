"""The backend contract: every op a model may call, with shapes. Models never branch on backend.

Notation: T tokens in the step, B requests, D hidden size, H / Hk query / KV heads, Dh head
dim, V vocab. Activations are float32. `Array` is whatever the backend computes on (numpy
arrays, pyopencl arrays, cupy arrays); host arrays are numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from vllm_actors.kernels.ggml_rope import ggml_rope_tables  # noqa: F401 (models' way in)

Array = Any


class WeightLike(Protocol):
    """A stored tensor as loaders hand it over (see `loaders.weights.RawTensor`)."""

    name: str
    shape: tuple[int, ...]
    qtype: int   # GGML type id
    data: np.ndarray


@dataclass(frozen=True)
class AttentionMetadata:
    """Host-side layout of one step's tokens and their paged KV. Rows are requests.

    Attributes:
        query_start_loc: [B + 1] int32, token offsets of each request in the step.
        seq_lens: [B] int32, tokens in each request's context after this step.
        block_tables: [B, max_blocks] int32, KV block ids per request (padded with 0, the null
            block, which attention never reads because it masks by position).
        slot_mapping: [T] int64, flat KV slot (block_id * block_size + offset) of each token.
        block_size: tokens per KV block.
        prompt_lens: [B] int32, each request's prompt tokens, where known (None: each
            request's rows this step are a whole request). A backend in llama.cpp's float
            order picks a prompt chunk's kernels as llama.cpp does for the whole prompt.
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    block_size: int
    prompt_lens: np.ndarray | None = None


@dataclass(frozen=True)
class RopeTables:
    """cos/sin of position * inv_freq. `cos`/`sin`: [max_positions, rotary_dim // 2]."""

    cos: Array
    sin: Array
    rotary_dim: int
    interleaved: bool   # True: rotate pairs (2i, 2i+1) (GPT-J / ggml NORM); False: (i, i+Dh/2)
    # ggml's rotation (the quantized GGUF semantics): x0' = fma(x0, cos, -(x1 sin)),
    # x1' = fma(x0, sin, x1 cos) (`kernels.ggml_rope`); else x0 cos - x1 sin, x1 cos + x0 sin
    fused: bool = False


class Backend(Protocol):
    """What a device backend provides. Implementations: numpy (reference), cpu (compiled),
    OpenCL, CUDA."""

    name: str

    # -- weights and buffers -------------------------------------------------------------
    def upload_linear(self, parts: Sequence[WeightLike]) -> Any:
        """Weights `[out_i, in]` concatenated along out (fused QKV, gate+up) -> opaque handle."""

    def upload_table(self, weight: WeightLike) -> Any:
        """An embedding table `[V, D]` -> opaque handle for `embedding`."""

    def upload_lm_head(self, weight: WeightLike) -> Any:
        """An LM-head table `[V, D]` (maybe the tied embedding) -> opaque handle for `lm_head`,
        in whatever layout the backend's matmul reads fastest."""

    def upload_vector(self, weight: WeightLike) -> Array:
        """A norm weight or bias `[n]` -> float32 device array."""

    def upload_array(self, array: np.ndarray) -> Array:
        """Any float32 host array -> device array (e.g. RoPE tables)."""

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int, kv_format: Any = None) -> list[Any]:
        """One paged cache per layer: K and V of `[num_blocks, block_size, Hk, Dh]` rows, in
        `kv_format` (a `kv_quant.KVFormat`; None: float32)."""

    def to_host(self, x: Array) -> np.ndarray: ...

    def from_host(self, x: np.ndarray) -> Array:
        """A per-step float32 host array (an activation, e.g. after a host all-reduce) on the
        device; not counted as weights."""

    def free_memory(self) -> int:
        """Bytes the device can still allocate (on CPU: available RAM)."""

    # -- compute ------------------------------------------------------------------------
    def embedding(self, table: Any, token_ids: np.ndarray) -> Array:
        """token_ids [T] int -> [T, D]."""

    def linear(self, x: Array, weight: Any, bias: Array | None = None) -> Array:
        """x [T, in] -> x @ W.T (+ bias): [T, out]."""

    def lora_add(self, y: Array, x: Array, rows: np.ndarray | None, lora: Any,
                 ggml: bool = False) -> Array:
        """A LoRA adapter's delta on `rows` of a linear's output y [T, N] (input x [T, K]):
        `y[rows, col:col+n] += scale * (x[rows] @ a[r0:r0+r].T) @ b.T` per part of `lora`
        (a `models.lora.LinearLoRA`); returns y. `ggml`: in llama.cpp's float order where
        the backend follows it. Host backends (`kernels/lora_ops.py`)."""
        ...

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """RMSNorm over the last axis of x [..., n] with weight [n]."""

    def add(self, x: Array, y: Array) -> Array:
        """Elementwise x + y (residual connections); may reuse x's storage."""

    def add_rms_norm(self, h: Array, delta: Array, weight: Array, eps: float
                     ) -> tuple[Array, Array]:
        """The residual add fused with the next norm: h += delta (h may be updated in place),
        then (h, RMSNorm(h) with weight)."""

    def split_qkv(self, qkv: Array, num_heads: int, num_kv_heads: int, head_dim: int
                  ) -> tuple[Array, Array, Array]:
        """Fused projection [T, (H + 2 Hk) * Dh] -> q [T, H, Dh], k [T, Hk, Dh], v [T, Hk, Dh]
        (views where the backend can)."""

    def silu_mul(self, gate_up: Array, ggml: bool = False) -> Array:
        """gate_up [T, 2F] -> silu(gate) * up: [T, F]. `ggml`: exp as llama.cpp's x86 build
        computes it (`kernels.ggml_math`; the quantized GGUF semantics); backends without it
        compute their own exp."""

    def gelu_mul(self, gate_up: Array, approximate: bool = True, ggml: bool = False) -> Array:
        """gate_up [T, 2F] -> gelu(gate) * up: [T, F] (GeGLU). approximate: the tanh form
        (`gelu_pytorch_tanh`), else the exact erf form. `ggml` (with the tanh form): ggml's
        float16 GELU table (`kernels.ggml_math`); backends without it compute their own."""

    def gelu(self, x: Array, approximate: bool = True) -> Array:
        """Elementwise gelu of x [T, n] (an ungated MLP); may reuse x's storage."""

    def layer_norm(self, x: Array, weight: Array, bias: Array | None, eps: float) -> Array:
        """LayerNorm over the last axis of x [..., n]: (x - mean) / sqrt(var + eps) * weight
        (+ bias)."""

    def scale(self, x: Array, factor: float) -> Array:
        """x * factor (embedding and residual multipliers); may reuse x's storage."""

    def prepare_rope(self, positions: np.ndarray, tables: RopeTables) -> Any:
        """Once per step: the cos/sin rows of the step's positions [T]."""

    def rope(self, x: Array, rope: Any) -> Array:
        """Rotate x [T, H, Dh] (first `rotary_dim` dims) by the prepared positions; may rotate
        x in place."""

    def rope_and_cache(self, qkv: Array, num_heads: int, num_kv_heads: int, head_dim: int,
                       rope: Any, kv_cache: Any, attn: Any,
                       norms: tuple[Array, Array, float] | None = None) -> Array:
        """A fused projection [T, (H + 2 Hk) * Dh] -> q [T, H, Dh] rotated, with k rotated
        and v written into the cache; `norms` (q weight, k weight, eps): each head's q and k
        through RMSNorm first. `split_rope_cache`'s results, fused where the backend can."""

    def prepare_attention(self, meta: AttentionMetadata) -> Any:
        """Once per step: the backend's own form of the step's attention layout (device
        copies, decode/prefill split, ...), passed to every layer's attention ops."""

    def reshape_and_cache(self, k: Array, v: Array, kv_cache: Any, attn: Any) -> None:
        """Write k, v [T, Hk, Dh] into the paged cache at the step's slot mapping."""

    def paged_attention(self, q: Array, kv_cache: Any, attn: Any, scale: float,
                        window: int = 0, softcap: float = 0.0, sinks: Any = None) -> Array:
        """Causal attention of q [T, H, Dh] over each request's cached context -> [T, H, Dh].

        Prefill chunks and decodes mix freely; GQA maps query head h to KV head h // (H / Hk).
        `window` > 0: sliding-window attention, a query at position p sees only keys at
        positions p - window < k <= p (transformers' `sliding_window`). `softcap` > 0: scores
        s = scale * q.k become softcap * tanh(s / softcap) before the softmax (Gemma 2).
        `sinks` (an `upload_vector` of H logits): attention sinks, one more softmax column per
        head whose value is zero, so each head may attend to nothing (gpt-oss).
        """

    def encoder_attention(self, q: Array, k: Array, v: Array, bounds: np.ndarray,
                          scale: float) -> Array:
        """Bidirectional attention of q, k, v [T, H, Dh] within each request's tokens
        (`bounds`: host query_start_loc [B + 1]) -> [T, H * Dh] (encoders: no KV cache)."""

    def lm_head(self, hidden: Array, head: Any, rows: np.ndarray, on_device: bool = False
                ) -> Any:
        """Rows `rows` of hidden [T, D] -> float32 logits [len(rows), V], on the host unless
        `on_device` (then for the backend's own sampling helpers, e.g. `argmax`)."""


def split_rope_cache(backend: Backend, qkv: Array, num_heads: int, num_kv_heads: int,
                     head_dim: int, rope: Any, kv_cache: Any, attn: Any,
                     norms: tuple[Array, Array, float] | None = None) -> Array:
    """`Backend.rope_and_cache` from the backend's own ops: split, norm q and k per head,
    rotate them, write k and v; returns q."""
    q, k, v = backend.split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    if norms is not None:
        q, k = backend.rms_norm(q, norms[0], norms[2]), backend.rms_norm(k, norms[1], norms[2])
    q, k = backend.rope(q, rope), backend.rope(k, rope)
    backend.reshape_and_cache(k, v, kv_cache, attn)
    return q
