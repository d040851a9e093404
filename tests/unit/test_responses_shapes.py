"""The Responses API without a server: request -> chat request translation, the stored-response
LRU, and output items / stream events built from scripted chat-parser deltas."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import msgspec
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from vllm_actors.config import ServerConfig
from vllm_actors.errors import EngineDeadError
from vllm_actors.frontend.chat_tools import ToolPlan, choice_parser
from vllm_actors.frontend.openai_schema import APIError, ChatCompletionRequest
from vllm_actors.frontend.responses_output import OutputBuilder
from vllm_actors.frontend.responses_schema import (ResponsesRequest, chat_request, input_items,
                                                   input_messages, refuse_unsupported)
from vllm_actors.frontend.input_processor import ProcessedRequest
from vllm_actors.frontend.serving import ServerState, SubRequest, stream_outputs
from vllm_actors.frontend.serving_chat import PreparedChat
from vllm_actors.frontend.serving_responses import ResponseStore, StoredResponse, _stream, _Turn
from vllm_actors.frontend.tool_parsers import PARSERS
from vllm_actors.outputs import CompletionOutput, RequestOutput
from vllm_actors.protocol.engine import EngineCoreRequest
from vllm_actors.sampling_params import SamplingParams

WEATHER = {"type": "function", "name": "get_weather", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _request(**fields) -> ResponsesRequest:
    return msgspec.convert({"input": "hi", **fields}, ResponsesRequest)


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text",
                                                                 "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": ""},
    ]
    assert input_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": ""}}]},
    ]
    assert input_items("hi") == [{"type": "message", "role": "user", "content": "hi"}]


@pytest.mark.parametrize("item, pattern", [
    ({"role": "robot", "content": "x"}, r"input\[0\]\.role must be one of"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "u"}]},
     r"input\[0\]\.content: only text parts .* got type 'input_image'"),
    ({"type": "item_reference", "id": "x"}, r"item type 'item_reference' is not supported"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "needs a string `call_id`"),
    ({"type": "function_call_output", "call_id": "c"}, r"\.output must be a string"),
])
def test_malformed_input_items_name_input(item, pattern):
    with pytest.raises(APIError, match=pattern) as e:
        input_messages([item])
    assert e.value.status == 400 and e.value.param == "input"


def test_chat_request_carries_every_mapped_field():
    req = _request(instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9,
                   top_k=3, seed=4, stream=True, user="u", priority=2, cache_salt="s",
                   tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                   parallel_tool_calls=False, include=["message.output_text.logprobs"],
                   top_logprobs=2, text={"format": {"type": "json_schema", "name": "w",
                                                    "schema": {"type": "object"},
                                                    "strict": True}})
    chat = chat_request(req, input_items(req.input))
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."),
                                                            ("user", "hi")]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.top_k, chat.seed,
            chat.stream, chat.user, chat.priority, chat.cache_salt) == \
        (7, 0.5, 0.9, 3, 4, True, "u", 2, "s")
    assert chat.tools == [CHAT_WEATHER]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False and chat.logprobs and chat.top_logprobs == 2
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object"}}}
    plain = chat_request(_request(), input_items("hi"))
    assert (plain.tools, plain.tool_choice, plain.response_format, plain.logprobs,
            plain.parallel_tool_calls, plain.stream) == (None, None, None, False, True, False)


@pytest.mark.parametrize("fields, param, pattern", [
    ({"background": True}, "background", "background mode is not supported"),
    ({"conversation": "conv_1"}, "conversation", "not supported"),
    ({"prompt": {"id": "p"}}, "prompt", "not supported"),
    ({"max_tool_calls": 2}, "max_tool_calls", "not supported"),
    ({"reasoning": {"effort": 3}}, "reasoning", "effort must be a string"),
    ({"truncation": "middle"}, "truncation", "is not \"auto\" or \"disabled\""),
    ({"text": {"verbosity": "low"}}, "text", "verbosity is not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "needs include"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 keys"),
])
def test_unsupported_fields_are_refused(fields, param, pattern):
    with pytest.raises(APIError, match=pattern) as e:
        refuse_unsupported(_request(**fields))
    assert e.value.status == 400 and e.value.param == param


def test_neutral_values_of_refused_fields_pass():
    refuse_unsupported(_request(background=False, reasoning={"effort": None},
                                truncation="disabled", include=[], metadata={"k": "v"}))


def test_what_agent_clients_send_is_taken():
    """What the OpenAI Agents SDK and Codex-style clients send (each had been refused):
    truncation "auto" keeps the prompt's last tokens that leave room for the answer,
    reasoning.effort reaches the template, other include values produce nothing."""
    req = _request(truncation="auto", reasoning={"effort": "low", "summary": "auto"},
                   include=["reasoning.encrypted_content"], chat_template_kwargs={"x": 1})
    refuse_unsupported(req)
    chat = chat_request(req, input_items("hi"), max_model_len=8192)
    assert chat.truncate_prompt_tokens == 4096        # half the context left for the answer
    req = _request(truncation="auto", max_output_tokens=100)
    assert chat_request(req, input_items("hi"), 8192).truncate_prompt_tokens == 8092
    assert chat.chat_template_kwargs == {"reasoning_effort": "low", "x": 1}


@pytest.mark.parametrize("fields, param, pattern", [
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools are supported"),
    ({"tools": [{"type": "function"}]}, "tools", r"tools\[0\] must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice",
     "got type 'web_search_preview'"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text",
     "needs a `schema` object"),
    ({"text": {"format": {"type": "xml"}}}, "text", "must be text, json_object or json_schema"),
])
def test_malformed_tools_and_formats_are_refused(fields, param, pattern):
    with pytest.raises(APIError, match=pattern) as e:
        chat_request(_request(**fields), input_items("hi"))
    assert e.value.status == 400 and e.value.param == param


def test_response_store_evicts_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for name in "ab":
        store.put(name, StoredResponse({"output": [name]}, []))
    assert store.get("a") is not None          # a is now the most recent
    store.put("c", StoredResponse({"output": ["c"]}, [{"role": "user", "content": "c?"}]))
    assert store.get("b") is None and len(store) == 2
    assert store.get("c").conversation() == [{"role": "user", "content": "c?"}, "c"]
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    error = store.not_found("b", "previous_response_id")
    assert (error.status, error.param, error.code) == (404, "previous_response_id",
                                                       "response_not_found")
    assert "keeps the last 2 stored responses" in error.message


HERMES_TEXT = ('<think>which tool?</think>Let me check.\n<tool_call>{"name": "get_weather", '
               '"arguments": {"city": "Paris"}}</tool_call>\n<tool_call>{"name": "get_weather", '
               '"arguments": {"city": "Rome"}}</tool_call>')


def _parser():
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes",
                          reasoning_parser="qwen3")
    return choice_parser(ToolPlan("auto", parser=PARSERS["hermes"]([CHAT_WEATHER])), config,
                         False)


def _without_ids(items):
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("seed", range(4))
def test_streamed_events_build_the_whole_output(seed):
    whole = OutputBuilder(emit=False, logprobs=False)
    whole.feed(_parser().update(HERMES_TEXT, final=True)[0], None)
    expected = whole.finish("completed")
    assert _without_ids(expected) == [
        {"type": "reasoning", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": "which tool?"}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.\n", "annotations": []}]},
        {"type": "function_call", "status": "completed", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "status": "completed", "name": "get_weather",
         "arguments": '{"city": "Rome"}'}]
    rng, parser, stream = random.Random(seed), _parser(), OutputBuilder(emit=True, logprobs=False)
    events, pos = [], 0
    while pos < len(HERMES_TEXT):
        step = rng.randint(1, 9)
        chunk, pos = HERMES_TEXT[pos:pos + step], pos + step
        stream.feed(parser.update(chunk, pos >= len(HERMES_TEXT))[0], None)
        events += stream.take_events()
    output = stream.finish("completed")
    events = [json.loads(e["data"]) for e in events + stream.take_events()]
    assert _without_ids(output) == _without_ids(expected)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)
    kinds = [e["type"].removeprefix("response.") for e in events]
    deltas = {"output_text.delta", "reasoning_text.delta", "function_call_arguments.delta"}
    collapsed = [k for i, k in enumerate(kinds) if k not in deltas or kinds[i - 1] != k]
    assert collapsed == [
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done"]
    for index, item in enumerate(output):
        done = [e for e in events if e["type"] == "response.output_item.done"][index]
        assert done["output_index"] == index and done["item"] == item
        if item["type"] == "function_call":
            assert "".join(e["delta"] for e in events
                           if e["type"] == "response.function_call_arguments.delta"
                           and e["output_index"] == index) == item["arguments"]


def test_empty_and_cut_outputs():
    empty = OutputBuilder(emit=True, logprobs=True)
    [item] = empty.finish("completed")
    assert (item["type"], item["status"], item["content"][0]["text"],
            item["content"][0]["logprobs"]) == ("message", "completed", "", [])
    cut = OutputBuilder(emit=False, logprobs=True)
    cut.feed({"content": "The"}, [{"token": "The", "logprob": -0.5}])
    cut.feed({}, [{"token": " st", "logprob": -1.0}])     # held back by the parser
    [item] = cut.finish("incomplete")
    assert item["status"] == "incomplete"
    assert item["content"][0]["logprobs"] == [{"token": "The", "logprob": -0.5},
                                              {"token": " st", "logprob": -1.0}]


class _ScriptedEngine:
    """Stands in for AsyncLLM in `_stream`: yields scripted delta outputs, then fails with
    `error` if given; its tokenizer counts words."""

    def __init__(self, deltas: list[tuple[str, str | None]], error: Exception | None = None):
        self.deltas, self.error = deltas, error
        self.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: text.split())

    async def generate(self, prompt, params, request_id, priority=0):
        for text, finish in self.deltas:
            yield RequestOutput(request_id, None, [], [CompletionOutput(
                0, text, [1] * len(text.split()), finish)], finish is not None, 5)
        if self.error is not None:
            raise self.error


def _run_stream(engine: _ScriptedEngine, store: ResponseStore) -> list[dict]:
    config = ServerConfig(reasoning_parser="qwen3")
    state = ServerState(engine, config, "smol")
    req = _request(stream=True, max_output_tokens=8)
    params = SamplingParams(max_tokens=8)
    processed = ProcessedRequest("p", EngineCoreRequest("chatcmpl-1", [1] * 11, params, [], 0.0))
    sub = SubRequest("chatcmpl-1", {"prompt": "p"}, params, processed=processed)
    chat = PreparedChat(ChatCompletionRequest(messages=[]), sub, ToolPlan("none"), None)
    turn = _Turn("resp_1", 0, req, chat, input_items("hi"), "smol", None)

    async def collect():
        outputs = stream_outputs(state, [sub])
        return [json.loads(e["data"]) async for e in _stream(state, store, turn, outputs)]
    return asyncio.run(collect())


def test_stream_ends_incomplete_and_is_stored():
    store = ResponseStore()
    events = _run_stream(_ScriptedEngine([("<think>a b c</think>", None), ("Hi", None),
                                          (" there", "length")]), store)
    final = events[-1]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "incomplete"
    assert final["response"]["usage"] == {
        "input_tokens": 11, "output_tokens": 5, "total_tokens": 16,
        "input_tokens_details": {"cached_tokens": 5},
        "output_tokens_details": {"reasoning_tokens": 3}}
    assert [(i["type"], i["status"]) for i in final["response"]["output"]] == \
        [("reasoning", "completed"), ("message", "incomplete")]
    stored = store.get("resp_1")
    assert stored.body == final["response"] and stored.conversation() == \
        input_items("hi") + final["response"]["output"]


def test_stream_failure_ends_with_response_failed():
    store = ResponseStore()
    events = _run_stream(_ScriptedEngine([("Hi", None)], EngineDeadError("the engine died")),
                         store)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["usage"] is None
    assert failed["error"] == {"code": "server_error", "message": "the engine died"}
    assert failed["output"][0]["content"][0]["text"] == "Hi" and len(store) == 0
