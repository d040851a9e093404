"""The compiled CPU backend: `kernels.ops.Backend` on numba kernels, weights kept quantized.

- Weights stay in their GGUF formats in memory (`qmatmul.QuantMatrix`): decode steps run
  GEMV kernels that dequantize in registers (a few rows, e.g. speculative decoding's k+1: a
  multi-row GEMV decoding each block once for all rows, `qmatmul_multi`); larger steps run
  a GEMM that decodes each weight once per call (`qmatmul_fused`, `qmatmul_gemm`). The tied
  embedding is the LM head (one copy).
- Paged attention reads K/V through the block table (`attention.py`); the KV cache is
  float32, float16, or a quantized format of `kv_quant` decoded inside the attention loop
  (`attention_kv`).
- One thread budget (`threads.configure`): numba's threads, sized to the CPUs this process
  may use; BLAS single-threaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from vllm_actors.kernels import ggml_attention, ggml_math, kv_quant, mapped_pages, quant
from vllm_actors.kernels.cpu import (
    activations,
    attention,
    blas,
    elementwise,
    greedy,
    isa,
    qmatmul,
    qmatmul_int,
    qmatmul_int_k,
    qmatmul_layout,
    qwide,
    threads,
)
from vllm_actors.kernels.ggml_matmul_f32 import pack as pack_lora
from vllm_actors.kernels.lora_ops import lora_add_ggml, warm_up_lora
from vllm_actors.kernels.numpy_attention import encoder_attention
from vllm_actors.kernels.numpy_backend import NumpyBackend, available_host_memory
from vllm_actors.kernels.ops import AttentionMetadata, RopeTables, WeightLike, split_rope_cache

_NUMPY = NumpyBackend()   # its view-only ops (split_qkv) serve this backend as they are
# rows from which a float32 GEMM goes to numpy's BLAS, called on our threads (`cpu/blas.py`;
# faster from about 32-64 rows, docs/BENCHMARKS.md "Embeddings"); fewer stay in our kernels
BLAS_MIN_ROWS = 64

_ONE_ROW = np.ones(1, np.int64)       # a one-row step's rows per request

# activation format -> (its quantizer, the integer GEMV module that reads what it writes)
_INTEGER = {"q8_0": (activations.quantize_q8, qmatmul_int),
            "q8_1": (activations.quantize_q8, qmatmul_int),
            "q8_k": (activations.quantize_q8_k, qmatmul_int_k)}


@dataclass(frozen=True)
class Linear:
    """A linear weight `[out, in]`: one QuantMatrix, or several (fused parts stored in
    different formats, e.g. Q4_K q/k with a Q6_K v) whose outputs are laid side by side."""

    parts: tuple[qmatmul.QuantMatrix, ...]
    # per part: the activation format its inputs take under --gguf-activations quantized
    # (`activation_quant`), None for float32 inputs
    formats: tuple[str | None, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class StepRope:
    positions: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    rotary_dim: int
    interleaved: bool
    fused: bool


def _format(weight: WeightLike, matrix: qmatmul.QuantMatrix) -> str | None:
    """The activation format of `weight` under the quantized semantics; None when it computes
    in float32, or when `pack` converted its type approximately (IQ2.., MXFP4, ...: no
    llama.cpp semantics here). A lossless form (IQ4_NL as Q8_0) keeps it."""
    fmt = getattr(weight, "activations", None)
    kept = matrix.qtype == weight.qtype or \
        qmatmul_layout.LOSSLESS.get(int(weight.qtype)) == matrix.qtype
    return fmt if fmt is not None and kept else None


def _shape(weight: WeightLike) -> tuple[int, int]:
    shape = tuple(weight.shape)
    if len(shape) != 2:
        raise ValueError(f"{weight.name}: a matrix was expected, got shape {shape}")
    return int(shape[0]), int(shape[1])


def _matrix(weight: WeightLike) -> qmatmul.QuantMatrix:
    """One weight packed into planes; the file pages it was read from are given back.
    IQ4_NL stays itself under the quantized semantics (its integer kernels, and row lookups
    for a tied embedding); under the float32 semantics it takes its exact Q8_0 form."""
    if weight.qtype == T.IQ4_NL and getattr(weight, "activations", None):
        matrix = qmatmul.pack_iq4_nl(weight.data, _shape(weight))
        mapped_pages.release(weight.data)
        return matrix
    matrix = qmatmul.pack(weight.data, weight.qtype, _shape(weight))
    mapped_pages.release(weight.data)
    return matrix


def _llama_repacks(weight: WeightLike) -> bool:
    """Whether llama.cpp's x86 CPU backend repacks this matmul weight (Q4_K, Q4_0 and IQ4_NL
    into 8-row interleaved blocks, with AVX2 and a multiple of 8 rows), which sets its float
    order."""
    return weight.qtype in (T.Q4_K, T.Q4_0, T.IQ4_NL) and _shape(weight)[0] % 8 == 0 \
        and "avx2" in isa.available()


def _stackable(parts: Sequence[WeightLike]) -> bool:
    """Whether the parts pack straight into one matrix: one kernel type, one column count,
    one activation format and one float order of llama.cpp's (`_llama_repacks`)."""
    first = parts[0]
    return len(parts) > 1 and first.qtype in qmatmul_layout.SUPPORTED and all(
        p.qtype == first.qtype and _shape(p)[1] == _shape(first)[1]
        and getattr(p, "activations", None) == getattr(first, "activations", None)
        and _llama_repacks(p) == _llama_repacks(first)
        for p in parts)


def _runs(parts: Sequence[WeightLike]) -> list[list[WeightLike]]:
    """The parts cut into runs of consecutive ones that `_stackable` packs together."""
    runs: list[list[WeightLike]] = []
    for p in parts:
        if runs and _stackable([*runs[-1], p]):
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


class CpuBackend:
    """Implements `kernels.ops.Backend` with numba kernels on the host; see the module
    docstring. `kv_cache_dtype`: "float32" or "float16"."""

    name = "cpu"
    compiles_lazily = True   # the model runner warms every kernel up before it reports ready

    def __init__(self, num_threads: int | None = None, kv_cache_dtype: str = "float32") -> None:
        if kv_cache_dtype not in ("float32", "float16"):
            raise ValueError(f"kv_cache_dtype must be float32 or float16, got {kv_cache_dtype!r}")
        count = threads.configure(num_threads)
        # an explicit count is kept; the default follows the machine's load
        self._follower = None if num_threads else threads.LoadFollower(count)
        self._step_rows: np.ndarray | None = None   # each request's rows in this step
        self._step_total = -1                         # their sum
        # the rows' calls as llama.cpp makes them (`qmatmul.RowPlaces` where the step holds
        # prompt rows, else `_step_rows`), for the integer matmuls' kernel choice
        self._step_calls: Any = None
        # the integer kernels' SIMD path, resolved once (VLLM_ACTORS_CPU_ISA is read here)
        self._isa = isa.selected()
        # the step's (one-row-request flag, index) per token row, for the LoRA kernels
        self._lora_rows: tuple[np.ndarray, np.ndarray] | None = None
        self.kv_cache_dtype = kv_cache_dtype
        self._tables: dict[str, qmatmul.QuantMatrix] = {}
        # the smallest weight of each kernel choice (type, activation format, repacking)
        self._smallest: dict[tuple[Any, ...], Linear] = {}
        self._adaptable: set[tuple[Any, ...]] = set()    # keys of linears LoRA can adapt
        self.weight_bytes = 0

    def _keep(self, m: qmatmul.QuantMatrix) -> qmatmul.QuantMatrix:
        self.weight_bytes += m.nbytes
        return m

    def _note(self, linear: Linear, adaptable: bool = True) -> Linear:
        """Remember `linear`'s parts by the kernels they run on, for `compile_matmuls` (and,
        unless it is the LM head, for `warm_up_lora`)."""
        formats = linear.formats or (None,) * len(linear.parts)
        for m, fmt in zip(linear.parts, formats):
            key = (m.qtype, fmt, m.ggml_repacked, m.interleaved)
            if adaptable:
                self._adaptable.add(key)
            old = self._smallest.get(key)
            if old is None or m.rows * m.cols < old.parts[0].rows * old.parts[0].cols:
                self._smallest[key] = Linear((m,), (fmt,) if linear.formats else ())
        return linear

    def matmul_kinds(self) -> int:
        """How many kinds of matmul kernels the weights uploaded so far run on (by weight
        type and layout): `compile_matmuls` takes them by index."""
        return len(self._smallest)

    def compile_matmuls(self, rows: Sequence[int], kinds: Sequence[int] | None = None
                        ) -> None:
        """Compile (or load from the cache) the matmul kernels of every weight type uploaded
        so far (or of the `kinds` by index: the cold-start compile work `workers.warm_up`
        shares between the engine and its helper) at each row count in `rows`, the multi-row
        GEMVs (`qmatmul.multi_gemv`) first. Under the quantized semantics both a request of
        n rows and n one-row requests: llama.cpp's kernel, so ours, depends on the request's
        size."""
        linears = list(self._smallest.values())
        chosen = linears if kinds is None else [linears[i] for i in kinds]
        for linear in chosen:
            m = linear.parts[0]
            if not linear.formats and m.qtype in qmatmul.MULTI_MAX_ROWS:
                qmatmul.multi_gemv(m, np.zeros((2, m.cols), np.float32),
                                   np.empty((2, m.rows), np.float32))
        for linear in chosen:
            for n in rows:
                x = np.zeros((n, linear.parts[0].cols), np.float32)
                self._linear(x, linear, None, None)           # a request of n rows
                if linear.formats:                            # n one-row requests (decodes)
                    self._linear(x, linear, None, np.ones(n, np.int64))

    # -- weights and buffers -------------------------------------------------------------
    def upload_linear(self, parts: Sequence[WeightLike]) -> Linear:
        """The parts (a fused linear's tensors, in output order) as few matrices: each run of
        consecutive parts that `_stackable` allows packed into one (Gemma 3's Q5_0 Q and K
        beside its Q8_0 V: two kernel calls a step, not three), each matrix in the float
        order llama.cpp computes its own tensors in (`_llama_repacks`)."""
        mats, formats = [], []
        for run in _runs(parts):
            if len(run) > 1:
                m = qmatmul.pack_stacked([p.data for p in run], run[0].qtype,
                                         [_shape(p)[0] for p in run], _shape(run[0])[1])
                for p in run:
                    mapped_pages.release(p.data)
            else:
                m = _matrix(run[0])
            fmt = _format(run[0], m)
            mats.append(replace(m, ggml_repacked=True) if fmt and _llama_repacks(run[0]) else m)
            formats.append(fmt)
        if len(mats) > 1 and qmatmul.supports_fused(mats) and len(set(formats)) == 1:
            mats, formats = [qmatmul.concat(mats)], formats[:1]   # IQ4_NL, converted types
        return self._note(Linear(tuple(self._keep(qmatmul.interleave(m, fmt is not None))
                                       for m, fmt in zip(mats, formats)),
                                 tuple(formats) if any(formats) else ()))

    def upload_table(self, weight: WeightLike) -> qmatmul.QuantMatrix:
        table = self._keep(_matrix(weight))
        self._tables[weight.name] = table
        return table

    def upload_lm_head(self, weight: WeightLike) -> Linear:
        table = self._tables.get(weight.name)   # the tied embedding, already uploaded
        if table is None:     # a head of its own is a matmul weight llama.cpp may repack
            table = _matrix(weight)
            if getattr(weight, "activations", None) and _llama_repacks(weight):
                table = replace(table, ggml_repacked=True)
            table = self._keep(qmatmul.interleave(table, _format(weight, table) is not None))
        fmt = _format(weight, table)
        return self._note(Linear((table,), (fmt,) if fmt else ()), adaptable=False)

    def upload_vector(self, weight: WeightLike) -> np.ndarray:
        return np.ascontiguousarray(
            quant.dequantize(weight.data, weight.qtype, weight.shape).reshape(-1))

    def upload_array(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array, dtype=np.float32)

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int, kv_format: Any = None) -> list[Any]:
        return attention.allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads,
                                           head_dim, self.kv_cache_dtype, kv_format)

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def from_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def free_memory(self) -> int:
        return available_host_memory()

    # -- compute ------------------------------------------------------------------------
    def embedding(self, table: qmatmul.QuantMatrix, token_ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(token_ids), table.cols), np.float32)
        qmatmul.take_rows(table, np.ascontiguousarray(token_ids, dtype=np.int64), out)
        return out

    def _matmul(self, x: np.ndarray, parts: Sequence[qmatmul.QuantMatrix]) -> np.ndarray:
        if len(x) >= BLAS_MIN_ROWS and all(p.qtype == T.F32 for p in parts) and \
                blas.available():
            return blas.linear(x, [p.planes[0] for p in parts])
        if len(parts) == 1:
            return qmatmul.matmul(parts[0], x)
        return np.concatenate([qmatmul.matmul(p, x) for p in parts], axis=1)

    def _quantized_matmul(self, x: np.ndarray, weight: Linear,
                          requests: np.ndarray | None) -> np.ndarray:
        """Each part's input as its activation format sees it: an integer GEMV on x's 8-bit
        blocks where one serves the part (`qmatmul_int` for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0,
        `qmatmul_int_k` for Q4_K/Q5_K/Q6_K: llama.cpp's floats, each request's rows in the
        order llama.cpp gives them alone), else x~ through the float kernels
        (`activations.simulate`). Each quantizer runs once per call. A decode step's
        linear quantizes inside each part's GEMV (`matmul_float`; the same bytes, less
        Python than a quantizer's call and each part's span bookkeeping)."""
        if len(weight.parts) == 1:        # the common case, with the least Python
            integer = _INTEGER.get(weight.formats[0], (None, None))[1]
            if integer is not None and integer.quantizes_inside(weight.parts[0], len(x),
                                                                requests):
                return integer.matmul_float(weight.parts[0], x, self._isa, requests)
        else:
            inside = [_INTEGER.get(fmt, (None, None))[1] for fmt in weight.formats]
            if all(i is not None and i.quantizes_inside(p, len(x), requests)
                   for i, p in zip(inside, weight.parts)):
                return np.concatenate([i.matmul_float(p, x, self._isa, requests)
                                       for i, p in zip(inside, weight.parts)], axis=1)
        inputs: dict[Any, Any] = {}
        outs = []
        for part, fmt in zip(weight.parts, weight.formats):
            quantize, integer = _INTEGER.get(fmt, (None, None))
            if integer is not None and integer.supports(part.qtype, len(x)):
                if quantize not in inputs:
                    inputs[quantize] = quantize(x)
                outs.append(integer.matmul(part, inputs[quantize], path=self._isa,
                                           requests=requests))
                continue
            if fmt not in inputs:
                inputs[fmt] = (x, None) if fmt is None else activations.simulate(x, fmt)
            xs, delta = inputs[fmt]
            y = qmatmul.matmul(part, xs)
            if delta is not None:
                activations.add_mins(qmatmul.min_plane(part), delta, y)
            outs.append(y)
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)

    def linear(self, x: np.ndarray, weight: Linear, bias: np.ndarray | None = None
               ) -> np.ndarray:
        if len(x) == 1 and bias is None and len(weight.parts) == 1 and \
                self._step_calls is self._step_rows:
            plan = qmatmul_int.one_row_plan_taken(weight.parts[0], self._isa)
            if plan:      # a decode step's GEMV, by the plan its first call made
                return qwide.run_one_row(plan, x)
        return self._linear(x, weight, bias,
                            self._step_calls if self._step_total == len(x) else None)

    def _linear(self, x: np.ndarray, weight: Linear, bias: np.ndarray | None,
                requests: np.ndarray | None) -> np.ndarray:
        if weight.formats:
            y = self._quantized_matmul(x, weight, requests)
        else:
            y = self._matmul(x, weight.parts)
        if bias is not None:
            y += bias
        return y

    pack_lora = staticmethod(pack_lora)

    def warm_up_lora(self, half: bool = False) -> None:
        """Compile the LoRA kernels for float32 or float16 adapter weights: the separate
        delta's (`lora_ops.warm_up_lora`), and the single-row GEMV with its delta inside
        (`linear_lora`) for each type of the linears uploaded so far that takes it (not the
        LM head's: adapters never reach it)."""
        warm_up_lora(half)
        for linear in (self._smallest[key] for key in self._adaptable):
            m = linear.parts[0]
            a, tiles, meta = pack_lora(np.zeros((16, m.cols), np.float32),
                                       np.zeros((16, m.rows), np.float32),
                                       np.array([[0, 16, 0, m.rows, 0]], np.int64), half)
            lora = SimpleNamespace(a=a, b_t=tiles, meta=meta, scales=np.ones(1, np.float32),
                                   half=half, memo={})
            self.linear_lora(np.zeros((1, m.cols), np.float32), linear, lora, True)

    def lora_add(self, y: np.ndarray, x: np.ndarray, rows: np.ndarray | None, lora: Any,
                 ggml: bool = False) -> np.ndarray:
        """`lora_ops.lora_add_ggml`: llama.cpp's float order, each row as llama.cpp's call
        computes it (a request decoded alone, a prompt's rows in its call of the whole
        prompt: `_step_calls`; any order serves float32); under its semantics (`ggml`),
        float16 weights take float16-rounded inputs."""
        step = self._lora_rows
        if step is None or len(step[0]) != len(x):
            calls = self._step_calls if self._step_total == len(x) else [len(x)]
            step = self._lora_rows = (qmatmul.row_places(calls).size == 1,
                                      np.arange(len(x), dtype=np.int64))
        alone, every = step
        return lora_add_ggml(y, x, every if rows is None else rows, lora, alone,
                             ggml and lora.half)

    def linear_lora(self, x: np.ndarray, weight: Linear, lora: Any, ggml: bool
                    ) -> np.ndarray | None:
        """`linear(x, weight)` plus `lora`'s delta (a `models.lora.LinearLoRA`) on x's one
        row in one kernel call (`lora_gemv`), where an integer GEMV takes that row and
        llama.cpp computes it alone (not a prompt's row this step holds alone: its call of
        the whole prompt orders the delta otherwise); else None. `ggml`: under llama.cpp's
        semantics (float16 weights round their inputs)."""
        if len(x) != 1 or len(weight.parts) != 1 or not weight.formats:
            return None
        integer = _INTEGER.get(weight.formats[0], (None, None))[1]
        fused = getattr(integer, "matmul_float_lora", None)
        calls = self._step_calls if self._step_total == 1 else _ONE_ROW
        if fused is None or not qmatmul.one_row_each(calls, 1) or \
                not integer.quantizes_inside(weight.parts[0], 1, calls):
            return None
        return fused(weight.parts[0], x, lora, ggml and lora.half, self._isa)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return elementwise.rms_norm(x, weight, eps)

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        x += y
        return x

    def add_rms_norm(self, h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float
                     ) -> tuple[np.ndarray, np.ndarray]:
        return h, elementwise.add_rms_norm(h, delta, weight, eps)

    def split_qkv(self, qkv: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Contiguous copies: one array layout at every step size (a 1-row view is
        contiguous, a larger one strided), so the kernels that take q, k and v (RoPE, the KV
        write) compile once. The copies are a small part of a prefill step and none of a
        decode step (docs/BENCHMARKS.md, "Cold start")."""
        return tuple(np.ascontiguousarray(a)           # type: ignore[return-value]
                     for a in _NUMPY.split_qkv(qkv, num_heads, num_kv_heads, head_dim))

    def rope_and_cache(self, qkv: np.ndarray, num_heads: int, num_kv_heads: int,
                       head_dim: int, rope: StepRope, kv_cache: Any, attn: Any,
                       norms: tuple[np.ndarray, np.ndarray, float] | None = None
                       ) -> np.ndarray:
        """One kernel (`attention.write_qkv`) where the cache holds float32 or float16 rows
        and there are no q/k norms or fewer than `PARALLEL_ROWS` tokens; else the ops one by
        one (the one-thread kernel would norm a prefill's heads serially, where `rms_norm`
        runs 16 rows as lanes on every thread; a quantized cache has its own encoder)."""
        if isinstance(kv_cache, kv_quant.QuantizedKV) or \
                (norms is not None and len(qkv) >= elementwise.PARALLEL_ROWS):
            return split_rope_cache(self, qkv, num_heads, num_kv_heads, head_dim, rope,
                                    kv_cache, attn, norms)
        return attention.write_qkv(qkv, num_heads, head_dim, rope.positions, rope.cos,
                                   rope.sin, rope.rotary_dim, rope.interleaved, rope.fused,
                                   kv_cache, attn, norms)

    def silu_mul(self, gate_up: np.ndarray, ggml: bool = False) -> np.ndarray:
        return ggml_math.swiglu(gate_up) if ggml else elementwise.silu_mul(gate_up)

    def gelu_mul(self, gate_up: np.ndarray, approximate: bool = True, ggml: bool = False
                 ) -> np.ndarray:
        if ggml and approximate:
            return ggml_math.geglu(gate_up)
        return elementwise.gelu_mul(gate_up, approximate)

    def gelu(self, x: np.ndarray, approximate: bool = True) -> np.ndarray:
        return elementwise.gelu(x, approximate)

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                   eps: float) -> np.ndarray:
        return elementwise.layer_norm(x, weight, bias, eps)

    def scale(self, x: np.ndarray, factor: float) -> np.ndarray:
        x *= np.float32(factor)     # in place; numpy's loop is as fast as a kernel's
        return x

    def prepare_rope(self, positions: np.ndarray, tables: RopeTables) -> StepRope:
        return StepRope(np.ascontiguousarray(positions, dtype=np.int64), tables.cos,
                        tables.sin, tables.rotary_dim, tables.interleaved, tables.fused)

    def rope(self, x: np.ndarray, rope: StepRope) -> np.ndarray:
        return elementwise.rope(x, rope.positions, rope.cos, rope.sin, rope.rotary_dim,
                                rope.interleaved, rope.fused)

    def prepare_attention(self, meta: AttentionMetadata) -> Any:
        if self._follower is not None:       # once per forward: the step's thread count
            self._follower.follow()
        counts = self._step_rows = np.diff(meta.query_start_loc)
        self._step_total = int(counts.sum())
        self._step_calls = counts
        if meta.prompt_lens is not None and (meta.seq_lens - counts < meta.prompt_lens).any():
            self._step_calls = qmatmul.RowPlaces.of_step(counts, meta.seq_lens,
                                                         meta.prompt_lens)
        self._lora_rows = None
        return attention.prepare(meta)

    def reshape_and_cache(self, k: np.ndarray, v: np.ndarray, kv_cache: Any, attn: Any) -> None:
        attention.write_kv(k, v, kv_cache, attn)

    def encoder_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                          bounds: np.ndarray, scale: float) -> np.ndarray:
        if self._follower is not None:
            self._follower.working()
        return encoder_attention(q, k, v, bounds, scale)

    def paged_attention(self, q: np.ndarray, kv_cache: Any, attn: Any, scale: float,
                        window: int = 0, softcap: float = 0.0,
                        sinks: np.ndarray | None = None) -> np.ndarray:
        if self._follower is not None:
            self._follower.working()
        if isinstance(kv_cache, ggml_attention.GgmlCache) and not softcap and sinks is None:
            return ggml_attention.attend(q, kv_cache.k, kv_cache.v, attn.query_start_loc,
                                         attn.seq_lens, attn.block_tables, attn.block_size,
                                         scale, window, attn.plans, attn.prompt_lens)
        return attention.paged_attention(q, kv_cache, attn, scale, window=window,
                                         softcap=softcap, sinks=sinks)

    # plain-greedy steps take their ids in one pass over the logits (`greedy`); the
    # "device" logits are the host's, so the family's scale and soft-cap still apply
    argmax = staticmethod(greedy.argmax)
    host_logits = True

    def lm_head(self, hidden: np.ndarray, head: Linear, rows: np.ndarray,
                on_device: bool = False) -> np.ndarray:
        # one row per request: as llama.cpp computes the logits of a request alone
        logits = self._linear(np.ascontiguousarray(hidden[rows]), head, None,
                              np.ones(len(rows), np.int64))
        if self._follower is not None:       # the step's work ends about here
            self._follower.working()
        return logits
