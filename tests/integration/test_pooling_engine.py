"""Pooling through the full engine (`LLM`, core in its own process): all-MiniLM-L6-v2 against
sentence-transformers (tests/golden/pooling.npz) on 64 texts in one batch and each alone, the
cross-encoder's scores against its classifier, and the errors of asking a pooling model to
generate or an embedding model to classify."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_pooling import GOLDEN, PAIRS, embed_texts, write_bert_dir

from vllm_actors import LLM, PoolingParams, SamplingParams
from vllm_actors.errors import ValidationError

# cosine to sentence-transformers' embeddings (the issue's bound)
MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


@pytest.fixture(scope="module")
def minilm(minilm_path):
    with LLM(str(minilm_path)) as llm:
        yield llm


def _cosines(got: list, want: np.ndarray) -> np.ndarray:
    got = np.array(got, np.float64)
    want = want.astype(np.float64)
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


def test_minilm_matches_sentence_transformers(minilm, golden):
    """sentence-transformers cuts inputs at its max_seq_length (256, our max_model_len):
    `truncate_prompt_tokens=-1` does the same, keeping [SEP]."""
    texts = embed_texts()
    assert minilm.engine.ready.max_model_len == 256
    batch = minilm.embed(texts, truncate_prompt_tokens=-1)
    alone = [minilm.embed(t, truncate_prompt_tokens=-1)[0] for t in texts]
    for outs in (batch, alone):
        cos = _cosines([o.outputs.embedding for o in outs], golden["minilm_st"])
        assert cos.min() >= MIN_COSINE, (cos.argmin(), cos.min())
    assert max(o.num_prompt_tokens for o in batch) == 256
    norms = np.linalg.norm([o.outputs.embedding for o in batch], axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)
    raw = minilm.embed(texts[:2], PoolingParams(normalize=False))
    assert abs(np.linalg.norm(raw[0].outputs.embedding) - 1.0) > 1e-3
    tokens = minilm.encode(texts[3])[0].outputs.data
    assert tokens.shape == (4, 384)   # [CLS] hello world [SEP], one vector each
    scores = [o.outputs.score for o in minilm.score(texts[3], [texts[3], texts[12]])]
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores[1] < 0.5


def test_minilm_refuses_what_it_cannot_serve(minilm):
    with pytest.raises(ValidationError, match="runner pooling"):
        minilm.generate("hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValidationError, match="classify"):
        minilm.classify("hi")
    with pytest.raises(ValidationError, match="Matryoshka"):
        minilm.embed("hi", PoolingParams(dimensions=8))
    with pytest.raises(ValidationError, match="max_model_len"):
        minilm.embed("word " * 400)
    with pytest.raises(ValidationError, match="empty"):
        minilm.embed({"prompt_token_ids": []})
    assert minilm.embed("still serving")[0].outputs.hidden_size == 384


def test_cross_encoder_scores_are_its_classifier(tmp_path, golden):
    """LLM.score on a cross-encoder: each pair in one input ([CLS] a [SEP] b [SEP], token
    types 0 then 1), the first label's probability, as the classifier gives it."""
    with LLM(str(write_bert_dir(tmp_path / "cross", classifier=True)), device="numpy") as llm:
        scores = [o.outputs.score for o in llm.score([a for a, _ in PAIRS],
                                                      [b for _, b in PAIRS])]
        probs = llm.classify(["the cat sat"])[0].outputs.probs
    for i, score in enumerate(scores):
        logits = golden[f"cross_logits_{i}"].astype(np.float64)
        want = np.exp(logits - logits.max())
        assert score == pytest.approx(want[0] / want.sum(), abs=1e-5)
    single = golden[f"cross_logits_{len(PAIRS)}"].astype(np.float64)
    want = np.exp(single - single.max())
    np.testing.assert_allclose(probs, want / want.sum(), atol=1e-5)
