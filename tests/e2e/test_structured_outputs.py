"""Structured outputs, tool calls and reasoning over the OpenAI API, with the `openai` client
on SmolLM2 (the session server runs --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
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
        "required": ["country", "capital"]}},
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


def _closed(schema):
    """The schema as the server enforces it by default: objects without
    additionalProperties get only their declared keys (for jsonschema to check)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "items" in out:
        out["items"] = _closed(out["items"])
    if "anyOf" in out:
        out["anyOf"] = [_closed(s) for s in out["anyOf"]]
    if "properties" in out:
        out["properties"] = {k: _closed(v) for k, v in out["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": NAME, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": NAME},
                                       "required": ["zone"]}}}


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
        jsonschema.validate(json.loads(choice.message.content), _closed(schema))


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
    jsonschema.validate(args, _closed(schema))
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
    streamed: a call the model chose arrives whole in the last chunk, as the message has
    it)."""
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
    [piece] = pieces
    assert piece.index == 0 and piece.function.name == "get_weather"
    assert piece.id.startswith("chatcmpl-tool-") and json.loads(piece.function.arguments) == args


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
    assert message.content and "reasoning" not in (message.model_extra or {})


def test_reasoning_the_prompt_opened_and_reasoning_left_out(client):
    """A prompt that ends with `<think>` (here an open final message; Qwen3.5's template
    writes it) makes the output reasoning up to `</think>` (it had all been content),
    under vLLM's name and its older one; `include_reasoning: false` leaves it out."""
    kw = dict(model=MODEL, temperature=0, max_tokens=12,
              messages=[{"role": "user", "content": "Is the sky blue?"},
                        {"role": "assistant", "content": "<think>"}],
              extra_body={"continue_final_message": True, "add_generation_prompt": False})
    message = client.chat.completions.create(**kw).choices[0].message
    extra = message.model_extra or {}
    assert extra["reasoning"] == extra["reasoning_content"] and extra["reasoning"]
    kw["extra_body"] = {**kw["extra_body"], "include_reasoning": False}
    hidden = client.chat.completions.create(**kw).choices[0].message
    assert not set(hidden.model_extra or {}) & {"reasoning", "reasoning_content"}


def test_readme_json_schema_example(client, capsys):
    """The README's json_schema example, run as written (only the model renamed to the test
    server's): a clean answer, exactly the key `answer` holding an integer."""
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    [block] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
               if '"json_schema"' in b]
    code = block.replace('"SmolLM2-135M-Instruct.Q4_1"', repr(MODEL))
    assert code != block
    scope = {"client": client}
    exec(code, scope)   # noqa: S102 - the README's own example
    reply = scope["reply"]
    content = reply.choices[0].message.content
    assert capsys.readouterr().out == content + "\n"
    data = json.loads(content)
    assert list(data) == ["answer"] and type(data["answer"]) is int, content
    assert reply.choices[0].finish_reason == "stop"


def test_readme_schema_sampled_gives_clean_answers(client):
    """The README's request sampled at temperature 1 (seeded): every answer is exactly
    {"answer": integer}; without strict schemas about half ran on with invented keys."""
    def ask(seed):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "2+2?"}], temperature=1.0,
            seed=seed, max_tokens=40, response_format=ANSWER).choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, range(8)))
    for choice in choices:
        data = json.loads(choice.message.content)
        assert list(data) == ["answer"] and type(data["answer"]) is int, choice.message.content
        assert choice.finish_reason == "stop"


def test_structured_outputs_opt_out_over_http(client):
    """disable_additional_properties=false compiles the schema as JSON Schema reads it: an
    object with no declared keys and minProperties 1 is satisfiable only that way (and the
    model, free to invent keys, goes on until max_tokens: why strict is the default)."""
    schema = {"type": "object", "properties": {}, "minProperties": 1}
    reply = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=40, temperature=0, extra_body={
            "structured_outputs": {"json": schema, "disable_additional_properties": False}})
    assert re.match(r'\{"[^"]+":', reply.choices[0].text), reply.choices[0].text
    with pytest.raises(openai.BadRequestError, match="minProperties"):
        client.completions.create(model=MODEL, prompt="JSON:", max_tokens=40,
                                  extra_body={"structured_outputs": {"json": schema}})


def test_a_refused_request_leaves_the_connection_open(server, auth):
    """A 400 (here a regex llguidance refuses) is answered inside the app: the same
    keep-alive connection serves the next request, and the server logs no traceback."""
    logged = len(server.log())
    body = {"model": MODEL, "prompt": "JSON:", "max_tokens": 2}
    with httpx.Client(base_url=server.url, headers=auth, timeout=120) as http:
        bad = http.post("/v1/completions", json=dict(body, structured_outputs={"regex": "a(b"}))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs"
        assert http.post("/v1/completions", json=body).status_code == 200
    assert "Exception in ASGI application" not in server.log()[logged:]


def _whole_message(client, kw):
    choice = client.chat.completions.create(**kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content or None, calls, choice.finish_reason


def _streamed_message(client, kw):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            entry = calls.setdefault(piece.index, ["", ""])
            entry[0] += piece.function.name or ""
            entry[1] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [tuple(c) for c in calls.values()], finish


ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
SAME_MESSAGE = {   # case: (question, request fields, max_tokens, cut short)
    "json_schema": ("2+2?", {"response_format": ANSWER}, 60, False),
    "json_schema cut short": ("2+2?", {"response_format": ANSWER}, 3, True),
    "required": ("Weather and time in Oslo?", {"tools": [WEATHER, TIME],
                                               "tool_choice": "required"}, 80, False),
    "required cut short": ("Weather and time in Oslo?", {"tools": [WEATHER, TIME],
                                                         "tool_choice": "required"}, 12, True),
    "named": ("Weather in Oslo?", {"tools": [WEATHER, TIME], "tool_choice": NAMED_WEATHER},
              60, False),
    "named cut short": ("Weather in Oslo?", {"tools": [WEATHER], "tool_choice": NAMED_WEATHER},
                        5, True),
}


@pytest.mark.parametrize("case", list(SAME_MESSAGE))
def test_streamed_and_whole_answers_are_the_same_message(client, case):
    """One seeded request asked whole and streamed gives the same message: content, tool
    calls (name, arguments) and finish reason, also when max_tokens cuts it short."""
    question, fields, max_tokens, cut = SAME_MESSAGE[case]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": question}],
              temperature=0.8, seed=11, max_tokens=max_tokens, **fields)
    whole = _whole_message(client, kw)
    assert _streamed_message(client, kw) == whole
    content, calls, finish = whole
    if cut:
        assert finish == "length"
    elif "response_format" in fields:
        assert finish == "stop" and list(json.loads(content)) == ["answer"]
    else:
        tools = fields["tools"]
        assert finish == ("tool_calls" if fields["tool_choice"] == "required" else "stop")
        assert content is None and calls
        for name, arguments in calls:
            schema = next(t["function"]["parameters"] for t in tools
                          if t["function"]["name"] == name)
            jsonschema.validate(json.loads(arguments), _closed(schema))
    if "tools" in fields and cut:
        assert calls and content is None   # the begun call, as streamed
