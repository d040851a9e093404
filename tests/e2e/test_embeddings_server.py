"""all-MiniLM-L6-v2 behind a real `vllm-actors serve`, with the openai client: embeddings in
float and base64 against sentence-transformers (tests/golden/pooling.npz), vLLM's /pooling,
/score and /rerank shapes, and the 4xx contract (a chat request names --runner, bad inputs
name their field) while /health and /metrics keep answering."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from server_process import ServerProcess
from tiny_pooling import GOLDEN, embed_texts

MIN_COSINE = 0.99999
NAME = "minilm"


@pytest.fixture(scope="module")
def server(minilm_path):
    proc = ServerProcess(str(minilm_path), "--served-model-name", NAME)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def _min_cosine(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    return float(cos.min())


def test_openai_embeddings_float_and_base64(client, server):
    want = np.load(GOLDEN)["minilm_st"]
    texts = embed_texts()
    extra = {"truncate_prompt_tokens": -1}
    floats = client.embeddings.create(model=NAME, input=texts, encoding_format="float",
                                      extra_body=extra)
    assert [d.index for d in floats.data] == list(range(64)) and floats.model == NAME
    got = np.array([d.embedding for d in floats.data])
    assert _min_cosine(got, want) >= MIN_COSINE
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 64
    raw = client.embeddings.create(model=NAME, input=texts[:8], encoding_format="base64")
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in raw.data])
    np.testing.assert_allclose(decoded, got[:8], atol=1e-6)
    default = client.embeddings.create(model=NAME, input=texts[3])   # the client's base64
    np.testing.assert_allclose(default.data[0].embedding, got[3], atol=1e-6)
    ids = client.embeddings.create(model=NAME, input=[[101, 7592, 2088, 102]],
                                   encoding_format="float")
    np.testing.assert_allclose(ids.data[0].embedding, got[3], atol=1e-6)


def test_vllm_pooling_score_and_rerank(server):
    url = server.url
    pooled = httpx.post(url + "/pooling", json={"input": "Hello world"}).json()
    assert np.array(pooled["data"][0]["data"]).shape == (4, 384)
    score = httpx.post(url + "/score", json={"text_1": "Hello world",
                                             "text_2": ["Hello world", "tax law"]}).json()
    assert score["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert score["data"][1]["score"] < 0.5
    for first, second in (("queries", "documents"), ("queries", "items"),
                          ("data_1", "data_2")):     # newer vLLM's names for the sides
        named = httpx.post(url + "/score", json={first: "Hello world",
                                                 second: ["Hello world", "tax law"]}).json()
        # the same pairs; float32 sums of another batch shape part in the 7th digit (2.2e-7
        # seen), so the scores agree to 1e-6
        assert [d["score"] for d in named["data"]] == pytest.approx(
            [d["score"] for d in score["data"]], abs=1e-6)
    # add_special_tokens false: the text's own ids, as if sent as token ids
    ids = httpx.post(url + "/tokenize", json={"prompt": "hi", "add_special_tokens": False}
                     ).json()["tokens"]
    bare, given = (httpx.post(url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
                   for body in ({"input": "hi", "add_special_tokens": False}, {"input": ids}))
    assert bare == given
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        rerank = httpx.post(url + path, json={
            "model": NAME, "query": "a pet cat", "top_n": 2,
            "documents": ["tax law", {"text": "my cat sleeps"}, "stock prices"]}).json()
        assert [r["index"] for r in rerank["results"]][0] == 1, rerank
        assert len(rerank["results"]) == 2
        assert rerank["results"][0]["document"] == {"text": "my cat sleeps"}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [{"text": 1}]}, "input"),
    ("/v1/embeddings", {"input": "word " * 400}, "input"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": [99999999]}, "input"),
    ("/v1/embeddings", {"input": ["a", [101, 102]]}, "input"),
    ("/score", {"text_1": "a", "queries": "b", "text_2": "c"}, "text_1"),
    ("/classify", {"input": "hi"}, "task"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
])
def test_bad_requests_get_4xx_and_the_server_stays_up(server, path, body, param):
    r = httpx.post(server.url + path, json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    if path == "/v1/chat/completions":
        assert "--runner" in r.json()["error"]["message"]
    if body.get("input") == "word " * 400:    # litellm maps these words to a context error
        assert r.json()["error"]["message"].startswith(
            "This model's maximum context length is 256 tokens (max_model_len). However, "
            "the input has")
    assert httpx.get(server.url + "/health").status_code == 200


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and 'finished_reason="stop"' in line or \
                line.startswith(name + "{") and "finished_reason" not in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_unknown_model_and_metrics(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    done, tokens = (_metric(server, "vllm:request_success_total"),
                    _metric(server, "vllm:prompt_tokens_total"))
    ok = httpx.post(server.url + "/v1/embeddings", json={"input": ["a", "b c"]})
    assert ok.status_code == 200
    assert _metric(server, "vllm:request_success_total") == done + 2
    assert _metric(server, "vllm:prompt_tokens_total") == tokens + 7
