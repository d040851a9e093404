"""Tool-call parsers (`--tool-call-parser`): find the calls a model wrote in its output.

Each parser knows where tool calls start (`find_start`) and reads the calls complete so far
in the text from there (`calls`). A parser never guesses: text it cannot read as a call stays
content. Formats:

- hermes (Hermes, Qwen 2.5, SmolLM): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- llama3_json (Llama 3.x): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name{...}` / `[TOOL_CALLS]name[ARGS]{...}`
- qwen3_coder: `<tool_call><function=name><parameter=p>value</parameter></function></tool_call>`,
  values converted by the tool's JSON schema (strings stay strings)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_decoder = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI sends it


def _as_call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def json_values(text: str, pos: int, separators: str) -> tuple[list[Any], bool]:
    """Consecutive JSON values in text[pos:], separated by whitespace or `separators`;
    (values, True when everything after them is whitespace)."""
    values = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values, True
        try:
            value, pos = _decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, False
        values.append(value)


class ToolParser:
    start_markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = {t.get("function", {}).get("name"): t.get("function", {})
                      for t in tools or []}

    def find_start(self, text: str) -> int:
        """Index where tool calls begin, or -1."""
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(found, default=-1)

    def partial_start(self, text: str) -> int:
        """Length of the end of `text` that might still grow into a start marker."""
        for n in range(min(max(map(len, self.start_markers)) - 1, len(text)), 0, -1):
            if any(m.startswith(text[-n:]) for m in self.start_markers):
                return n
        return 0

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        """The complete calls in `region` (text from the start marker on); None when the
        region cannot be read as calls (it is then content)."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a complete output."""
        start = self.find_start(text)
        if start < 0:
            return text, []
        calls = self.calls(text[start:], final=True)
        if not calls:
            return text, []
        return (text[:start] or None), calls


class HermesParser(ToolParser):
    start_markers = ("<tool_call>",)
    block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        out = []
        for match in self.block.finditer(region):
            closed = match.group(0).endswith("</tool_call>")
            if not closed and not final:
                break
            try:
                call = _as_call(json.loads(match.group(1)), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return None if final else out
            out.append(call)
        return out


class Llama3JsonParser(ToolParser):
    start_markers = ("<|python_tag|>",)

    def find_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith("{"):
            return len(text) - len(stripped)
        return super().find_start(text)

    def partial_start(self, text: str) -> int:
        if not text.strip():
            return len(text)   # the output might still open with "{"
        return super().partial_start(text)

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        body = region.removeprefix("<|python_tag|>")
        values, clean = json_values(body, 0, ";")
        calls = [_as_call(v, ("parameters", "arguments")) for v in values]
        if any(c is None for c in calls) or (final and not clean):
            return None if final else [c for c in calls if c is not None]
        return calls


class MistralParser(ToolParser):
    start_markers = ("[TOOL_CALLS]",)
    named = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[ARGS\])?\s*")

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        out: list[ToolCall] = []
        pos = len("[TOOL_CALLS]")
        while pos < len(region):
            body = region[pos:].lstrip()
            if not body:
                break
            if body.startswith("["):
                values, clean = json_values(region, region.index("[", pos), "")
                if not values:
                    return None if final else out
                calls = [_as_call(v, ("arguments", "parameters"))
                         for v in (values[0] if isinstance(values[0], list) else [])]
                return out + calls if calls and None not in calls else None
            match = self.named.match(region, pos)
            if match is None or match.end() >= len(region):
                return None if final else out
            try:
                args, pos = _decoder.raw_decode(region, match.end())
            except json.JSONDecodeError:
                return None if final else out
            out.append(ToolCall(match.group(1), json.dumps(args, ensure_ascii=False)))
            pos = region.find("[TOOL_CALLS]", pos)
            pos = len(region) if pos < 0 else pos + len("[TOOL_CALLS]")
        return out


class Qwen3CoderParser(ToolParser):
    start_markers = ("<tool_call>",)
    function = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>",
                          re.DOTALL)
    parameter = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        out, pos = [], 0
        for match in self.function.finditer(region):
            if region[pos:match.start()].strip():
                return None
            schema = self.tools.get(match.group(1), {}).get("parameters") or {}
            props = schema.get("properties", {})
            args = {name: self._value(value, props.get(name, {}))
                    for name, value in self.parameter.findall(match.group(2))}
            out.append(ToolCall(match.group(1), json.dumps(args, ensure_ascii=False)))
            pos = match.end()
        if final and (not out or region[pos:].strip()):
            return None
        return out

    @staticmethod
    def _value(text: str, schema: dict[str, Any]) -> Any:
        if schema.get("type", "string") == "string":
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser,
                                        "llama3_json": Llama3JsonParser,
                                        "mistral": MistralParser,
                                        "qwen3_coder": Qwen3CoderParser}
