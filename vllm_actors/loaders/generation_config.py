"""Default sampling parameters from a model's generation_config.json (vLLM's
`--generation-config`): `auto` reads the model directory's file (or, for a GGUF file, its
`general.sampling.*` metadata), `vllm` uses none, and any other value names a directory
holding the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_actors.errors import ModelFormatError, ModelNotFoundError
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.model_files import ModelSource

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def _gguf_defaults(path: Path) -> dict[str, Any]:
    meta = GGUFFile(path).metadata
    return {name: meta[key] for key, name in _GGUF_KEYS.items() if meta.get(key) is not None}


def generation_defaults(source: ModelSource, setting: str = "auto") -> dict[str, Any]:
    """Sampling defaults by SamplingParams name (max_new_tokens becomes max_tokens).

    Raises:
        ModelNotFoundError: an explicit directory without generation_config.json.
    """
    if setting == "vllm":
        return {}
    if setting == "auto":
        if source.kind == "gguf":
            return _gguf_defaults(source.path)
        path = source.path / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(setting).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ModelNotFoundError(path, "--generation-config names a directory without "
                                           "generation_config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelFormatError(path, f"not valid JSON ({e})") from None
    defaults = {k: config[k] for k in _SAMPLING_KEYS if config.get(k) is not None}
    if config.get("max_new_tokens") is not None:
        defaults["max_tokens"] = int(config["max_new_tokens"])
    return defaults
