"""What a model family module declares, so that the registry is one table.

A family module (`models/llama.py`, `models/gemma.py`, ...) owns everything that makes its
architecture what it is: the names it answers to (HF `architectures`, GGUF
`general.architecture`), its hyper-parameters read from either file, the fix-ups its weights
need at load (`sanitize`: renames, splits of fused tensors, value shifts), and its model class
(usually `models.decoder.DecoderLM`, whose block layout the hyper-parameters select, or a
subclass). Adding a family is one module, one line in `models/registry.py`, and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.weights import WeightSet
from vllm_actors.models.base import ModelArgs


def keep_weights(weights: WeightSet, args: ModelArgs, kind: str) -> WeightSet:
    """The default `sanitize`: the weights as loaded."""
    return weights


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: short name (docs, errors).
        hf_architectures: HF `architectures` entries this family loads.
        gguf_architectures: GGUF `general.architecture` values this family loads.
        args_from_hf: config.json dict -> ModelArgs (`architecture` must be a GGUF
            architecture name: safetensors names are mapped through its gguf-py name map).
        args_from_gguf: open GGUF file -> ModelArgs.
        model_class: called as model_class(args, weights, backend, tp).
        sanitize: (weights with GGUF names, args, "gguf" | "safetensors") -> the weights the
            model class expects.
        hf_name: GGUF-style names for HF tensors gguf-py's name map does not know (e.g.
            per-expert weights), or None.
    """

    name: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    args_from_hf: Callable[[dict[str, Any]], ModelArgs]
    args_from_gguf: Callable[[GGUFFile], ModelArgs]
    model_class: Callable[..., Any]
    sanitize: Callable[[WeightSet, ModelArgs, str], WeightSet] = keep_weights
    hf_name: Callable[[str], str | None] | None = None
