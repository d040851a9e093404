"""Default sampling parameters from a model's generation_config.json (vLLM's
`--generation-config`): `auto` reads the model directory's file, `vllm` uses none, and any
other value names a directory holding the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_actors.errors import ModelFormatError, ModelNotFoundError
from vllm_actors.loaders.model_files import ModelSource

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def generation_defaults(source: ModelSource, setting: str = "auto") -> dict[str, Any]:
    """Sampling defaults by SamplingParams name (max_new_tokens becomes max_tokens).

    Raises:
        ModelNotFoundError: an explicit directory without generation_config.json.
    """
    if setting == "vllm":
        return {}
    if setting == "auto":
        if source.kind != "safetensors":
            return {}
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
