"""A response's output items, built from the chat parser's deltas (reasoning, message text,
function calls, in that order), and the stream events that announce them.

The same builder serves JSON and SSE: a whole response is one delta, a stream many, so a
greedy stream ends with the output a non-streamed request returns. Items open when their
first text arrives and close when the next kind starts or the response ends:

    message   output_item.added, content_part.added, output_text.delta*,
              output_text.done, content_part.done, output_item.done
    reasoning output_item.added, content_part.added (reasoning_text), reasoning_text.delta*,
              reasoning_text.done, content_part.done, output_item.done
    call      output_item.added, function_call_arguments.delta*,
              function_call_arguments.done, output_item.done

Every event carries `sequence_number` (0, 1, 2, ... across the stream).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

_json = msgspec.json.Encoder()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Output items so far; with `emit`, the events for them as encoded SSE dicts.

    Args:
        emit: whether to build events (a stream) or only items (a JSON response).
        logprobs: whether output_text parts carry logprobs (include
            message.output_text.logprobs); given per feed, they go to the message part.
    """

    def __init__(self, emit: bool, logprobs: bool) -> None:
        self.emit = emit
        self.items: list[dict[str, Any]] = []
        self.sequence_number = 0
        self._events: list[dict[str, str]] = []
        self._open: tuple[str, int | None] | None = None   # (kind, call index)
        self._logprobs: list[dict[str, Any]] | None = [] if logprobs else None
        self._pending_logprobs: list[dict[str, Any]] = []

    def event(self, type_: str, **fields: Any) -> dict[str, str]:
        """One SSE event: {"event": type, "data": JSON with type and sequence_number}."""
        body = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return {"event": type_, "data": _json.encode(body).decode()}

    def _add(self, type_: str, **fields: Any) -> None:
        if self.emit:
            self._events.append(self.event(type_, **fields))

    def take_events(self) -> list[dict[str, str]]:
        events, self._events = self._events, []
        return events

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None) -> None:
        """A chat delta ({reasoning_content, content, tool_calls}) and the logprobs of the
        tokens that produced it."""
        if self._logprobs is not None and logprobs:
            self._pending_logprobs.extend(logprobs)
        if delta.get("reasoning_content"):
            self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            self._text("message", delta["content"])
        for piece in delta.get("tool_calls") or []:
            self._call(piece)

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the open item (its status is the response's: completed or incomplete) and
        return the output. A response with nothing written gets an empty message."""
        if not self.items:
            self._open_message()
        self._close(status)
        return self.items

    # -- items ---------------------------------------------------------------------------

    def _position(self) -> tuple[int, dict[str, Any]]:
        return len(self.items) - 1, self.items[-1]

    def _switch(self, kind: str, index: int | None = None) -> bool:
        """Close the open item unless it is (kind, index); True when one must be opened."""
        if self._open == (kind, index):
            return False
        self._close("completed")
        self._open = (kind, index)
        return True

    def _open_message(self) -> None:
        self._switch("message")
        item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
        if self._logprobs is not None:
            part["logprobs"] = []
        self._start(item, part)

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> None:
        self.items.append(item)
        output_index = len(self.items) - 1
        self._add("response.output_item.added", output_index=output_index, item=item)
        if part is not None:
            self._add("response.content_part.added", item_id=item["id"],
                      output_index=output_index, content_index=0, part=part)
            item["content"].append(dict(part))

    def _text(self, kind: str, text: str) -> None:
        if self._open != (kind, None):
            if kind == "message":
                self._open_message()
            else:
                self._switch(kind)
                self._start({"id": new_id("rs"), "type": "reasoning", "summary": [],
                             "content": [], "status": "in_progress"},
                            {"type": "reasoning_text", "text": ""})
        output_index, item = self._position()
        part = item["content"][0]
        part["text"] += text
        fields = {"item_id": item["id"], "output_index": output_index, "content_index": 0,
                  "delta": text}
        if kind == "reasoning":
            self._add("response.reasoning_text.delta", **fields)
            return
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        if self._logprobs is not None:
            self._logprobs.extend(logprobs)
        self._add("response.output_text.delta", **fields, logprobs=logprobs)

    def _call(self, piece: dict[str, Any]) -> None:
        function = piece.get("function") or {}
        if self._switch("call", piece["index"]):
            self._start({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                         "call_id": piece["id"], "name": function["name"], "arguments": ""},
                        None)
        arguments = function.get("arguments") or ""
        if arguments:
            output_index, item = self._position()
            item["arguments"] += arguments
            self._add("response.function_call_arguments.delta", item_id=item["id"],
                      output_index=output_index, delta=arguments)

    def _close(self, status: str) -> None:
        if self._open is None:
            return
        kind, _ = self._open
        self._open = None
        output_index, item = self._position()
        at = {"item_id": item["id"], "output_index": output_index}
        if kind == "call":
            self._add("response.function_call_arguments.done", **at, name=item["name"],
                      arguments=item["arguments"])
        else:
            part = item["content"][0]
            if kind == "reasoning":
                self._add("response.reasoning_text.done", **at, content_index=0,
                          text=part["text"])
            else:
                if self._logprobs is not None:
                    part["logprobs"] = self._logprobs + self._pending_logprobs
                self._add("response.output_text.done", **at, content_index=0,
                          text=part["text"], logprobs=part.get("logprobs", []))
            self._add("response.content_part.done", **at, content_index=0, part=part)
        item["status"] = status
        self._add("response.output_item.done", output_index=output_index, item=item)
