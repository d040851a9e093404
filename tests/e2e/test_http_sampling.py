"""The sampling surface over HTTP: OpenAI's logprobs shapes, prompt_logprobs, vLLM's extra
fields."""

import json

import httpx


def post(server, auth, path, body):
    r = httpx.post(server.url + path, json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_logprobs_shape(server, auth, client):
    body = post(server, auth, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0,
        "max_tokens": 5, "logprobs": True, "top_logprobs": 3})
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][-1]["logprob"]
        assert entry["top_logprobs"][0]["token"] == entry["token"]   # greedy: the best one
    r = client.chat.completions.create(model="smol", temperature=0, max_tokens=4,
                                       logprobs=True, top_logprobs=2,
                                       messages=[{"role": "user", "content": "Say hello."}])
    assert [t.token for t in r.choices[0].logprobs.content] == \
        [e["token"] for e in content[:4]]


def test_completion_logprobs_and_prompt_logprobs(server, auth):
    body = post(server, auth, "/v1/completions", {
        "prompt": "The capital of France is", "temperature": 0, "max_tokens": 4,
        "logprobs": 2, "prompt_logprobs": 1, "echo": True})
    choice = body["choices"][0]
    lp = choice["logprobs"]
    # echo: the 5 prompt tokens (the first without a logprob) before the 4 generated ones
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 9
    assert lp["text_offset"][5] == len("The capital of France is")
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:5])   # prompt_logprobs 1
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"][5:])
    prompt_lp = choice["prompt_logprobs"]
    assert len(prompt_lp) == 5 and prompt_lp[0] is None
    assert prompt_lp[1]["3575"]["decoded_token"] == " capital"
    assert all(v["logprob"] <= 0 for p in prompt_lp[1:] for v in p.values())


def test_streamed_logprobs_cover_every_token(server, auth):
    with httpx.stream("POST", server.url + "/v1/completions", headers=auth, timeout=60, json={
            "prompt": "東京は", "temperature": 0, "max_tokens": 8, "logprobs": 1,
            "stream": True}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line)["choices"][0] for line in lines]
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks if c["logprobs"]) == 8


def test_vllm_extra_fields(server, auth):
    body = post(server, auth, "/v1/completions", {
        "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.7, "seed": 1,
        "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
        "min_tokens": 8, "ignore_eos": True, "stop_token_ids": [2], "bad_words": ["Paris"],
        "allowed_token_ids": list(range(1000))})
    assert body["usage"]["completion_tokens"] == 8 and "Paris" not in body["choices"][0]["text"]
    chat = post(server, auth, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
        "logit_bias": {"504": 100}})
    assert chat["choices"][0]["message"]["content"] == "TheTheThe"   # token 504 is "The"
