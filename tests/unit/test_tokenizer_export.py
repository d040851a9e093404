"""`vllm-actors export-tokenizer`: a GGUF model's tokenizer as a Hugging Face directory. A
plain `tokenizers.Tokenizer` from the written tokenizer.json counts the same ids as the
server (BOS added by its post-processor), and tokenizer_config.json names the class,
special tokens and chat template that transformers' AutoTokenizer reads."""

from __future__ import annotations

import json

import pytest
from llama_cpp_vocabs import fetch_vocabs
from tokenizers import Tokenizer as HFTokenizer

from vllm_actors.cli import main
from vllm_actors.loaders.tokenizer import get_tokenizer

TEXTS = ["Hello world!", "  The 2024 olympics, ééé 😀\n\nnew line", "<|im_start|>user"]


@pytest.mark.parametrize("name", ["smollm2", "llama-spm"])   # BOS: added by llama-spm's only
def test_exported_directory_counts_what_the_server_counts(name, tmp_path, capsys):
    model = "smollm2" if name == "smollm2" else str(fetch_vocabs() / f"ggml-vocab-{name}.gguf")
    assert main(["export-tokenizer", model, str(tmp_path / "tok")]) == 0
    assert "tokenizer written to" in capsys.readouterr().out
    ours = get_tokenizer(model)
    plain = HFTokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    for text in TEXTS:
        assert plain.encode(text).ids == ours.encode(text)
    assert plain.decode(ours.encode(TEXTS[1], add_special_tokens=False)) == TEXTS[1]
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == ours.eos_token and config["add_bos_token"] == ours.add_bos_token
    assert config.get("chat_template") == ours.chat_template


def test_tokenizer_flag_reads_a_local_directory_or_keeps_the_models(tmp_path, caplog):
    """--tokenizer: an exported directory is read as the tokenizer (the same ids here), a
    hub id keeps the model's own with a warning (nothing is downloaded), and a path that
    does not exist is an error."""
    from vllm_actors.errors import ModelNotFoundError
    from vllm_actors.loaders.model_files import resolve_model
    from vllm_actors.loaders.tokenizer import load_tokenizer, tokenizer_source
    model = resolve_model("smollm2")
    assert main(["export-tokenizer", "smollm2", str(tmp_path / "tok")]) == 0
    source = tokenizer_source(model, str(tmp_path / "tok"))
    assert (source.kind, source.path) == ("safetensors", tmp_path / "tok")
    assert load_tokenizer(source).encode(TEXTS[1]) == get_tokenizer("smollm2").encode(TEXTS[1])
    assert tokenizer_source(model, None) is model
    with caplog.at_level("WARNING"):
        assert tokenizer_source(model, "HuggingFaceTB/SmolLM2-135M-Instruct") is model
    assert "is not a local path" in caplog.text
    for missing in ("./nope", str(tmp_path / "nope.gguf")):
        with pytest.raises(ModelNotFoundError, match="--tokenizer needs"):
            tokenizer_source(model, missing)
