"""llama.cpp's own tokenizer test vocabularies (`models/ggml-vocab-*.gguf` with their `.inp`
texts and `.out` expected ids, shipped inside llama-cpp-python's source distribution on PyPI):
our GGUF tokenizer must give llama.cpp's ids for every text, without special tokens, as
llama.cpp's test-tokenizer-0 asks for them.

The sdist is fetched once (`tests/llama_cpp_vocabs.py`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_cpp_vocabs import fetch_vocabs, read_texts

from vllm_actors.errors import UnsupportedModelError
from vllm_actors.loaders.tokenizer import get_tokenizer

# vocabularies with test texts, by tokenizer kind (bert-bge: WordPiece); gemma-4 needs a
# tokenizer model we do not implement and must be refused with a clear error
SUPPORTED = ["bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2",
             "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"]
UNSUPPORTED = {"gemma-4": "tokenizer.ggml.model='gemma4'"}


@pytest.fixture(scope="module")
def vocabs() -> Path:
    return fetch_vocabs()


def cases(folder: Path, name: str) -> list[tuple[str, list[int]]]:
    texts = read_texts(folder / f"ggml-vocab-{name}.gguf.inp")
    lines = (folder / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts)
    return [(t, [int(i) for i in lines[n].split()]) for n, t in enumerate(texts)]


@pytest.mark.parametrize("name", SUPPORTED)
def test_ids_equal_llama_cpp(vocabs, name):
    tokenizer = get_tokenizer(vocabs / f"ggml-vocab-{name}.gguf")
    pairs = cases(vocabs, name)
    assert len(pairs) >= 40
    wrong = [(text, tokenizer.encode(text, add_special_tokens=False), want)
             for text, want in pairs if tokenizer.encode(text, add_special_tokens=False) != want]
    assert not wrong, f"{len(wrong)} of {len(pairs)} differ; first: {wrong[0]!r}"


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unimplemented_tokenizer_models_are_refused_clearly(vocabs, name):
    with pytest.raises(UnsupportedModelError, match=UNSUPPORTED[name]):
        get_tokenizer(vocabs / f"ggml-vocab-{name}.gguf")


def test_wordpiece_wraps_a_text_in_cls_and_sep(vocabs):
    """llama.cpp's WordPiece vocabularies add [CLS] before and [SEP] after a text."""
    tokenizer = get_tokenizer(vocabs / "ggml-vocab-bert-bge.gguf")
    plain = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.encode("Hello world") == [101, *plain, 102]
    assert tokenizer.decode(plain) == "hello world"
