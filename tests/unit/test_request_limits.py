"""The frontend's bounds on what one request may cost (README, "Reliability"), without an
engine: sampling-parameter sizes, prompt counting in pieces, truncation, salts, priority,
the preparation lanes, the Responses store's bytes, content types, the API key header, and
the deadlines for request headers and bodies."""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from vllm_actors import SamplingParams
from vllm_actors.errors import ValidationError
from vllm_actors.frontend import http_protocol, request_body
from vllm_actors.frontend.api_server import APIKeyMiddleware
from vllm_actors.frontend.input_processor import InputProcessor
from vllm_actors.frontend.openai_schema import APIError
from vllm_actors.frontend.responses_schema import ResponsesRequest, refuse_unsupported
from vllm_actors.frontend.preparation import PrepareLane, is_heavy
from vllm_actors.frontend.serving_responses import ResponseStore, StoredResponse
from vllm_actors.protocol.engine import EngineReady


@pytest.fixture(scope="module")
def processor(smollm2_tokenizer):
    return InputProcessor(smollm2_tokenizer, EngineReady(64, 16, 2048, 49152))


def refused(fn, *args, **kwargs) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        fn(*args, **kwargs)
    return info.value


def test_sampling_params_bound_their_lists():
    """Each bound names its field; n multiplies the stop strings every completion matches."""
    cases = [({"stop": ["a"] * 1025}, "stop"), ({"n": 8, "stop": ["ab"] * 1000}, "stop"),
             ({"bad_words": ["x"] * 10_001}, "bad_words"),
             ({"bad_words": ["x" * 70_000] * 2}, "bad_words"),
             ({"stop_token_ids": [1] * (2**20 + 1)}, "stop_token_ids"),
             ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]
    for kwargs, param in cases:
        assert refused(SamplingParams, **kwargs).param == param, kwargs
    SamplingParams(n=4, stop=["ab"] * 1000, bad_words=["x"] * 10_000,
                   truncate_prompt_tokens=-1)
    error = refused(SamplingParams, stop_token_ids=[1] * 100_000 + ["x"])
    assert len(str(error)) < 400, "an error message carries the whole list"


def test_brief_parameters_do_not_carry_lists():
    params = SamplingParams(n=2, temperature=0, stop_token_ids=list(range(40_000)),
                            bad_words=[f"w{i}" for i in range(5000)], stop=["\n"])
    brief = params.brief()
    assert len(brief) <= 403 and "stop_token_ids=<40000 items>" in brief, brief
    assert "n=2" in brief and "temperature=0" in brief and "stop=['\\n']" in brief


def test_a_text_far_over_the_context_is_refused_after_a_piece(processor, monkeypatch):
    """A 486 kB prompt (under the character cap of a 2048-token context) is refused after
    counting a piece or two; a text counted in pieces that fits is served whole."""
    pieces = []
    real = processor.tokenizer.encode_pieces
    monkeypatch.setattr(processor.tokenizer, "encode_pieces",
                        lambda texts: pieces.extend(map(len, texts)) or real(texts))
    error = refused(processor.prompt_token_ids, "lorem ipsum dolor sit amet " * 18_000)
    assert error.param == "prompt" and "more than 2047 tokens" in str(error)
    assert sum(pieces) <= 2 * 4 * 2047, pieces
    pieces.clear()
    fitting = " understanding" * 2040   # 2040 tokens in 28,560 characters: 4 pieces
    assert processor.prompt_token_ids(fitting)[1] == real([fitting])[0] and len(pieces) == 4
    assert "(2100 in its first" in str(refused(processor.process, "r", " understanding" * 2100,
                                               SamplingParams()))
    spaces = " " * (2047 * 5)   # runs of spaces pack many characters into a token
    assert processor.prompt_token_ids(spaces)[1]


def test_truncation_keeps_the_last_tokens(processor):
    _, whole = processor.prompt_token_ids("one two three four five six")
    _, last3 = processor.prompt_token_ids("one two three four five six", truncate=3)
    assert last3 == whole[-3:]
    assert processor.prompt_token_ids({"prompt_token_ids": [5, 6, 7]}, truncate=2)[1] == [6, 7]
    long = "word " * 30_000   # over the context, but truncated: served
    assert len(processor.prompt_token_ids(long, truncate=-1)[1]) == 2048
    assert refused(processor.truncate, [1], 4096).param == "truncate_prompt_tokens"
    request = processor.process("r", "one two three four five six",
                                SamplingParams(truncate_prompt_tokens=2)).request
    assert request.prompt_token_ids == whole[-2:]


def test_other_ids_that_end_generation_are_stop_token_ids(processor):
    """As vLLM's update_from_generation_config: the model's EOS stays the EOS, the other ids
    that end generation (Gemma's <end_of_turn>) join stop_token_ids, so a stop on one is
    named in stop_reason (it had been None); ignore_eos keeps neither."""
    import dataclasses
    tokenizer = dataclasses.replace(processor.tokenizer, eos_token_ids=(2, 0))
    two = InputProcessor(tokenizer, EngineReady(64, 16, 2048, 49152))
    request = two.process("r", "Hi", SamplingParams(stop_token_ids=[7])).request
    assert request.eos_token_ids == [2] and request.sampling_params.stop_token_ids == [7, 0]
    request = two.process("r", "Hi", SamplingParams(ignore_eos=True)).request
    assert request.eos_token_ids == [] and request.sampling_params.stop_token_ids == []
    assert processor.process("r", "Hi", SamplingParams()).request.eos_token_ids == [2]


def test_salt_priority_and_token_lists_are_checked(processor):
    request = processor.process("r", {"prompt": "Hi", "cache_salt": "tenant-a"},
                                SamplingParams()).request
    assert request.cache_salt == "tenant-a"
    for salt in ("", 5, "s" * 1025):
        assert refused(processor.process, "r", {"prompt": "Hi", "cache_salt": salt},
                       SamplingParams()).param == "cache_salt"
    assert "--scheduling-policy priority" in str(
        refused(processor.process, "r", "Hi", SamplingParams(), priority=1))
    priority = InputProcessor(processor.tokenizer, EngineReady(64, 16, 2048, 49152),
                              scheduling_policy="priority")
    assert priority.process("r", "Hi", SamplingParams(), priority=1).request.priority == 1
    for name in ("stop_token_ids", "allowed_token_ids"):
        assert refused(processor.process, "r", "Hi",
                       SamplingParams(**{name: [49152]})).param == name
        assert refused(processor.process, "r", "Hi",
                       SamplingParams(**{name: [1] * 49153})).param == name
    bad = processor.process("r", "Hi", SamplingParams(bad_words=["hello", "hello"]))
    one = processor.tokenizer.encode("hello", False)
    assert bad.request.sampling_params.bad_words_token_ids[0] == one


def test_heavy_requests_wait_in_their_own_bounded_lane():
    assert is_heavy(b'{"guided_grammar": "x"}') and is_heavy(b"x" * 70_000)
    assert not is_heavy(b'{"messages": [{"role": "user", "content": "hi"}]}')

    async def scenario():
        lane = PrepareLane("t", threads=1, max_waiting=1)
        release = threading.Event()
        running = [asyncio.ensure_future(lane.run(release.wait, 5, False)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as full:
            await lane.run(lambda: 1, 5, False)
        release.set()
        assert await asyncio.gather(*running) == [True, True]
        with pytest.raises(APIError) as slow:
            await lane.run(lambda: time.sleep(0.5), 0.05, True)
        await asyncio.sleep(0.6)
        return full.value, slow.value, lane.pending

    full, slow, pending = asyncio.run(scenario())
    assert full.status == 503 and full.code == "server_busy"
    assert slow.status == 503 and slow.code == "prepare_timeout"
    assert pending == 0   # the timed-out job left the lane when its thread finished


def test_response_store_is_bounded_in_bytes():
    store = ResponseStore(capacity=100, max_bytes=50_000)
    for i in range(20):
        store.put(f"r{i}", StoredResponse({"output": [], "text": "x" * 9_000}, []))
    assert store.num_bytes <= 50_000 and len(store) == 5
    assert store.get("r19") is not None and store.get("r0") is None
    store.put("huge", StoredResponse({"output": [], "text": "x" * 60_000}, []))
    assert store.get("huge") is None and len(store) == 5
    assert store.delete("r19") and store.num_bytes == sum(
        size for _, size in store._entries.values())
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}, {str(i): "v" for i in range(17)}):
        with pytest.raises(APIError) as info:
            refuse_unsupported(ResponsesRequest(input="x", metadata=metadata))
        assert info.value.param == "metadata"


class _Uvicorn:
    """A tiny app on uvicorn in a thread, with the server's protocol and middleware."""

    def __init__(self, app) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                http=http_protocol.HeaderDeadlineProtocol)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def tiny_server():
    async def echo(raw):
        try:
            body = await request_body.read_body(raw, 1000)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse({"size": len(body)})

    app = Starlette(routes=[Route("/v1/echo", echo, methods=["POST"])])
    server = _Uvicorn(APIKeyMiddleware(app, api_key="k"))
    yield server
    server.stop()


def test_content_type_and_one_api_key(tiny_server):
    url = f"http://127.0.0.1:{tiny_server.port}/v1/echo"
    ok = {"Authorization": "Bearer k"}
    assert httpx.post(url, json={}, headers=ok).json() == {"size": 2}
    assert httpx.post(url, content=b"{}", headers=ok).status_code == 200   # no type: JSON
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        r = httpx.post(url, content=b"{}", headers={**ok, "Content-Type": kind})
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    twice = [("Authorization", "Bearer k"), ("Authorization", "Bearer other")]
    for headers in (twice, twice[::-1], twice[:1] * 2):
        r = httpx.post(url, json={}, headers=headers)
        assert r.status_code == 401 and "more than one" in r.json()["error"]["message"]
    assert httpx.post(url, content=b"x" * 2000, headers=ok).status_code == 413
    gzipped = httpx.post(url, content=gzip.compress(b"{}"),
                         headers={**ok, "Content-Encoding": "gzip"})
    assert gzipped.status_code == 415 and "Content-Encoding 'gzip'" in gzipped.text


def test_headers_over_the_bound_get_431(tiny_server):
    """Headers just under 64 KiB pass (twice on one connection); over it the request is
    answered 431 and closed without its headers being buffered to the end."""
    url = f"http://127.0.0.1:{tiny_server.port}/v1/echo"
    with httpx.Client(headers={"Authorization": "Bearer k", "X-Pad": "a" * 60_000}) as client:
        assert [client.post(url, json={}).status_code for _ in range(2)] == [200, 200]
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as sock:
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 80_000)
        sock.settimeout(5)
        assert sock.recv(200).startswith(b"HTTP/1.1 431")


def test_slow_headers_and_bodies_are_cut_off(tiny_server, monkeypatch):
    monkeypatch.setattr(http_protocol.HeaderDeadlineProtocol, "header_timeout", 0.3)
    monkeypatch.setattr(request_body, "BODY_TIMEOUT_S", 0.3)
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as sock:
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\n")   # headers never end
        sock.settimeout(5)
        start = time.monotonic()
        assert sock.recv(100) == b"" and time.monotonic() - start < 3   # closed
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as sock:
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")   # the body never ends
        sock.settimeout(5)
        assert sock.recv(200).startswith(b"HTTP/1.1 408")
