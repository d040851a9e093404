"""Every `tokenizer.ggml.pre` name we implement gives llama.cpp's ids: each name's tokenizer
(llama.cpp's gpt-2 test vocabulary with only the name changed) against the ids llama.cpp
gave for it, recorded by tests/oracle/make_pre_tokenizer_golden.py."""

import pytest
from golden_files import load_golden
from llama_cpp_vocabs import fetch_vocabs

from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.tokenizer_gguf import _PRE_TOKENIZER_REGEXES, tokenizer_from_gguf

GOLDEN = load_golden("pre_tokenizers.json")
EXPECTED = {name: group["ids"] for group in GOLDEN["groups"] for name in group["names"]}
# names llama.cpp does not know (aliases kept for files written by other tools)
NOT_IN_LLAMA_CPP = {"gpt2"}


def test_every_implemented_name_has_llama_cpp_ids():
    assert set(_PRE_TOKENIZER_REGEXES) - NOT_IN_LLAMA_CPP == set(EXPECTED)
    assert len(GOLDEN["texts"]) >= 30


@pytest.fixture(scope="module")
def gpt2_vocab():
    path = fetch_vocabs() / "ggml-vocab-gpt-2.gguf"
    return path, dict(GGUFFile(path).metadata)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ids_equal_llama_cpp(gpt2_vocab, name):
    path, meta = gpt2_vocab
    tokenizer = tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": name}, path)
    got = [tokenizer.encode(text, add_special_tokens=False).ids for text in GOLDEN["texts"]]
    wrong = [(t, g, w) for t, g, w in zip(GOLDEN["texts"], got, EXPECTED[name]) if g != w]
    assert not wrong, f"{len(wrong)} texts differ; first: {wrong[0]!r}"
