"""The HTTP surface with raw requests: SSE chunk format field by field, errors in OpenAI's
shape, auth, the small endpoints, and aborts on disconnect."""

import json
import re

import httpx
import pytest
from server_process import wait_metric


def sse_events(response: httpx.Response) -> list[str]:
    events, data = [], []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and data:
            events.append("\n".join(data))
            data = []
    return events


def post(server, auth, path, body, headers=None, **kw):
    return httpx.post(server.url + path, json=body, headers={**auth, **(headers or {})},
                      timeout=60, **kw)


def test_chat_sse_format(server, auth):
    body = {"model": "smol", "messages": [{"role": "user", "content": "Say hi."}],
            "temperature": 0, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth,
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and c["model"] == "smol"
        assert isinstance(c["created"], int) and "usage" in c
    first, *middle, last_choice, usage_chunk = chunks
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]
    for c in middle:
        (choice,) = c["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}
        assert choice["finish_reason"] is None and set(choice["delta"]) == {"content"}
    (final,) = last_choice["choices"]
    assert final["finish_reason"] in ("stop", "length") and "stop_reason" in final
    assert usage_chunk["choices"] == []
    u = usage_chunk["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["completion_tokens"] == 8 or final["finish_reason"] == "stop"
    assert u["prompt_tokens_details"] == {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]}
    counts = [c["usage"]["completion_tokens"] for c in chunks[1:-1]]
    assert counts == sorted(counts) and counts[-1] == u["completion_tokens"]


def test_completion_sse_format(server, auth):
    body = {"model": "smol", "prompt": "Count: 1, 2,", "temperature": 0, "max_tokens": 6,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth,
                      timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for c in chunks:
        assert c["object"] == "text_completion" and c["id"].startswith("cmpl-")
        assert "usage" not in c
        (choice,) = c["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # two prompts (3 and 2 ids) x n=2: each chunk's continuous usage counts its own prompt
    # and choice, as vLLM's; the last chunk sums them all
    body = {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth,
                      timeout=60) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    seen = {i: [] for i in range(4)}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        assert c["usage"]["prompt_tokens"] == (3, 2)[choice["index"] // 2]
        seen[choice["index"]].append(c["usage"]["completion_tokens"])
    assert all(counts == sorted(counts) and counts[-1] == 3 for counts in seen.values()), seen
    assert chunks[-1]["usage"]["prompt_tokens"] == 5     # each prompt once, as vLLM counts
    assert chunks[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("path, body, status, param, pattern", [
    ("/v1/chat/completions", "{not json", 400, None, "not valid JSON"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
     404, "model", "`gpt-4` does not exist"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 9000}, 400, "max_tokens",
     r"maximum context length is 8192 tokens.*you requested 9031 tokens \(31 in the prompt, "
     r"9000 in the completion\)"),
    ("/v1/completions", {"prompt": [1] * 8192}, 400, "prompt", "prompt has 8192 tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "temperature": -1}, 400, "temperature",
     "temperature must be a finite number >= 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0},
     400, "n", "n must be between 1 and 128"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": "many"}, 400, "max_tokens", "Expected `int"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "Expected `array"),
    ("/v1/chat/completions", {"model": "smol"}, 400, "messages", "missing required field"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages", "role must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "tool_choice", "names function 'g', which is not in tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools",
     r"tools\[0\] must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format",
     "response_format.type must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400,
     "response_format", "needs a json_schema object"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a(b"}, 400, "guided_regex",
     "unclosed group"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "integer", "minimum": "x"}},
     400, "guided_json", "invalid json"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= missing"}, 400,
     "guided_grammar", "invalid grammar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "wat"}}}}, 400,
     "response_format", "invalid json"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {
                                  "name": "f", "parameters": {"type": "wat"}}}],
                              "tool_choice": "required"}, 400, "tools", "invalid json"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "guided_choice", "only one output constraint"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, 400,
     "structured_outputs", "choice must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "presence_penalty": 3}, 400, "presence_penalty",
     r"presence_penalty must be in \[-2, 2\]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 25}, 400, "top_logprobs",
     "^top_logprobs=25 .*--max-logprobs 20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "stream_options": {"include_usage": True}}, 400,
     "stream_options", "only be given with stream=true"),
    ("/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}, 400,
     "prompt_logprobs", "not available when stream=true"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}},
     400, "structured_outputs", "structural tags are not supported"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "--max-logprobs 20"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"60000": 5}}, 400, "logit_bias",
     "out of range"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix",
     "suffix is not supported yet"),
    ("/v1/completions", {"prompt": [1, 49152]}, 400, "prompt", "out of range"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "prompt must be a string"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "non-empty strings"),
    ("/v1/completions", {"prompt": ["a"] * 100, "n": 128, "max_tokens": 1}, 400, "prompt",
     r"at most 2048 completions \(prompts x n\), got 100 x 128"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages", "a part of type text needs a string `text`"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]},
                                           {"role": "user", "content": "x"}]},
     400, "messages", r"tool_calls\[0\] needs a `function` with a `name`"),
    # a huge echoed value is cut in the middle, the hint at the end kept
    ("/v1/chat/completions", {"model": "m" * 100_000,
                              "messages": [{"role": "user", "content": "x"}]}, 404, "model",
     r"^The model `m+ \.\.\. \(99\d{3} characters cut\) \.\.\. m+`.*serves `smol`"),
])
def test_bad_requests(server, auth, path, body, status, param, pattern):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.url + path, headers={**auth, "Content-Type": "application/json"},
                   timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and len(error["message"]) <= 1000
    assert error["param"] == param and re.search(pattern, error["message"]), error


def test_return_token_ids_stream_every_id(server, auth):
    """Byte tokens of unfinished characters (the three of one CJK character allowed): their
    text is held back, and the streamed token_ids still carry every id (they had been
    dropped with the chunks whose text was empty), chat and completions alike."""
    for path, first in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "x"}]})):
        body = {**first, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "allowed_token_ids": [180, 235, 121], "return_token_ids": True}
        (whole,) = post(server, auth, path, body).json()["choices"]
        with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                          headers=auth, timeout=60) as r:
            chunks = [json.loads(e) for e in sse_events(r)[:-1]]
        streamed = [t for c in chunks for choice in c["choices"]
                    for t in choice.get("token_ids") or []]
        assert len(whole["token_ids"]) == 6 and streamed == whole["token_ids"], path


def test_shapes_clients_send(server, auth):
    """What clients send that vLLM serves: documents, the function role, refusal and
    input_text parts, top_logprobs 0 without logprobs, a prediction (speed only); and the
    X-Request-Id header, which names the response before the body's request_id."""
    messages = [{"role": "function", "name": "f", "content": "42"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    body = {"messages": messages, "max_tokens": 1, "documents": [{"title": "a", "text": "b"}],
            "top_logprobs": 0, "prediction": {"type": "content", "content": "x"},
            "request_id": "body-1"}
    r = post(server, auth, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-body-1", r.text
    r = post(server, auth, "/v1/chat/completions", body, headers={"X-Request-Id": "h1"})
    assert r.json()["id"] == "chatcmpl-h1"
    r = post(server, auth, "/v1/completions", {"prompt": "x", "max_tokens": 1},
             headers={"X-Request-Id": "h2"})
    assert r.json()["id"] == "cmpl-h2"
    for bad in ("h" * 300, "\xff\xfe"):      # too long; not ASCII (read as latin-1)
        r = post(server, auth, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                 headers={"X-Request-Id": bad.encode("latin-1")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "test-key"}])
def test_auth_required(server, headers):
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=10,
                   json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401


def test_open_endpoints(server, auth):
    for path in ("/health", "/ping", "/version", "/metrics", "/"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200, path
    assert httpx.post(server.url + "/ping", timeout=10).status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()


def test_tokenize_detokenize_and_admin(server, auth):
    r = post(server, auth, "/tokenize", {"prompt": "The capital of France is",
                                         "return_token_strs": True}).json()
    assert r["tokens"] == [504, 3575, 282, 4649, 314] and r["count"] == 5
    assert r["max_model_len"] == 8192 and r["token_strs"][1] == "Ġcapital"
    chat = post(server, auth, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["tokens"][0] == 1
    assert post(server, auth, "/detokenize", {"tokens": r["tokens"]}).json() == \
        {"prompt": "The capital of France is"}
    assert post(server, auth, "/detokenize", {"tokens": [-1]}).status_code == 400
    info = httpx.get(server.url + "/server_info", headers=auth).json()
    assert info["engine"]["max_model_len"] == 8192 and "api_key" not in info["server"]
    assert post(server, auth, "/reset_prefix_cache", {}).json() == {"reset": True}
    # lm-evaluation-harness's remote tokenizer: special tokens by name, then /tokenize
    assert httpx.get(server.url + "/tokenizer_info").status_code == 401
    tok = httpx.get(server.url + "/tokenizer_info", headers=auth).json()
    assert (tok["bos_token"], tok["eos_token"], tok["add_bos_token"],
            tok["model_max_length"]) == ("<|im_start|>", "<|im_end|>", False, 8192)
    assert "<|im_start|>assistant" in tok["chat_template"]
    assert post(server, auth, "/tokenize", {"prompt": tok["eos_token"],
                                            "add_special_tokens": False}).json()["tokens"] == [2]


def wait_running(server, predicate, timeout=10.0):
    return wait_metric(server.url, "vllm:num_requests_running", predicate, timeout)


def test_streaming_disconnect_aborts(server, auth):
    body = {"prompt": "Count to a thousand:", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth,
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert wait_running(server, lambda v: v >= 1) >= 1
    wait_running(server, lambda v: v == 0)


def test_a_refused_batch_leaves_nothing_running(server, auth):
    """A completions batch refused for an id in flight (its first prompt's sub-request id
    is a running request's) aborts its other prompts: they had run to the end unread."""
    body = {"prompt": "Count to a thousand:", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={**auth, "X-Request-Id": "held"}) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        batch = {"prompt": ["a", "b", "c"], "max_tokens": 3000, "ignore_eos": True}
        refused = post(server, auth, "/v1/completions", batch, headers={"X-Request-Id": "held"})
        assert refused.status_code == 400 and "already in use" in refused.text
        wait_running(server, lambda v: v == 1, timeout=5)
    wait_running(server, lambda v: v == 0)


def test_non_streaming_disconnect_aborts(server, auth):
    body = {"prompt": "Count to a thousand:", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=1.5)
    wait_running(server, lambda v: v == 0)


def test_metrics_names(server, auth):
    post(server, auth, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 'vllm:request_success_total{engine="0",finished_reason="length",model_name="smol"}',
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket"):
        assert name in text, name
