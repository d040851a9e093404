"""Structured outputs, tool calls and reasoning over the OpenAI API, with the `openai` client
on SmolLM2 (the session server runs --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

pytestmark = pytest.mark.slow

MODEL = "smol"
ASK = [{"role": "user", "content": "Answer with data about a famous city."}]

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"city": NAME}, "required": ["city"]},
    {"type": "object", "properties": {"city": NAME, "year": {"type": "integer", "minimum": 1000,
                                                             "maximum": 2025}},
     "required": ["city", "year"]},
    {"type": "object", "properties": {"big": {"type": "boolean"}}, "required": ["big"]},
    {"type": "object", "properties": {"size": {"enum": ["small", "medium", "large"]}},
     "required": ["size"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"where": {
        "type": "object", "properties": {"country": NAME, "capital": {"type": "boolean"}},
        "required": ["country", "capital"], "additionalProperties": False}},
     "required": ["where"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"rating": {"type": "number", "minimum": 0,
                                                 "maximum": 5}}, "required": ["rating"]},
    {"type": "object", "properties": {"name": NAME, "nick": {"anyOf": [NAME, {"type": "null"}]}},
     "required": ["name", "nick"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                      "open": {"const": True}},
     "required": ["code", "open"]},
]
for schema in SCHEMAS:
    if schema["type"] == "object":
        schema["additionalProperties"] = False

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": NAME, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": NAME},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_outputs_validate(client, temperature):
    def ask(i_schema):
        i, schema = i_schema
        return client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=120, temperature=temperature, seed=i,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema}})

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        replies = list(pool.map(ask, enumerate(SCHEMAS)))
    for schema, reply in zip(SCHEMAS, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_vllm_field_names(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Reply in JSON: {"answer": ...}. '
                                                           "What is 2+2?"}],
        max_tokens=80, response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = client.completions.create(model=MODEL, prompt="The answer:", max_tokens=40,
                                      temperature=0, extra_body={"structured_outputs": {
                                          "json": json.dumps(SCHEMAS[1])}})
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMAS[1])


@pytest.mark.parametrize("body, check", [
    ({"guided_regex": r"\d{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2,4}", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'},
     lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
    ({"guided_grammar": 'start: word "!"\nword: "A" | "B" | "AB"\n'},
     lambda t: t in ("A!", "B!", "AB!")),
])
def test_regex_choice_and_grammars_constrain(client, body, check):
    for temperature in (0.0, 1.0):
        reply = client.completions.create(model=MODEL, prompt="Say something:", max_tokens=30,
                                          temperature=temperature, extra_body=body)
        text = reply.choices[0].text
        assert check(text), text
        assert reply.choices[0].finish_reason == "stop"


def _tool_call_args(call, tools):
    schema = next(t["function"]["parameters"] for t in tools
                  if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def test_named_tool_choice_is_forced(client):
    tools = [WEATHER, TIME]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
        max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    _tool_call_args(call, tools)


def test_required_tool_choice_and_stream_reassembly(client):
    tools = [WEATHER, TIME]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
              tools=tools, tool_choice="required", temperature=0, max_tokens=80)
    reply = client.chat.completions.create(**kw)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(_tool_call_args(c, tools) is not None for c in calls)

    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        for piece in delta.tool_calls or []:
            entry = streamed.setdefault(piece.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = entry["id"] or piece.id
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(e["name"], json.loads(e["arguments"])) for e in streamed.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert all(e["id"].startswith("chatcmpl-tool-") for e in streamed.values())


def test_named_tool_streams_its_arguments(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
              tools=[WEATHER], temperature=0, max_tokens=60,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    pieces = [p for chunk in client.chat.completions.create(**kw, stream=True)
              for p in chunk.choices[0].delta.tool_calls or []]
    assert len(pieces) > 2   # the arguments arrive as they are generated
    assert pieces[0].function.name == "get_weather" and pieces[0].id
    assert "".join(p.function.arguments or "" for p in pieces) == whole.function.arguments


HERMES_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", '
               r'"unit": "(celsius|fahrenheit)"\}\}</tool_call>')


def test_auto_tool_choice_parses_hermes_calls(client):
    """The model is steered into writing a hermes tool call; the parser finds it (whole and
    streamed)."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
              tools=[WEATHER], temperature=0, max_tokens=60,
              extra_body={"guided_regex": r"Checking\. " + HERMES_CALL})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking. "
    [call] = choice.message.tool_calls
    args = _tool_call_args(call, [WEATHER])
    content, pieces = "", []
    for chunk in client.chat.completions.create(**kw, stream=True):
        content += chunk.choices[0].delta.content or ""
        pieces += chunk.choices[0].delta.tool_calls or []
    assert content == "Checking. "
    assert len(pieces) > 2 and {p.index for p in pieces} == {0}   # arguments as written
    assert pieces[0].function.name == "get_weather" and pieces[0].id.startswith("chatcmpl-tool-")
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == args


def test_tool_history_round_trip(client):
    """A tool result in the history goes through the chat template and the chat goes on."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                           tool_choice="none", max_tokens=8, temperature=0)
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 20


def test_reasoning_split_whole_and_streamed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
              temperature=0, max_tokens=40,
              extra_body={"guided_regex": r"<think>[a-z ]{4,40}</think>(Yes|No)\."})
    message = client.chat.completions.create(**kw).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z ]{4,40}", reasoning) and message.content in ("Yes.", "No.")
    got = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        got["content"] += delta.content or ""
        got["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert got == {"reasoning_content": reasoning, "content": message.content}


def test_plain_chat_has_no_reasoning_field(client):
    message = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        temperature=0).choices[0].message
    assert message.content and "reasoning_content" not in (message.model_extra or {})
