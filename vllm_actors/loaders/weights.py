"""One view of a model's weights whatever the file format: GGUF tensor names are canonical.

A safetensors checkpoint is mapped onto GGUF names with gguf-py's `TensorNameMap`
(`model.layers.3.mlp.down_proj.weight` -> `blk.3.ffn_down.weight`). Tensors stay in their stored
form (maybe block-quantized) until a backend uploads them; `to_float32()` dequantizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map

from vllm_actors.errors import ModelFormatError, UnsupportedModelError
from vllm_actors.kernels import quant
from vllm_actors.kernels.activation_quant import activation_format
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.safetensors import ggml_type_of, load_safetensors


@dataclass(frozen=True)
class RawTensor:
    """A tensor as stored. Satisfies `kernels.ops.WeightLike`.

    Attributes:
        name: canonical (GGUF-style) name.
        shape: logical numpy shape, outermost first (a linear weight is `[out, in]`).
        qtype: GGML type id (F32=0, F16=1, BF16=30, Q4_1=3, ...).
        data: stored bytes (uint8 rows for block types; float32/float16 arrays; BF16 as uint16).
        activations: the format a matmul with this weight quantizes its input to
            (`kernels.activation_quant`: "q8_0", "q8_1", "q8_k", "f16", "bf16") under
            `--gguf-activations quantized`; None computes in float32. Slices keep it.
    """

    name: str
    shape: tuple[int, ...]
    qtype: int
    data: np.ndarray
    activations: str | None = None

    def to_float32(self) -> np.ndarray:
        return quant.dequantize(self.data, self.qtype, self.shape)

    def row_slice(self, start: int, stop: int) -> "RawTensor":
        """Rows [start, stop) of the outermost axis (output features; heads; vocab entries).
        Block-safe for quantized types: GGML blocks run along the innermost axis."""
        shape = (stop - start, *self.shape[1:])
        return replace(self, shape=shape, data=self.data[start:stop])

    def col_slice(self, start: int, stop: int) -> "RawTensor":
        """Columns [start, stop) of a 2-D weight `[out, in]` (input features). Quantized rows
        are cut on block boundaries; when the cut is not block-aligned the slice is
        dequantized to float32 instead (logged by the caller's shapes: qtype becomes F32), and
        computes in float32: its blocks would not be the file's."""
        rows = self.shape[0]
        if self.data.dtype != np.uint8:      # plain float data keeps its logical shape
            return replace(self, shape=(rows, stop - start),
                           data=np.ascontiguousarray(self.data[:, start:stop]))
        block, nbytes = quant.block_layout(self.qtype)
        first, last = start // block, -(-stop // block)     # the blocks covering the cut
        data = np.ascontiguousarray(self.data[:, first * nbytes:last * nbytes])
        if start % block == 0 and stop % block == 0:
            return replace(self, shape=(rows, stop - start), data=data)
        covering = quant.dequantize(data, self.qtype, (rows, (last - first) * block))
        dense = np.ascontiguousarray(covering[:, start - first * block:stop - first * block])
        return replace(self, shape=(rows, stop - start), qtype=int(GGMLQuantizationType.F32),
                       data=dense, activations=None)

    def with_zero_row(self) -> "RawTensor":
        """One more row of zeros at the end (all-zero bytes decode to 0.0 in every GGML type)."""
        data = np.concatenate([self.data, np.zeros((1, *self.data.shape[1:]), self.data.dtype)])
        return replace(self, shape=(self.shape[0] + 1, *self.shape[1:]), data=data)


class WeightSet:
    """Weights by canonical name, remembering the file they came from for error messages."""

    def __init__(self, tensors: dict[str, RawTensor], path: Path,
                 activations: str = "float32") -> None:
        self.tensors = tensors
        self.path = path
        self.activations = activations      # the --gguf-activations semantics they were read for

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> RawTensor | None:
        return self.tensors.get(name)

    def require(self, name: str) -> RawTensor:
        """The tensor, or ModelFormatError naming the file and the missing tensor."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelFormatError(self.path, f"missing tensor {name!r}")
        return tensor


def _check_supported(path: Path, name: str, qtype: int) -> None:
    if not quant.is_supported(qtype):
        try:
            type_name = GGMLQuantizationType(qtype).name
        except ValueError:
            type_name = str(qtype)
        raise UnsupportedModelError(path, f"tensor {name!r} has type {type_name}, which this "
                                          "engine cannot use as a weight")


def gguf_weights(gguf: GGUFFile, activations: str = "float32") -> WeightSet:
    """All tensors of an open GGUF file; `activations` ("quantized" or "float32", the
    --gguf-activations semantics) sets each matrix's `RawTensor.activations`.

    Raises:
        UnsupportedModelError: a tensor type we cannot dequantize.
    """
    tensors = {}
    for name, info in gguf.tensors.items():
        _check_supported(gguf.path, name, info.ggml_type)
        fmt = activation_format(info.ggml_type) \
            if activations == "quantized" and len(info.shape) >= 2 else None
        tensors[name] = RawTensor(name, info.shape, info.ggml_type, gguf.raw(name), fmt)
    return WeightSet(tensors, gguf.path, activations)


def _model_arch(gguf_arch: str) -> MODEL_ARCH:
    for arch, name in MODEL_ARCH_NAMES.items():
        if name == gguf_arch:
            return arch
    raise UnsupportedModelError(gguf_arch, "no GGUF tensor-name map for this architecture")


# HF names some architectures' gguf-py maps lack because llama.cpp always ties them
# (gemma's LM head); an untied checkpoint of such a family still has them.
_UNMAPPED = {"lm_head.weight": "output.weight"}


def safetensors_weights(model_dir: Path, gguf_arch: str, num_layers: int,
                        extra_names: Callable[[str], str | None] | None = None) -> WeightSet:
    """A safetensors checkpoint with its tensors renamed to GGUF names (gguf-py's map, then
    `extra_names` for what it lacks).

    Tensors that have no GGUF name (e.g. `rotary_emb.inv_freq`) are left out.
    """
    name_map = get_tensor_name_map(_model_arch(gguf_arch), num_layers)
    tensors = {}
    for hf_name, entry in load_safetensors(model_dir).items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        name = name or _UNMAPPED.get(hf_name) or (extra_names and extra_names(hf_name))
        if name is None:
            continue
        if entry.dtype not in ("F32", "F16", "BF16"):
            raise UnsupportedModelError(model_dir, f"tensor {hf_name!r} has dtype {entry.dtype}, "
                                                   "want F32, F16 or BF16")
        tensors[name] = RawTensor(name, entry.shape, ggml_type_of(entry.dtype), entry.data)
    return WeightSet(tensors, model_dir)
