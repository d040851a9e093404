"""Architecture registry: one table of model families (`models/family.py`), looked up by HF
`architectures` or GGUF `general.architecture`, and `load_model`, which opens the files, reads
the hyper-parameters, applies the family's weight fix-ups and uploads the weights."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from vllm_actors.errors import ModelFormatError, UnsupportedModelError
from vllm_actors.kernels.ops import Backend
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.model_files import ModelSource
from vllm_actors.loaders.weights import gguf_weights, safetensors_weights
from vllm_actors.models import (bert, gemma, gpt_oss, granite, llama, moe, olmo2, phi3,
                                 stablelm, starcoder2)
from vllm_actors.models.base import CausalLM, ModelArgs, ParallelGroup, PipelineStage
from vllm_actors.models.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, gemma.FAMILY, granite.FAMILY, moe.FAMILY,
                                olmo2.FAMILY, phi3.FAMILY, stablelm.FAMILY, starcoder2.FAMILY,
                                gpt_oss.FAMILY, bert.FAMILY)
_BY_HF_NAME = {name: f for f in FAMILIES for name in f.hf_architectures}
_BY_GGUF_NAME = {name: f for f in FAMILIES for name in f.gguf_architectures}


@dataclass(frozen=True)
class ModelInfo:
    """Facts about a model found without uploading its weights."""

    args: ModelArgs
    family: Family


def supported_architectures() -> list[str]:
    return sorted({*_BY_HF_NAME, *_BY_GGUF_NAME})


def _unsupported(path: object, arch: str) -> UnsupportedModelError:
    return UnsupportedModelError(path, f"architecture {arch!r} is not supported; supported: "
                                       f"{', '.join(supported_architectures())}")


def read_hf_config(source: ModelSource) -> dict:
    path = source.path / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelFormatError(path, f"not valid JSON ({e})") from None


def inspect_model(source: ModelSource) -> tuple[ModelInfo, GGUFFile | None]:
    """Architecture and hyper-parameters; for GGUF also the open file (reused to load).

    Raises:
        UnsupportedModelError: an architecture no model family implements.
        ModelFormatError: config.json or the GGUF metadata lacks a required key.
    """
    if source.kind == "gguf":
        gguf = GGUFFile(source.path)
        family = _BY_GGUF_NAME.get(gguf.architecture)
        if family is None:
            raise _unsupported(source.path, gguf.architecture)
        try:
            return ModelInfo(family.args_from_gguf(gguf), family), gguf
        except (KeyError, TypeError) as e:
            raise ModelFormatError(source.path, f"GGUF metadata lacks {e}") from None
    config = read_hf_config(source)
    archs = config.get("architectures") or []
    family = next((_BY_HF_NAME[a] for a in archs if a in _BY_HF_NAME), None)
    if family is None:
        raise _unsupported(source.path / "config.json", ",".join(archs) or "<none>")
    try:
        return ModelInfo(family.args_from_hf(config), family), None
    except KeyError as e:
        raise ModelFormatError(source.path / "config.json", f"missing key {e}") from None


def load_model(source: ModelSource, backend: Backend, tp: ParallelGroup | None = None,
               context_len: int = 0, stage: PipelineStage | None = None,
               gguf_activations: str = "float32") -> CausalLM:
    """Open, check and upload a model onto `backend` (only rank `tp.rank`'s shard when a
    tensor-parallel group is given; each rank reads the file through its own mmap).
    `context_len`: the serving context (max_model_len) when set, which the static rope
    choices of longrope and dynamic scaling depend on (`ModelArgs.context_len`).
    `stage`: the pipeline stage whose layers to load (all of them when None).
    `gguf_activations`: how a GGUF file's matmuls compute (`--gguf-activations`: float32,
    the exact semantics, or quantized, llama.cpp's); safetensors checkpoints always compute
    in float32."""
    info, gguf = inspect_model(source)
    if context_len:
        info = replace(info, args=replace(info.args, context_len=context_len))
    if gguf is not None:
        weights, kind = gguf_weights(gguf, gguf_activations), "gguf"
    else:
        weights = safetensors_weights(source.path, info.args.architecture, info.args.num_layers,
                                      info.family.hf_name)
        kind = "safetensors"
    weights = info.family.sanitize(weights, info.args, kind)
    if stage is not None and stage.size > 1:
        model = info.family.model_class(info.args, weights, backend, tp, stage)
    else:
        model = info.family.model_class(info.args, weights, backend, tp)
    model.gguf_activations = gguf_activations if kind == "gguf" else "float32"
    model.extra_names = info.family.hf_name     # LoRA adapters name HF modules
    return model
