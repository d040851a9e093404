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
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from vllm_actors.frontend.detokenizer import partial_stop_length

_decoder = json.JSONDecoder()


@dataclass
class ToolCall:
    """arguments: JSON text as the model wrote it (OpenAI sends text); for a call still being
    written (`complete` False), the part of it written so far."""

    name: str
    arguments: str
    complete: bool = True


class Malformed(Exception):
    """The text cannot be a tool call."""


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _cut_short(text: str, name: Any, span: tuple[int, int] | None, args_from: int | None
               ) -> tuple[ToolCall | None, None]:
    """What read_call returns for an object the text ends inside: the call so far once its
    name is known and its arguments object has started, else nothing yet."""
    if not isinstance(name, str):
        return None, None
    if span is not None and text[span[0]] == "{":
        return ToolCall(name, text[span[0]:span[1]], complete=False), None
    if span is None and args_from is not None and text.startswith("{", args_from):
        return ToolCall(name, text[args_from:], complete=False), None
    return None, None


def read_call(text: str, pos: int, args_keys: tuple[str, ...]
              ) -> tuple[ToolCall | None, int | None]:
    """Read a {"name": ..., <args key>: {...}} object starting at text[pos].

    Returns (call, end) for a complete object; (call with complete=False, None) when the text
    ends inside it after the name and the start of the arguments object; (None, None) when it
    ends earlier. Raises Malformed when the text cannot be such an object. (Text that stops
    where a JSON value cannot be read counts as cut short; a final read refuses it.)"""
    pos = _skip_ws(text, pos)
    if pos == len(text):
        return None, None
    if text[pos] != "{":
        raise Malformed
    name: Any = None
    span: tuple[int, int] | None = None
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if pos == len(text):
            return _cut_short(text, name, span, None)
        if text[pos] == "}":
            break
        try:
            key, pos = _decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return _cut_short(text, name, span, None)
        pos = _skip_ws(text, pos)
        if pos == len(text):
            return _cut_short(text, name, span, None)
        if not isinstance(key, str) or text[pos] != ":":
            raise Malformed
        start = _skip_ws(text, pos + 1)
        is_args = key in args_keys and span is None
        try:
            value, pos = _decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            return _cut_short(text, name, span, start if is_args else None)
        if key == "name":
            name = value
        elif is_args:
            span = (start, pos)
        pos = _skip_ws(text, pos)
        if pos == len(text):
            return _cut_short(text, name, span, None)
        if text[pos] == ",":
            pos += 1
        elif text[pos] != "}":
            raise Malformed
    if not isinstance(name, str):
        raise Malformed
    args = "{}" if span is None else text[span[0]:span[1]]
    if args.startswith('"'):   # arguments given as a JSON string holding JSON
        args = json.loads(args)
    return ToolCall(name, args), pos + 1


def read_calls(text: str, pos: int, args_keys: tuple[str, ...], separators: str,
               final: bool) -> tuple[list[ToolCall], int] | None:
    """Consecutive call objects from text[pos], separated by whitespace or `separators`:
    (calls, where the next non-call text starts). A call cut short comes last, incomplete,
    unless `final` (then the text is not calls: None). None for malformed text."""
    calls: list[ToolCall] = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text) or text[pos] != "{":
            return calls, pos
        try:
            call, end = read_call(text, pos, args_keys)
        except Malformed:
            return None
        if end is None:
            if final:
                return None
            return calls + ([call] if call else []), len(text)
        calls.append(call)
        pos = end


class ToolParser:
    """start_markers: where tool calls begin; special_markers: a marker is a special token,
    so the request must keep special tokens in its text."""

    start_markers: tuple[str, ...] = ()
    special_markers = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = {t.get("function", {}).get("name"): t.get("function", {})
                      for t in tools or []}

    @staticmethod
    def call_id() -> str:
        """A new tool call's id (vLLM's form)."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def find_start(self, text: str) -> int:
        """Index where tool calls begin, or -1."""
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(found, default=-1)

    def partial_start(self, text: str) -> int:
        """Length of the end of `text` that might still grow into a start marker."""
        return partial_stop_length(text, list(self.start_markers))

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
    args_keys = ("arguments", "parameters")

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        out: list[ToolCall] = []
        pos = 0
        while region.startswith("<tool_call>", pos):
            read = read_calls(region, pos + len("<tool_call>"), self.args_keys, "", final)
            if read is None or len(read[0]) > 1:
                return None if final else out
            calls, pos = read
            if not calls or not calls[0].complete:
                return None if final and not calls else out + calls
            rest = region[pos:].lstrip()
            if not rest.startswith("</tool_call>"):
                if not rest or (not final and "</tool_call>".startswith(rest)):
                    return out + calls   # the closing tag is still coming (or never came)
                return None if final else out
            out += calls
            pos = _skip_ws(region, region.index("</tool_call>", pos) + len("</tool_call>"))
        return out   # text after the last call is not content (as in vLLM)


class Llama3JsonParser(ToolParser):
    start_markers = ("<|python_tag|>",)
    args_keys = ("parameters", "arguments")

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
        pos = len("<|python_tag|>") if region.startswith("<|python_tag|>") else 0
        read = read_calls(region, pos, self.args_keys, ";", final)
        if read is None or (final and (not read[0] or read[1] < len(region))):
            return None
        return read[0]


class MistralParser(ToolParser):
    """[TOOL_CALLS][{...}, ...] or [TOOL_CALLS]name[ARGS]{...}, possibly repeated."""

    start_markers = ("[TOOL_CALLS]",)
    special_markers = True

    @staticmethod
    def call_id() -> str:
        """9 letters and digits: Mistral's chat templates refuse any other id when the call
        comes back in the history (vLLM's mistral parser makes the same)."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    args_keys = ("arguments", "parameters")
    named = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[ARGS\])?\s*")

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        out: list[ToolCall] = []
        pos = _skip_ws(region, len("[TOOL_CALLS]"))
        if region.startswith("[", pos):
            read = read_calls(region, pos + 1, self.args_keys, ",", final)
            # text after the closing bracket is not content (vLLM reads the list alone)
            if read is None or (final and not region[read[1]:].lstrip().startswith("]")):
                return None
            return read[0] or (None if final else [])
        while pos < len(region):
            match = self.named.match(region, pos)
            if match is None or match.end() >= len(region):
                return None if final else out
            try:
                _, end = _decoder.raw_decode(region, match.end())
            except json.JSONDecodeError:
                if final or not region.startswith("{", match.end()):
                    return None
                return out + [ToolCall(match.group(1), region[match.end():], complete=False)]
            out.append(ToolCall(match.group(1), region[match.end():end]))
            pos = _skip_ws(region, end)
            if region.startswith("[TOOL_CALLS]", pos):
                pos += len("[TOOL_CALLS]")
            elif pos < len(region):
                return None if final else out
        return out or (None if final else [])


class Qwen3CoderParser(ToolParser):
    """Each `<tool_call>` block is a call (its `</function>` may be missing, as vLLM reads
    it); text between and after the blocks is not content."""

    start_markers = ("<tool_call>",)
    function = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)(?:</function>\s*)?"
                          r"</tool_call>", re.DOTALL)
    parameter = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        out = []
        for match in self.function.finditer(region):
            schema = self.tools.get(match.group(1), {}).get("parameters") or {}
            props = schema.get("properties", {})
            args = {name: self._value(value, props.get(name, {}))
                    for name, value in self.parameter.findall(match.group(2))}
            out.append(ToolCall(match.group(1), json.dumps(args, ensure_ascii=False)))
        if final and not out:
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
