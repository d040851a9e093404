"""POST /v1/responses (JSON and SSE), GET and DELETE /v1/responses/{id}: OpenAI's Responses
API as vLLM serves it, over the chat path.

A request becomes a chat request (`responses_schema.chat_request`) that serving_chat
prepares (template, tool planning, structured outputs, limits); the chat parser's deltas
become output items (`responses_output.OutputBuilder`).

Stored responses (store defaults to true) live in memory in a `ResponseStore`: the last
`MAX_STORED_RESPONSES` of them within `MAX_STORED_BYTES`, least recently used evicted first. Each keeps its
conversation's items (without instructions), so `previous_response_id` replays the
conversation and its output before the new input. An id that is unknown, evicted or was
created with store=false answers 404.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from vllm_actors.frontend.chat_tools import ChoiceParser, ToolPlan
from vllm_actors.frontend.openai_schema import APIError, chat_logprobs
from vllm_actors.frontend.responses_output import OutputBuilder, new_id
from vllm_actors.frontend.responses_schema import (ResponsesRequest, chat_request, input_items,
                                                   refuse_unsupported)
from vllm_actors.frontend.request_body import decode_request, read_body
from vllm_actors.frontend.serving import (EventStream, JSONBody, ServerState, SubRequest,
                                          generate_final, new_request_id, open_stream,
                                          raise_if_failed)
from vllm_actors.frontend.serving_chat import PreparedChat, prepare_chat
from vllm_actors.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("vllm_actors.server")
MAX_STORED_RESPONSES = 256
MAX_STORED_BYTES = 64 * 2**20
_encode = msgspec.json.Encoder().encode
# Chat fields named in errors from the chat path -> the Responses field the client set.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text",
           "logprobs": "top_logprobs"}


@dataclass
class StoredResponse:
    body: dict[str, Any]            # the response object as it was returned
    items: list[dict[str, Any]]     # the conversation's input items, without instructions

    def conversation(self) -> list[dict[str, Any]]:
        """Items that continue it: its input, then its output."""
        return self.items + self.body["output"]


class ResponseStore:
    """The last `capacity` stored responses by id, holding at most `max_bytes` of them
    (each counted as its JSON size); reading one makes it the most recent."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES,
                 max_bytes: int = MAX_STORED_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Store `stored`, evicting the least recently used until both bounds hold; one
        larger than `max_bytes` by itself is not kept (a later read is a 404)."""
        self.delete(response_id)
        size = len(_encode(stored.body)) + len(_encode(stored.items))
        if size > self.max_bytes:
            logger.info("response %s (%d bytes) is larger than the store holds (%d bytes); "
                        "not stored", response_id, size, self.max_bytes)
            return
        self._entries[response_id] = (stored, size)
        self.num_bytes += size
        while len(self._entries) > self.capacity or self.num_bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.num_bytes -= evicted

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry[1]
        return entry is not None

    def not_found(self, response_id: str, param: str | None = None) -> APIError:
        return APIError(404, f"Response with id '{response_id}' not found: it is unknown, was "
                             "created with store=false, or was evicted (this server keeps the "
                             f"last {self.capacity} stored responses, "
                             f"{self.max_bytes >> 20} MiB in all)", param,
                        "response_not_found")


@dataclass
class _Turn:
    """One POST /v1/responses: what its response object echoes and what gets stored."""

    response_id: str
    created_at: int
    req: ResponsesRequest
    chat: PreparedChat                # the chat request that generates it
    items: list[dict[str, Any]]
    model: str
    constraint_param: str | None

    @property
    def sub(self) -> SubRequest:
        return self.chat.sub

    @property
    def plan(self) -> ToolPlan:
        return self.chat.plan

    @property
    def num_prompt(self) -> int:
        return self.sub.num_prompt_tokens


def _prepare_turn(state: ServerState, req: ResponsesRequest,
                  earlier: list[dict[str, Any]]) -> _Turn:
    """The chat request behind a turn, prepared (in the preparation pool); `earlier` are the
    items of the conversation it continues."""
    refuse_unsupported(req)
    items = earlier + input_items(req.input)
    try:
        chat = prepare_chat(state, chat_request(req, items, state.engine.ready.max_model_len),
                            new_request_id("chatcmpl"))
    except APIError as e:
        e.param = _PARAMS.get(e.param or "", e.param)
        raise
    return _Turn(new_id("resp"), int(time.time()), req, chat, items,
                 state.served_name(req.model), _PARAMS.get(chat.constraint_param or "",
                                               chat.constraint_param))


def _tool_choice(req: ResponsesRequest, plan: ToolPlan) -> str | dict[str, Any]:
    """The tool_choice a response echoes: the request's default ("auto") when it set none."""
    if req.tool_choice is None:
        return "auto"
    return {"type": "function", "name": plan.name} if plan.choice == "named" else plan.choice


def _body(turn: _Turn, status: str, output: list[dict[str, Any]],
          usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None
          ) -> dict[str, Any]:
    req, params = turn.req, turn.sub.params
    done = status in ("completed", "incomplete")
    return {
        "id": turn.response_id, "object": "response", "created_at": turn.created_at,
        "status": status, "completed_at": int(time.time()) if done else None, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "model": turn.model, "output": output,
        "instructions": req.instructions, "metadata": req.metadata or {},
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "temperature": params.temperature, "top_p": params.top_p,
        "top_logprobs": req.top_logprobs or 0, "tool_choice": _tool_choice(req, turn.plan),
        "tools": req.tools or [],
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "store": req.stored, "user": req.user, "background": False,
        "reasoning": req.reasoning, "truncation": req.truncation or "disabled",
        "service_tier": "default", "usage": usage}


def _usage(turn: _Turn, num_output: int, num_cached: int, num_reasoning: int
           ) -> dict[str, Any]:
    return {"input_tokens": turn.num_prompt, "output_tokens": num_output,
            "total_tokens": turn.num_prompt + num_output,
            "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens_details": {"reasoning_tokens": num_reasoning}}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _logprobs(turn: _Turn, c: CompletionOutput) -> list[dict[str, Any]] | None:
    if not turn.req.wants_logprobs:
        return None
    found = chat_logprobs(c.logprobs, c.token_ids, turn.req.top_logprobs or 0)
    return found["content"] if found else None


def _num_reasoning(state: ServerState, output: list[dict[str, Any]]) -> int:
    """Reasoning tokens, counted by tokenizing the reasoning text (the parser splits text)."""
    texts = [part["text"] for item in output if item["type"] == "reasoning"
             for part in item["content"]]
    return sum(len(state.engine.tokenizer.encode(t, add_special_tokens=False)) for t in texts)


def _finish(state: ServerState, store: ResponseStore, turn: _Turn, builder: OutputBuilder,
            finish_reason: str | None, num_output: int, num_cached: int) -> dict[str, Any]:
    """The final response object (stored when the request asks)."""
    status = _status(finish_reason)
    output = builder.finish(status)
    body = _body(turn, status, output,
                 _usage(turn, num_output, num_cached, _num_reasoning(state, output)))
    if turn.req.stored:
        store.put(turn.response_id, StoredResponse(body, turn.items))
    return body


async def create_response(state: ServerState, store: ResponseStore, raw: Request) -> Response:
    body = await read_body(raw, state.config.max_request_body_size)
    state.admit()
    req = await state.prepare(decode_request, body, ResponsesRequest, body=body)
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise store.not_found(req.previous_response_id, "previous_response_id")
        earlier = previous.conversation()
    turn = await state.prepare(_prepare_turn, state, req, earlier, body=body)
    state.log_request("responses", f"{turn.response_id} (engine {turn.sub.request_id})",
                      turn.num_prompt, turn.sub.params)
    if req.stream:
        outputs = await open_stream(state, [turn.sub], turn.constraint_param)
        return EventStream(_stream(state, store, turn, outputs), outputs)
    results = await generate_final(state, raw, [turn.sub])
    if results is None:
        return Response(status_code=499)
    out = results[0]
    raise_if_failed(out, turn.constraint_param)
    c = out.outputs[0]
    builder = OutputBuilder(emit=False, logprobs=req.wants_logprobs)
    delta, _ = _parser(state, turn).update(c.text, final=True)
    builder.feed(delta, _logprobs(turn, c))
    return JSONBody(_finish(state, store, turn, builder, c.finish_reason,
                                len(c.token_ids), out.num_cached_tokens))


def _parser(state: ServerState, turn: _Turn) -> ChoiceParser:
    return turn.chat.parser(state.config)


async def _stream(state: ServerState, store: ResponseStore, turn: _Turn,
                  outputs: AsyncIterator[tuple[int, RequestOutput]]
                  ) -> AsyncIterator[dict[str, str]]:
    builder = OutputBuilder(emit=True, logprobs=turn.req.wants_logprobs)
    start = _body(turn, "in_progress", [])
    yield builder.event("response.created", response=start)
    yield builder.event("response.in_progress", response=start)
    parser = _parser(state, turn)
    num_output = num_cached = 0
    finish_reason = None
    try:
        async for _, out in outputs:
            if out.error:
                raise RuntimeError(f"the engine failed this request: {out.error}")
            num_cached = out.num_cached_tokens
            for c in out.outputs:
                num_output += len(c.token_ids)
                finish_reason = c.finish_reason or finish_reason
                delta, _ = parser.update(c.text, c.finish_reason is not None)
                builder.feed(delta, _logprobs(turn, c))
            for event in builder.take_events():
                yield event
    except Exception as e:   # the engine failed or died mid-stream: say so in the stream
        failed = _body(turn, "failed", builder.items,
                       error={"code": "server_error", "message": str(e)})
        yield builder.event("response.failed", response=failed)
        return
    body = _finish(state, store, turn, builder, finish_reason, num_output, num_cached)
    for event in builder.take_events():
        yield event
    final = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield builder.event(final, response=body)


async def retrieve_response(store: ResponseStore, response_id: str) -> Response:
    stored = store.get(response_id)
    if stored is None:
        raise store.not_found(response_id)
    return JSONBody(stored.body)


async def delete_response(store: ResponseStore, response_id: str) -> Response:
    if not store.delete(response_id):
        raise store.not_found(response_id)
    return JSONBody({"id": response_id, "object": "response.deleted", "deleted": True})
