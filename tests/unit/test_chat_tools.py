"""Tool-call parsers, reasoning parsers and the chat message/stream shaping, on scripted
outputs: every parser finds its format, leaves other text as content, and streamed pieces
(in any chunking) add up to the whole message."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from grammar_text import params_accept

from vllm_actors.config import ServerConfig
from vllm_actors.frontend.chat_tools import ToolPlan, choice_parser, plan_tools
from vllm_actors.frontend.openai_schema import APIError, ChatCompletionRequest, chat_messages
from vllm_actors.frontend.reasoning import get_reasoning_parser, prompt_thinking
from vllm_actors.frontend.tool_parsers import PARSERS
from vllm_actors.loaders.chat_template import render_chat_template

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]

SCRIPTED = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Paris", "days": 2}}\n</tool_call>\n<tool_call>{"name": "get_weather", '
               '"arguments": {"city": "Rome"}}</tool_call>', "Let me check.\n"),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome"}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 2}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]', None),
    "qwen3_coder": ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
                    "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
                    "</parameter>\n</function>\n</tool_call>", "Sure.\n"),
}
EXPECTED = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("name", sorted(SCRIPTED))
def test_parsers_find_calls(name):
    """Also with text after the calls (not content, as vLLM reads it; mistral's and
    qwen3_coder's calls had been lost to it; llama3_json's output is then content, as in
    vLLM) and qwen3_coder without `</function>`."""
    text, content = SCRIPTED[name]
    trailing = [] if name == "llama3_json" else [text + " Done."]
    for variant in (text, *trailing, text.replace("</function>", "")):
        found_content, calls = PARSERS[name](TOOLS).extract(variant)
        assert found_content == content
        assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED, variant


def test_mistral_call_ids_are_nine_letters_and_digits():
    """Mistral's templates refuse other ids when a call comes back in the history."""
    parser = choice_parser(ToolPlan("auto", parser=PARSERS["mistral"](TOOLS)), ServerConfig(),
                           False)
    message, _ = parser.message(SCRIPTED["mistral"][0])
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(ids) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)


def test_mistral_newer_format():
    _, calls = PARSERS["mistral"](TOOLS).extract('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                    {"city": "Oslo"})]


@pytest.mark.parametrize("name", sorted(SCRIPTED))
@pytest.mark.parametrize("text", ["Just an answer.", "<tool_call>{not json}</tool_call>",
                                  '{"no_name": 1}'])
def test_parsers_leave_other_text_as_content(name, text):
    assert PARSERS[name](TOOLS).extract(text) == (text, [])


def _stream(parser, text, rng):
    """Feed text in random pieces; collect the deltas as a message would hold them."""
    got = {"content": "", "reasoning_content": "", "calls": {}}
    called = False
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 6)
        piece, pos = text[pos:pos + step], pos + step
        delta, now_called = parser.update(piece, pos >= len(text))
        called |= now_called
        got["content"] += delta.get("content", "")
        got["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = got["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"]["arguments"]
    return got, called


@pytest.mark.parametrize("name", sorted(SCRIPTED))
@pytest.mark.parametrize("seed", range(5))
def test_streamed_pieces_add_up_to_the_message(name, seed):
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser=name,
                          reasoning_parser="qwen3")
    text = "<think>first, the tools</think>" + SCRIPTED[name][0]
    plan = ToolPlan("auto", parser=PARSERS[name](TOOLS))
    message, called = choice_parser(plan, config, False).message(text)
    got, streamed_called = _stream(choice_parser(plan, config, False), text, random.Random(seed))
    assert called and streamed_called
    assert message["reasoning_content"] == got["reasoning_content"] == "first, the tools"
    assert (message["content"] or "") == got["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] \
        == [(c["name"], c["arguments"]) for c in got["calls"].values()]


@pytest.mark.parametrize("name, text, expected", [
    ("deepseek_r1", "<think>abc</think>answer", ("abc", "answer")),
    ("deepseek_r1", "abc</think>answer", ("abc", "answer")),   # <think> opened by the template
    ("deepseek_r1", "still thinking", ("still thinking", "")),
    ("qwen3", "<think>abc</think>answer", ("abc", "answer")),
    ("qwen3", "no thinking", (None, "no thinking")),
    ("qwen3", "<think>cut short", ("cut short", "")),
])
def test_reasoning_split(name, text, expected):
    assert get_reasoning_parser(name).split(text) == expected


def test_the_prompt_opens_or_closes_the_reasoning():
    """A prompt ending with `<think>` (Qwen3.5's template) opens the reasoning for qwen3
    too (its output had been all content, `</think>` included); one ending with `</think>`,
    or `enable_thinking: false`, closes it for deepseek_r1 too."""
    opened = "<|im_start|>assistant\n<think>\n"
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert prompt_thinking(None, opened) is True and prompt_thinking(None, "x") is None
    assert prompt_thinking(None, closed) is False
    assert prompt_thinking({"enable_thinking": False}, opened) is False
    qwen3 = get_reasoning_parser("qwen3", thinking=True)
    assert qwen3.split("I add.\n</think>\n\n4.") == ("I add.\n", "\n\n4.")
    assert qwen3.split("cut short") == ("cut short", "")
    r1 = get_reasoning_parser("deepseek_r1", thinking=False)
    assert r1.split("4.") == (None, "4.")
    assert r1.split("<think>a</think>4.") == ("a", "4.")


def test_a_tool_call_ends_qwen3s_reasoning():
    """Qwen3.5 may open a tool call before closing its reasoning: the call ends it and is
    found in the content (it had stayed in the reasoning, the call lost)."""
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes",
                          reasoning_parser="qwen3")
    text = 'I need the weather.\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    plan = ToolPlan("auto", parser=PARSERS["hermes"](TOOLS))
    message, called = choice_parser(plan, config, False, thinking=True).message(text)
    assert called and message["reasoning"] == "I need the weather.\n"
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    qwen3 = get_reasoning_parser("qwen3", thinking=True)
    assert qwen3.split("abc<tool_", final=False) == ("abc", "")
    assert get_reasoning_parser("deepseek_r1").split(text) == (text, "")


def test_reasoning_holds_back_partial_markers():
    parser = get_reasoning_parser("qwen3")
    assert parser.split("<thi", final=False) == (None, "")
    assert parser.split("<think>abc</thi", final=False) == ("abc", "")
    assert parser.split("<think>abc</thi", final=True) == ("abc</thi", "")


def _request(**kw):
    return ChatCompletionRequest(messages=[], **kw)


@pytest.mark.parametrize("kw, config, param, pattern", [
    ({"tools": TOOLS}, ServerConfig(), "tool_choice", "requires --enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     ServerConfig(), "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, ServerConfig(), "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, ServerConfig(), "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
      "tool_choice": "none"}, ServerConfig(), "tools", "parameters must be"),
])
def test_plan_tools_refusals(kw, config, param, pattern):
    with pytest.raises(APIError, match=pattern) as info:
        plan_tools(_request(**kw), config)
    assert info.value.status == 400 and info.value.param == param


def test_required_plan_schema_lists_every_tool():
    plan = plan_tools(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
                      ServerConfig())
    schema = plan.structured.json
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    [option] = schema["items"]["anyOf"]
    assert option["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}


def test_server_config_refuses_unknown_parsers():
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="is not one of"):
        ServerConfig(tool_call_parser="nope")
    with pytest.raises(ValueError, match="is not one of"):
        ServerConfig(reasoning_parser="nope")


def test_tool_history_reaches_the_template_with_dict_arguments():
    request = msgspec.convert({"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}, ChatCompletionRequest)
    template = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
                "CALL {{ c.function.name }}({{ c.function.arguments.city }})\n{% endfor %}"
                "{% else %}{{ m.role }}[{{ m.tool_call_id }}]: {{ m.content }}\n{% endif %}"
                "{% endfor %}{% for t in tools %}TOOL {{ t.function.name }}{% endfor %}")
    text = render_chat_template(template, chat_messages(request), add_generation_prompt=False,
                                tools=TOOLS)
    assert text == "CALL get_weather(Paris)\ntool[c1]: sunny\nTOOL get_weather"


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("broken", [False, True])
def test_calls_the_model_chose_arrive_whole_with_the_last_delta(name, broken):
    """Fed one character at a time, a model's own calls ("auto") come whole in the last
    delta, as the message has them; a malformed one (an unquoted value) is content there
    and in the stream alike (the stream had sent it as a call with its closing tag in the
    arguments, while the whole message had none)."""
    text = SCRIPTED[name][0]
    if broken:
        text = text.replace('"Paris"', "Paris")
    parser = choice_parser(ToolPlan("auto", parser=PARSERS[name](TOOLS)), ServerConfig(), False)
    message, called = choice_parser(ToolPlan("auto", parser=PARSERS[name](TOOLS)),
                                    ServerConfig(), False).message(text)
    deltas = [parser.update(ch, i == len(text) - 1)[0] for i, ch in enumerate(text)]
    assert all("tool_calls" not in d for d in deltas[:-1])
    streamed = [(c["function"]["name"], c["function"]["arguments"])
                for c in deltas[-1].get("tool_calls", [])]
    assert streamed == [(c["function"]["name"], c["function"]["arguments"])
                        for c in message["tool_calls"]]
    assert called != broken and len(streamed) == (0 if broken else 2)
    assert "".join(d.get("content", "") for d in deltas) == (message["content"] or "")


def test_auto_without_parallel_calls_keeps_the_first():
    """parallel_tool_calls false under "auto": the message and the stream carry only the
    first call the model wrote (vLLM's reading), and plan_tools passes the flag on."""
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    plan = plan_tools(_request(tools=TOOLS, tool_choice="auto", parallel_tool_calls=False),
                      config)
    assert not plan.parallel
    text, content = SCRIPTED["hermes"]
    message, called = choice_parser(plan, config, False).message(text)
    assert called and message["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == EXPECTED[:1]
    parser = choice_parser(plan, config, False)
    indices = {piece["index"] for i, ch in enumerate(text)
               for piece in parser.update(ch, i == len(text) - 1)[0].get("tool_calls", [])}
    assert indices == {0}


def test_a_call_cut_short_is_content_at_the_end():
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    parser = choice_parser(ToolPlan("auto", parser=PARSERS["hermes"](TOOLS)), ServerConfig(),
                           False)
    assert parser.message(text) == ({"role": "assistant", "content": text, "tool_calls": []},
                                    False)


@pytest.mark.parametrize("body", [
    '{"arguments": {"city": "Paris", "days": 2}, "name": "get_weather"}',
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "x1"}',
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 2}"}',
])
def test_streamed_arguments_never_run_past_their_object(body):
    """Key order, extra members and string-encoded arguments: pieces still add up to the
    final arguments, char by char."""
    text = f"<tool_call>{body}</tool_call>"
    plan = ToolPlan("auto", parser=PARSERS["hermes"](TOOLS))
    message, _ = choice_parser(plan, ServerConfig(), False).message(text)
    parser = choice_parser(plan, ServerConfig(), False)
    args = ""
    for i, ch in enumerate(text):
        for piece in parser.update(ch, i == len(text) - 1)[0].get("tool_calls", []):
            args += piece["function"]["arguments"]
    assert args == message["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"city": "Paris", "days": 2}


def _plan(tool_choice, tools=TOOLS):
    return plan_tools(_request(tools=tools, tool_choice=tool_choice), ServerConfig())


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("text, ok", [
    ('[{"name":"get_weather","parameters":{"city":"Paris","days":2}}]', True),
    ('[{"name":"get_weather","parameters":{}},{"name":"get_weather","parameters":{"days":1}}]',
     True),
    ('[{"name":"get_weather","parameters":{"city":"Paris"},"id":"x"}]', False),   # call key
    ('[{"name":"get_weather","parameters":{"city":"Paris","country":"FR"}}]', False),
    ('[{"name":"get_time","parameters":{}}]', False),
])
def test_required_calls_have_only_declared_keys(text, ok):
    assert params_accept(_plan("required").structured, text) is ok


@pytest.mark.parametrize("text, ok", [('{"city":"Paris","days":2}', True), ('{}', True),
                                      ('{"city":"Paris","unit":"c"}', False)])
def test_named_arguments_have_only_declared_keys(text, ok):
    assert params_accept(_plan(NAMED).structured, text) is ok


@pytest.mark.parametrize("function", [{"name": "get_weather"},
                                      {"name": "get_weather", "parameters": {}}])
def test_a_tool_without_parameters_takes_none(function):
    tools = [{"type": "function", "function": function}]
    assert params_accept(_plan(NAMED, tools).structured, "{}")
    assert not params_accept(_plan(NAMED, tools).structured, '{"a":1}')
    required = _plan("required", tools).structured
    assert params_accept(required, '[{"name":"get_weather","parameters":{}}]')
    assert not params_accept(required, '[{"name":"get_weather","parameters":{"a":1}}]')


def test_required_tools_keep_their_schema_refs():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "$defs": {"P": point}, "type": "object",
        "properties": {"at": {"$ref": "#/$defs/P"}, "const": {"const": {"$ref": "#/x"}}},
        "required": ["at"]}}} for name in ("a", "b")]
    required = _plan("required", tools).structured
    assert params_accept(required, '[{"name":"b","parameters":{"at":{"x":1}}}]')
    assert params_accept(required, '[{"name":"a","parameters":{"at":{"x":1},'
                                   '"const":{"$ref":"#/x"}}}]')
    assert not params_accept(required, '[{"name":"b","parameters":{"at":{"x":1,"y":2}}}]')
    assert tools[0]["function"]["parameters"]["properties"]["at"] == {"$ref": "#/$defs/P"}


@pytest.mark.parametrize("text, calls, content", [
    ('[{"name": "get_weather", "parameters": {"city": "Pa', [("get_weather", '{"city": "Pa')],
     None),
    ('[{"name": "get_weather", "parameters": {}}, {"name": "get_weather", "parameters": {"d',
     [("get_weather", "{}"), ("get_weather", '{"d')], None),
    ('[{"name": "get_wea', [], '[{"name": "get_wea'),
])
def test_required_output_cut_short_is_the_same_whole_and_streamed(text, calls, content):
    """max_tokens can cut a required call; the message keeps what the stream already sent."""
    plan = ToolPlan("required")
    message, _ = choice_parser(plan, ServerConfig(), True).message(text)
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]] == calls
    for seed in range(3):
        got, _ = _stream(choice_parser(plan, ServerConfig(), True), text, random.Random(seed))
        assert (got["content"] or None) == content
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == calls
