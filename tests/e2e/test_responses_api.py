"""POST /v1/responses (and GET / DELETE /v1/responses/{id}) with the official openai client
on SmolLM2 (the session server runs --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3). Bodies and events are also checked against the SDK's typed
models, strictly."""

from __future__ import annotations

import json
import re
import socket

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

pytestmark = pytest.mark.slow

MODEL = "smol"
QUESTION = "What is the capital of France?"
GREEDY = dict(model=MODEL, temperature=0)
NAME = {"type": "string", "minLength": 1, "maxLength": 12}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "strict": True, "parameters": {
               "type": "object", "properties": {
                   "city": NAME, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": NAME}, "required": ["zone"],
    "additionalProperties": False}}
EVENT = TypeAdapter(ResponseStreamEvent)
USAGE_KEYS = {"input_tokens", "output_tokens", "total_tokens", "input_tokens_details",
              "output_tokens_details"}


def _check_usage(usage: dict) -> None:
    assert set(usage) == USAGE_KEYS
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert set(usage["input_tokens_details"]) == {"cached_tokens"}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


def _validate(body: dict) -> Response:
    """The SDK's Response model, validated strictly. Its usage model also wants
    `cache_write_tokens`, which this server does not report; usage is checked by hand."""
    usage = body.get("usage")
    if usage is not None:
        _check_usage(usage)
    return Response.model_validate({**body, "usage": None})


def _create(client, **kw) -> tuple[dict, Response]:
    """(the raw JSON body, the client's parsed response), the body validated."""
    raw = client.responses.with_raw_response.create(**kw)
    body = raw.http_response.json()
    _validate(body)
    return body, raw.parse()


def _comparable(response: dict) -> dict:
    """A response without what differs between two runs of one request (ids, times, how
    much of the prompt the prefix cache held)."""
    drop = {"id", "created_at", "completed_at"}
    out = {k: v for k, v in response.items() if k not in drop}
    if out["usage"] is not None:
        out["usage"] = {**out["usage"], "input_tokens_details": None}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                     for item in response["output"]]
    return out


def _sse(server, auth, body: dict) -> list[dict]:
    """Every event of a streamed response, each checked against the SDK's event models."""
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True},
                      headers=auth, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        if "response" in e:
            _validate(e["response"])
        else:
            EVENT.validate_python(e)
    return events


def test_string_input_and_message_list_agree(client):
    body, r = _create(client, input=QUESTION, max_output_tokens=32, **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and [p.type for p in item.content] == ["output_text"]
    assert "Paris" in r.output_text and r.output_text == item.content[0].text
    assert r.usage.input_tokens == 37   # the same prompt as the chat endpoint's
    assert (body["temperature"], body["max_output_tokens"], body["tool_choice"],
            body["tools"], body["store"], body["text"]) == \
        (0.0, 32, "auto", [], True, {"format": {"type": "text"}})
    listed, r2 = _create(client, input=[{"role": "user", "content": [
        {"type": "input_text", "text": QUESTION}]}], max_output_tokens=32, **GREEDY)
    assert r2.output_text == r.output_text and r2.usage.input_tokens == 37
    assert _comparable(listed) == _comparable(body)


def test_instructions_are_a_system_message_in_front(client):
    r = client.responses.create(input=QUESTION, instructions="Answer in one word.",
                                max_output_tokens=16, **GREEDY)
    chat = client.chat.completions.create(
        messages=[{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": QUESTION}], max_tokens=16, **GREEDY)
    assert r.instructions == "Answer in one word."
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens != 37
    assert r.usage.output_tokens == chat.usage.completion_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    body, r = _create(client, input="Tell me a long story about a dragon.",
                      max_output_tokens=3, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    assert r.output_text


def test_vllm_sampling_extras_apply(client):
    """stop, ignore_eos and structured_outputs act as on the chat endpoint (they were
    accepted and ignored)."""
    free = client.responses.create(input=QUESTION, max_output_tokens=32, **GREEDY)
    word = free.output_text.split()[2]
    cut = client.responses.create(input=QUESTION, max_output_tokens=32,
                                  extra_body={"stop": [word]}, **GREEDY)
    assert cut.status == "completed"
    assert cut.output_text == free.output_text[:free.output_text.index(word)]
    assert free.usage.output_tokens < 32
    long = client.responses.create(input=QUESTION, max_output_tokens=32,
                                   extra_body={"ignore_eos": True}, **GREEDY)
    assert long.usage.output_tokens == 32 and long.status == "incomplete"
    chosen = client.responses.create(input=QUESTION, max_output_tokens=8, extra_body={
        "structured_outputs": {"choice": ["yes", "no"]}}, **GREEDY)
    assert chosen.output_text in ("yes", "no")


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"city": NAME, "country": NAME},
              "required": ["city", "country"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    body, r = _create(client, input="Name a famous city.", text={"format": fmt},
                      max_output_tokens=60, **GREEDY)
    assert r.status == "completed" and body["text"] == {"format": fmt}
    jsonschema.validate(json.loads(r.output_text), schema)


def _arguments(call, tools) -> dict:
    schema = next(t["parameters"] for t in tools if t["name"] == call.name)
    args = json.loads(call.arguments)
    jsonschema.validate(args, schema)
    return args


def test_named_and_required_function_tools(client):
    body, r = _create(client, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=60,
                      tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    assert _arguments(call, [WEATHER])["city"] == "Paris"
    assert body["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert body["tools"] == [WEATHER] and r.status == "completed"
    r = client.responses.create(input="What time is it in Tokyo?", tools=[WEATHER, TIME],
                                tool_choice="required", max_output_tokens=80, **GREEDY)
    assert r.status == "completed" and r.output
    assert all(c.type == "function_call" and _arguments(c, [WEATHER, TIME]) for c in r.output)


def test_function_call_output_continues_the_conversation(client):
    first = client.responses.create(input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=60, **GREEDY)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}
    kw = dict(tools=[WEATHER], tool_choice="none", max_output_tokens=24, **GREEDY)
    chained = client.responses.create(previous_response_id=first.id, input=[result], **kw)
    replayed = client.responses.create(input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments}, result], **kw)
    assert chained.previous_response_id == first.id and chained.output_text
    assert chained.output_text == replayed.output_text
    assert chained.usage.input_tokens == replayed.usage.input_tokens > first.usage.input_tokens


def test_previous_response_id_replays_the_conversation(client):
    first = client.responses.create(input=QUESTION, instructions="Be brief.",
                                    max_output_tokens=32, **GREEDY)
    second = client.responses.create(input="And of Germany?", previous_response_id=first.id,
                                     max_output_tokens=32, **GREEDY)
    # instructions are not carried over: the replay has no system message of ours
    replay = client.responses.create(input=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Germany?"}], max_output_tokens=32, **GREEDY)
    assert second.output_text == replay.output_text and "Berlin" in second.output_text
    assert second.usage.input_tokens == replay.usage.input_tokens
    assert second.usage.input_tokens > 37 + first.usage.output_tokens
    assert second.instructions is None and second.previous_response_id == first.id


def test_store_false_retrieve_and_delete(client):
    kept = client.responses.create(input="Hi", max_output_tokens=4, **GREEDY)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    unkept = client.responses.create(input="Hi", max_output_tokens=4, store=False, **GREEDY)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="Go on", previous_response_id=unkept.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "response_not_found"
    assert "store=false" in e.value.body["message"] and "last 256" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_stream_events_in_order_and_equal_to_json(server, auth, client):
    request = dict(input=QUESTION, max_output_tokens=32, **GREEDY)
    events = _sse(server, auth, request)
    kinds = [e["type"] for e in events]
    n = kinds.count("response.output_text.delta")
    assert n > 3 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * n,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["id"] == final["id"] and created["usage"] is None
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == events[-4]["text"] == final["output"][0]["content"][0]["text"]
    assert events[-2]["item"] == final["output"][0]
    whole = client.responses.with_raw_response.create(**request).http_response.json()
    assert _comparable(final) == _comparable(whole)
    with client.responses.stream(**request) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        streamed = stream.get_final_response()
    assert deltas == streamed.output_text == whole["output"][0]["content"][0]["text"]
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text


def test_stream_function_call_events(server, auth, client):
    request = dict(input="Weather in Paris?", tools=[WEATHER], max_output_tokens=60,
                   tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    events = _sse(server, auth, request)
    kinds = [e["type"] for e in events]
    n = kinds.count("response.function_call_arguments.delta")
    assert n > 2 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * n,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = events[-1]["response"]
    [call] = final["output"]
    added = events[2]["item"]
    assert (added["id"], added["call_id"], added["name"], added["arguments"]) == \
        (call["id"], call["call_id"], "get_weather", "")
    arguments = "".join(e["delta"] for e in events if "arguments.delta" in e["type"])
    assert arguments == events[-3]["arguments"] == call["arguments"]
    whole = client.responses.with_raw_response.create(**request).http_response.json()
    assert _comparable(final) == _comparable(whole)


def test_stream_cut_by_max_output_tokens_ends_incomplete(server, auth):
    events = _sse(server, auth, dict(input="Tell me a long story about a dragon.",
                                     max_output_tokens=3, **GREEDY))
    final = events[-1]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["usage"]["output_tokens"] == 3
    assert events[-2]["item"]["status"] == "incomplete"


def test_output_logprobs(server, auth, client):
    request = dict(input=QUESTION, max_output_tokens=6, include=["message.output_text.logprobs"],
                   top_logprobs=2, **GREEDY)
    body, r = _create(client, **request)
    logprobs = body["output"][0]["content"][0]["logprobs"]
    assert len(logprobs) == r.usage.output_tokens == 6
    assert "".join(lp["token"] for lp in logprobs) == r.output_text
    for lp in logprobs:
        assert len(lp["top_logprobs"]) == 2 and lp["top_logprobs"][0]["token"] == lp["token"]
        assert lp["logprob"] <= 0 and lp["bytes"] == list(lp["token"].encode())
    events = _sse(server, auth, request)
    streamed = [lp for e in events if e["type"] == "response.output_text.delta"
                for lp in e["logprobs"]]
    assert [lp["token"] for lp in streamed] == [lp["token"] for lp in logprobs]
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == logprobs


@pytest.mark.parametrize("body, status, param, pattern", [
    ({"input": "x", "background": True}, 400, "background", "background mode is not supported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools",
     "only function tools are supported, got type 'web_search'"),
    ({"input": 3}, 400, "input", r"Expected `str \| array`"),
    ({"model": MODEL}, 400, "input", "missing required field `input`"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input", "role must be one of"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     400, "input", "only text parts"),
    ({"input": "x", "max_output_tokens": 9000}, 400, "max_output_tokens",
     "maximum context length is 8192 tokens"),
    ({"input": "x", "temperature": -1}, 400, "temperature", "temperature must be"),
    ({"input": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "must be"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text",
     "text.format.type must be"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                        "schema": {"type": "wat"}}}}, 400, "text",
     "invalid json"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice", "names function 'nope', which is not in tools"),
    ({"input": "x", "include": [5]}, 400, "include", "Expected `str`"),
    ({"input": "x", "truncation": "middle"}, 400, "truncation", "is not \"auto\""),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id",
     "Response with id 'resp_nope' not found"),
    ({"input": "x", "model": "gpt-4o"}, 404, "model", "`gpt-4o` does not exist"),
])
def test_malformed_bodies_name_the_field(server, auth, body, status, param, pattern):
    r = httpx.post(server.url + "/v1/responses", json=body, headers=auth, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert re.search(pattern, error["message"]), error["message"]


def test_an_error_keeps_the_connection_open(server, auth):
    """A 4xx answer leaves the keep-alive connection usable for the next request."""
    host, port = server.url.removeprefix("http://").split(":")
    request = (f"GET /v1/responses/resp_nope HTTP/1.1\r\nHost: {host}\r\n"
               f"Authorization: {auth['Authorization']}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for _ in range(3):
            sock.sendall(request)
            head, body = b"", b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                assert chunk, "the server closed the connection after an error"
                head += chunk
            head, _, body = head.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 404")
            assert json.loads(body)["error"]["code"] == "response_not_found"
