"""Tools and reasoning on /v1/chat/completions: what `tools` + `tool_choice` ask of the
engine, and how a choice's text becomes OpenAI's message (content, reasoning_content,
tool_calls), whole or as stream deltas.

- tool_choice "none": tools are only shown to the chat template.
- "auto" (the default when tools are given; needs --enable-auto-tool-choice and
  --tool-call-parser, as in vLLM): the model writes freely; the parser finds its calls.
- "required": a grammar makes the output a JSON array of {"name", "parameters"} calls (a
  call has exactly those two keys).
- a named function: a grammar makes the output that function's arguments.
Arguments follow the tool's schema strictly, as any JSON schema here (grammar.py): only the
declared parameters unless the schema says `additionalProperties`; a tool without
`parameters` takes none (OpenAI's reading), so its arguments are `{}`.

Grammars (required and named choices, response_format, structured outputs) are enforced
from the first token, so under one the reasoning parser only splits off a `<think>` the
output itself opens. Streaming sends content as it is settled and tool calls as they are
written: a call's id and name as soon as its name is known, then its arguments piece by
piece (arguments are the JSON text the model wrote; qwen3_coder's XML calls, rebuilt as
JSON, arrive whole).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_actors.config import ServerConfig
from vllm_actors.frontend.openai_schema import APIError, ChatCompletionRequest
from vllm_actors.frontend.reasoning import ReasoningParser, get_reasoning_parser
from vllm_actors.frontend.tool_parsers import PARSERS, ToolCall, ToolParser, read_calls
from vllm_actors.sampling_params import StructuredOutputsParams


@dataclass
class ToolPlan:
    """choice: none | auto | required | named (then `name`). `parallel`: false keeps only
    the first call the parser finds under "auto" (vLLM's reading of parallel_tool_calls;
    "required" limits the grammar's array to one call instead)."""

    choice: str = "none"
    name: str | None = None
    parser: ToolParser | None = None
    structured: StructuredOutputsParams | None = None
    parallel: bool = True


def _check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{name: parameters schema}; 400 naming `tools` for a malformed entry."""
    out = {}
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                "{\"name\": ..., \"parameters\": {...}}}", "tools")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           "tools")
        out[function["name"]] = params or _NO_PARAMETERS
    return out


_NO_PARAMETERS = {"type": "object", "properties": {}}
_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def _rebased(schema: Any, prefix: str) -> Any:
    """A copy of `schema` whose local `$ref`s ("#/...") point below `prefix`, the place the
    schema takes inside a larger one (data keywords are copied as they are)."""
    if isinstance(schema, list):
        return [_rebased(v, prefix) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = prefix + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, prefix)
    return out


def _calls_schema(schemas: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The "required" grammar's schema: an array of calls, each {"name", "parameters"} and
    nothing else, the parameters as the tool declares them (refs rebased)."""
    options = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [name]},
        "parameters": _rebased(schema, f"#/items/anyOf/{i}/properties/parameters")},
        "required": ["name", "parameters"], "additionalProperties": False}
        for i, (name, schema) in enumerate(schemas.items())]
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        calls["maxItems"] = 1
    return calls


def plan_tools(req: ChatCompletionRequest, config: ServerConfig) -> ToolPlan:
    """What the request's tools and tool_choice need. Raises APIError 400 for a malformed
    tool, an unknown function name, or "auto" on a server without a tool-call parser."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    schemas = _check_tools(tools)
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": '
                                '"function", "function": {"name": ...}}', "tool_choice")
        if name not in schemas:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in tools",
                           "tool_choice")
        return ToolPlan("named", name, structured=StructuredOutputsParams(json=schemas[name]))
    if choice not in ("none", "auto", "required"):
        raise APIError(400, f'tool_choice must be "none", "auto", "required" or a named '
                            f"function, got {choice!r}", "tool_choice")
    if choice != "none" and not tools:
        raise APIError(400, f'tool_choice "{choice}" needs tools', "tool_choice")
    if choice == "required":
        calls = _calls_schema(schemas, bool(req.parallel_tool_calls))
        return ToolPlan("required", structured=StructuredOutputsParams(json=calls))
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                                "--tool-call-parser to be set", "tool_choice")
        return ToolPlan("auto", parser=PARSERS[config.tool_call_parser](tools),
                        parallel=bool(req.parallel_tool_calls))
    return ToolPlan("none")


def _call_json(call: ToolCall, index: int, call_id: str) -> dict[str, Any]:
    return {"index": index, "id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class ChoiceParser:
    """One choice's text -> message fields; `update` gives stream deltas, `message` the
    whole message. Both run the same parse, so the deltas add up to the message."""

    plan: ToolPlan
    reasoning: ReasoningParser | None
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0
    sent_args: dict[int, int] = field(default_factory=dict)   # call index -> chars sent
    call_ids: list[str] = field(default_factory=list)

    def _parse(self, final: bool) -> tuple[str | None, str, list[ToolCall]]:
        """(reasoning, settled content, calls so far: the last one may be incomplete)."""
        plan = self.plan
        if plan.choice == "named":
            return None, "", [ToolCall(plan.name or "", self.text, complete=final)]
        if plan.choice == "required":
            # output cut short (max_tokens) keeps the calls it began, the last incomplete, as
            # the stream sent them; text with no call at all is content
            bracket = self.text.find("[")
            read = None if bracket < 0 else \
                read_calls(self.text, bracket + 1, ("parameters",), ",", final=False)
            if read is None or (final and not read[0]):
                return None, self.text if final else "", []
            return None, "", read[0]
        reasoning, content = self.reasoning.split(self.text, final) if self.reasoning \
            else (None, self.text)
        parser = plan.parser
        if parser is None:
            return reasoning, content, []
        start = parser.find_start(content)
        if start < 0:
            held = 0 if final else parser.partial_start(content)
            return reasoning, content[:len(content) - held], []
        calls = parser.calls(content[start:], final)
        if calls is None or (final and not calls):
            return reasoning, content, []
        return reasoning, content[:start], calls if plan.parallel else calls[:1]

    def _ids(self, n: int) -> list[str]:
        new_id = (self.plan.parser or ToolParser).call_id
        while len(self.call_ids) < n:
            self.call_ids.append(new_id())
        return self.call_ids

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the complete message, whether the finish reason becomes "tool_calls": calls
        the model chose to make; a named function's call keeps "stop", as OpenAI's does)."""
        self.text = text
        reasoning, content, calls = self._parse(final=True)
        ids = self._ids(len(calls))
        msg: dict[str, Any] = {"role": "assistant", "content": content or None,
                               "tool_calls": [{k: v for k, v in _call_json(c, i, ids[i]).items()
                                               if k != "index"} for i, c in enumerate(calls)]}
        if reasoning is not None:   # vLLM's name now, and its name before
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif not calls and msg["content"] is None:
            msg["content"] = ""
        return msg, bool(calls) and self.plan.choice != "named"

    def update(self, new_text: str, final: bool) -> tuple[dict[str, Any], bool]:
        """(the delta for new_text, whether the model has made tool calls so far). A call a
        grammar forces (required, named) is announced (id, name) once its name is known,
        its arguments following as written; calls the model chose to write ("auto") are
        sent whole with the last delta, as the whole message reads them: until the output
        ends its text may still turn out not to be calls (a malformed one is content)."""
        self.text += new_text
        reasoning, content, calls = self._parse(final)
        if self.plan.choice == "auto" and not final:
            calls = []
        delta: dict[str, Any] = {}
        if reasoning is not None and len(reasoning) > self.sent_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning[self.sent_reasoning:]
            self.sent_reasoning = len(reasoning)
        if len(content) > self.sent_content:
            delta["content"] = content[self.sent_content:]
            self.sent_content = len(content)
        ids = self._ids(len(calls))
        pieces = []
        for i, call in enumerate(calls):
            sent = self.sent_args.get(i)
            if sent is None:
                pieces.append(_call_json(call, i, ids[i]))
            elif len(call.arguments) > sent:
                pieces.append({"index": i, "function": {"arguments": call.arguments[sent:]}})
            self.sent_args[i] = len(call.arguments)
        if pieces:
            delta["tool_calls"] = pieces
        called = any(c.complete for c in calls) and self.plan.choice != "named"
        return delta, called


def choice_parser(plan: ToolPlan, config: ServerConfig, constrained: bool,
                  thinking: bool | None = None) -> ChoiceParser:
    """`constrained`: a grammar shapes the output from its first token, so reasoning is
    split off only where the output itself opens with `<think>` (a regex or grammar that
    spells the reasoning out); no template-opened reasoning is assumed. `thinking`: as
    `reasoning.prompt_thinking` reads the prompt."""
    reasoning = get_reasoning_parser(config.reasoning_parser, constrained, thinking)
    return ChoiceParser(plan, reasoning)
