"""Tokenizer ids pinned against llama.cpp, chat templates against transformers (golden files
from tests/oracle/make_golden.py), plus the template sandbox and BOS handling."""

import asyncio
import numpy as np
import pytest
from golden_files import load_golden
from tiny_models import write_gguf, write_spm_vocab_gguf

from vllm_actors import get_tokenizer
from vllm_actors.errors import ModelNotFoundError, UnsupportedModelError
from vllm_actors.loaders.chat_template import ChatTemplateError

GOLDEN = load_golden("tokenizer.json")


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "tiny_spm.gguf"
    write_spm_vocab_gguf(path)
    return get_tokenizer(path)


@pytest.mark.parametrize("text", list(GOLDEN["smollm2"]))
def test_smollm2_ids_match_llama_cpp(smollm2_tokenizer, text):
    assert smollm2_tokenizer.encode(text, add_special_tokens=False) == GOLDEN["smollm2"][text]


def test_smollm2_splits_digits_one_by_one(smollm2_tokenizer):
    # llama.cpp's `smollm` pre-tokenizer isolates every digit before the byte-level regex
    ids = smollm2_tokenizer.encode("  \n2", add_special_tokens=False)
    assert smollm2_tokenizer.convert_ids_to_tokens(ids) == ["ĠĠĊ", "2"]


@pytest.mark.parametrize("text", [t for t in GOLDEN["smollm2"] if "<|" not in t])
def test_smollm2_round_trips(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text


def test_smollm2_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.eos_token_ids == (2,)
    assert tok.add_bos_token is False  # the GGUF says so; encode adds no BOS
    assert tok.encode("hi")[0] != 1
    assert tok.all_special_ids == list(range(17))
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user"


def test_hugging_face_methods_callers_use(smollm2_tokenizer):
    """What code written for vLLM's Hugging Face tokenizer calls: len, call, tokenize,
    token <-> id, batch_decode, get_vocab, and `await` (an older AsyncLLM.get_tokenizer)."""
    tok = smollm2_tokenizer
    ids = tok.encode("hello world")
    assert len(tok) == 49152 == len(tok.get_vocab()) and tok.get_vocab()["<|im_end|>"] == 2
    assert tok("hello world") == {"input_ids": ids}
    assert tok(["hi", "hello world"])["input_ids"][1] == ids
    assert tok.tokenize("hello world") == tok.convert_ids_to_tokens(ids) == ["hello", "Ġworld"]
    assert tok.convert_tokens_to_ids(["hello", "Ġworld"]) == ids
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.batch_decode([ids, [1, 2]], skip_special_tokens=True) == ["hello world", ""]

    async def awaited():
        return await tok
    assert asyncio.run(awaited()) is tok


@pytest.mark.parametrize("text", list(GOLDEN["tiny_spm"]))
def test_sentencepiece_vocab_matches_llama_cpp(spm_tokenizer, text):
    assert spm_tokenizer.encode(text, add_special_tokens=False) == GOLDEN["tiny_spm"][text]


@pytest.mark.parametrize("text", ["hello world", "  two leading", "héllo wörld 😀", "a\nb\tc"])
def test_sentencepiece_round_trips_with_byte_fallback(spm_tokenizer, text):
    ids = spm_tokenizer.encode(text)
    assert ids[0] == 1  # SentencePiece vocabularies add BOS by default
    assert spm_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_sentencepiece_merges_derived_from_scores(spm_tokenizer):
    # "▁the" (a merged piece) must win over its parts when its merges rank highest
    ids = spm_tokenizer.encode("the", add_special_tokens=False)
    assert spm_tokenizer.convert_ids_to_tokens(ids) == ["\u2581the"]


@pytest.mark.parametrize("case", GOLDEN["smollm2_chat_templates"],
                         ids=lambda c: f"{len(c['messages'])}msg-agp{c['add_generation_prompt']}")
def test_chat_template_matches_transformers(smollm2_tokenizer, case):
    text = smollm2_tokenizer.apply_chat_template(
        case["messages"], add_generation_prompt=case["add_generation_prompt"], tokenize=False)
    assert text == case["text"]


def test_chat_template_tokenized_has_no_extra_bos(smollm2_tokenizer):
    messages = [{"role": "user", "content": "Hi!"}]
    ids = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
    assert ids == smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1  # <|im_start|>, written by the template itself


def test_template_features(smollm2_tokenizer):
    template = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{{ m | tojson }}|{% endfor %}{{ strftime_now('%Y') | length }}"
                "{% generation %}!{% endgeneration %}")
    text = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "é<>"}, {"role": "user", "content": "b"},
         {"role": "user", "content": "c"}], tokenize=False, chat_template=template)
    assert text == '{"role": "user", "content": "é<>"}|{"role": "user", "content": "b"}|4!'


def test_template_raise_exception(smollm2_tokenizer):
    template = "{{ raise_exception('only user messages, please') }}"
    with pytest.raises(ChatTemplateError, match="only user messages, please"):
        smollm2_tokenizer.apply_chat_template([], chat_template=template)


def test_template_sandbox_blocks_mutation(smollm2_tokenizer):
    with pytest.raises(ChatTemplateError, match="append.* is unsafe"):
        smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tokenize=False,
            chat_template="{{ messages.append(1) }}")


def test_template_syntax_error_is_typed(smollm2_tokenizer):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        smollm2_tokenizer.apply_chat_template([], chat_template="{% for %}")


def test_vocab_only_gguf(tmp_path, smollm2_path):
    """get_tokenizer works on a GGUF that holds a vocabulary and no tensors."""
    from vllm_actors.loaders.gguf import GGUFFile
    meta = GGUFFile(smollm2_path).metadata
    path = tmp_path / "vocab.gguf"

    def fill(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(meta["tokenizer.ggml.tokens"])
        writer.add_token_types(meta["tokenizer.ggml.token_type"].tolist())
        writer.add_token_merges(meta["tokenizer.ggml.merges"])
        writer.add_eos_token_id(2)

    write_gguf(path, "llama", fill)
    tok = get_tokenizer(path)
    assert tok.encode("3.14159 and 2718281828") == GOLDEN["smollm2"]["3.14159 and 2718281828"]
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_unknown_pre_tokenizer_is_rejected(tmp_path):
    path = tmp_path / "odd.gguf"

    def fill(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("no-such-pre")
        writer.add_token_list(["a", "b"])

    write_gguf(path, "llama", fill)
    with pytest.raises(UnsupportedModelError, match="odd.gguf: tokenizer.ggml.pre='no-such-pre'"):
        get_tokenizer(path)


def test_hf_directory_tokenizer(tmp_path, smollm2_tokenizer):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    smollm2_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": true, '
        '"chat_template": "{{ bos_token }}{{ messages[0].content }}"}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    tok = get_tokenizer(tmp_path)
    assert tok.encode("Hello world") == [1] + GOLDEN["smollm2"]["Hello world"]
    assert tok.eos_token_ids == (2, 0)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == \
        "<|im_start|>x"
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelNotFoundError, match="has no tokenizer.json"):
        get_tokenizer(tmp_path)


def test_token_types_from_gguf(smollm2_path):
    from vllm_actors.loaders.gguf import GGUFFile
    types = np.asarray(GGUFFile(smollm2_path).metadata["tokenizer.ggml.token_type"])
    assert (types[:17] == 3).all() and (types[17:] == 1).all()
