"""What the OpenAI endpoints share: server state (the engine, in-flight requests, draining),
preparation off the event loop, sub-request runners that abort on client disconnect, streams
that always clean up, ids and usage.

A request's heavy work (JSON decoding, chat-template rendering, tokenization, bad-word
tokenization, grammar checks) runs once in `ServerState.prepare`'s lanes (preparation.py);
the event loop only moves bytes and outputs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

import msgspec
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from vllm_actors.config import ServerConfig
from vllm_actors.errors import EngineDeadError, ValidationError
from vllm_actors.frontend.async_llm import AsyncLLM
from vllm_actors.frontend.input_processor import ProcessedRequest, PromptType
from vllm_actors.frontend.openai_schema import MAX_REQUEST_ID_CHARS, APIError
from vllm_actors.frontend.preparation import (HEAVY_THREADS, HEAVY_WAITING, LARGE_WORK_BYTES,
                                              PREPARE_THREADS, PREPARE_TIMEOUT_S, PrepareLane,
                                              is_heavy)
from vllm_actors.lora_request import LoRARequest
from vllm_actors.outputs import RequestOutput
from vllm_actors.sampling_params import SamplingParams, short_repr

logger = logging.getLogger("vllm_actors.server")

FIRST_OUTPUT_WAIT_S = 10.0  # a stream waits this long for its first output before its 200,
                            # so a request the engine refuses still gets a 4xx
T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncLLM
    config: ServerConfig
    model_name: str
    # sub-request ids running, with how many requests hold each: a request refused for an
    # id in use must not take the running one's id off (the drain counts and aborts these)
    in_flight: collections.Counter[str] = field(default_factory=collections.Counter)
    draining: bool = False
    startup_error: str | None = None
    last_lora_id: int = 0          # LoRA ids are never reused (serving_lora._next_id)
    light: PrepareLane = field(
        default_factory=lambda: PrepareLane("prepare", PREPARE_THREADS, None))
    heavy: PrepareLane = field(
        default_factory=lambda: PrepareLane("prepare-heavy", HEAVY_THREADS, HEAVY_WAITING))

    def enter(self, subs: list["SubRequest"]) -> None:
        self.in_flight.update(s.request_id for s in subs)

    def leave(self, subs: list["SubRequest"]) -> None:
        for sub in subs:
            self.in_flight[sub.request_id] -= 1
            if self.in_flight[sub.request_id] <= 0:
                del self.in_flight[sub.request_id]

    def check_model(self, model: str | None, runner: str | None = "generate"
                    ) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model). Raises APIError 404 for
        a name that is neither, and 400 naming --runner when the endpoint needs the other
        runner (`runner`: what it needs; None: either)."""
        served = self.engine.ready.runner
        if runner is not None and runner != served:
            wants = ("generation (chat, completions, responses)" if runner == "generate" else
                     "a pooling model (embeddings, classification, scores)")
            raise APIError(400, f"this endpoint needs {wants}, but the model runs with "
                                f"--runner {served}", "model")
        if model is None or model == self.model_name:
            return None
        lora = self.engine.loras.get(model)
        if lora is None:
            served = ", ".join(f"`{n}`" for n in [self.model_name, *self.engine.loras])
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{served}", "model", "model_not_found")
        return lora

    def served_name(self, model: str | None) -> str:
        """What responses report as their model: the adapter's name, else the base's."""
        return model if model is not None and model in self.engine.loras else self.model_name

    def check_chat_template(self, template: str | None) -> None:
        """A chat template sent in a request runs only with --trust-request-chat-template
        (vLLM's rule); otherwise APIError 400 naming `chat_template`."""
        if template is not None and not self.config.trust_request_chat_template:
            raise APIError(400, "this server does not run chat templates sent in requests; "
                                "start it with --trust-request-chat-template to allow them",
                           "chat_template")

    def admit(self) -> None:
        """Raises APIError 503 while draining, EngineDeadError (503) once the engine is dead."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down",
                           type_="service_unavailable_error")
        if self.engine.errored:
            raise EngineDeadError(str(self.engine.dead_error))

    async def prepare(self, fn: Callable[..., T], *args: Any, body: bytes | None = None) -> T:
        """Run `fn(*args)` off the event loop: on the heavy lane when `body` (the request's
        bytes) looks heavy (`is_heavy`), else on the light lane.

        Raises whatever fn raises, or APIError 503 when the heavy lane is full or fn takes
        longer than PREPARE_TIMEOUT_S (the thread's result is then dropped)."""
        lane = self.heavy if body is not None and is_heavy(body) else self.light
        large = body is not None and len(body) > LARGE_WORK_BYTES
        return await lane.run(functools.partial(fn, *args), PREPARE_TIMEOUT_S, large)

    def log_request(self, kind: str, request_id: str, num_prompt_tokens: int,
                    params: SamplingParams, num_prompts: int = 1) -> None:
        """One INFO line per request (unless --disable-log-requests) with its parameters in
        brief; at DEBUG, the parameters themselves, cut to a few thousand characters."""
        if self.config.disable_log_requests:
            return
        prompts = f"{num_prompts} prompts, " if num_prompts > 1 else ""
        logger.info("%s request %s: %s%d prompt tokens, %s", kind, request_id, prompts,
                    num_prompt_tokens, params.brief())
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s request %s: %s", kind, request_id, short_repr(params, 4000))

    def shutdown(self) -> None:
        self.light.shutdown()
        self.heavy.shutdown()

    def process(self, sub: "SubRequest", prompt_param: str | None = None,
                constraint_param: str | None = None) -> None:
        """Validate and tokenize `sub` once (in the preparation pool); the result travels in
        `sub.processed`. Raises APIError 400 naming the field (prompt-level errors named
        `prompt_param`, grammar errors `constraint_param`, when given)."""
        try:
            sub.processed = self.engine.input_processor.process(
                sub.request_id, sub.prompt, sub.params, sub.priority, sub.lora)
        except ValidationError as e:
            raise APIError(400, str(e), _param(e.param, prompt_param, constraint_param)) \
                from None


def _param(param: str | None, prompt_param: str | None, constraint_param: str | None
           ) -> str | None:
    if prompt_param is not None and param in (None, "prompt", "prompt_token_ids"):
        return prompt_param
    if constraint_param is not None and param == "structured_outputs":
        return constraint_param
    return param


@dataclass
class SubRequest:
    """One engine request behind an HTTP request (completions fan out over prompts)."""

    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int = 0
    processed: ProcessedRequest | None = None
    lora: LoRARequest | None = None

    @property
    def num_prompt_tokens(self) -> int:
        assert self.processed is not None
        return len(self.processed.request.prompt_token_ids)

    @property
    def engine_prompt(self) -> PromptType | ProcessedRequest:
        return self.processed if self.processed is not None else self.prompt


class JSONBody(Response):
    """A JSON response encoded with msgspec (8x faster than json.dumps on a 10 MB body of
    logprobs); non-finite floats become null."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else msgspec.json.encode(content)


async def json_built_off_loop(state: ServerState, build: Callable[..., Any], *args: Any
                              ) -> JSONBody:
    """The JSON response `build(*args)` gives, built and encoded in the preparation pool: a
    finished request's body (its logprobs, prompt logprobs, tool-call parsing) can be large."""
    return JSONBody(await state.prepare(lambda: msgspec.json.encode(build(*args))))


def new_request_id(prefix: str, base: str | None = None, raw: Request | None = None) -> str:
    """`prefix-<id>`: the client's `X-Request-Id` header (of `raw`), else its request_id
    (vLLM's field), else a random one; vLLM's order."""
    header = None if raw is None else raw.headers.get("x-request-id")
    if header is not None and not (0 < len(header) <= MAX_REQUEST_ID_CHARS
                                   and header.isascii() and header.isprintable()):
        raise APIError(400, f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID_CHARS} "
                            "printable ASCII characters", "X-Request-Id")
    return f"{prefix}-{header or (base if base is not None else uuid.uuid4().hex)}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def raise_if_failed(output: RequestOutput, constraint_param: str | None = None) -> None:
    """A request the engine failed (finish_reason "error"): 400 naming the field when the
    request itself was at fault (a grammar the engine cannot follow, masks that leave no
    token), else 500 with the reason."""
    if not output.error:
        return
    if output.error_param is not None:
        raise APIError(400, output.error, _param(output.error_param, None, constraint_param))
    raise APIError(500, f"the engine failed this request: {output.error}",
                   code="engine_error", type_="server_error")


def stream_error(error: Exception) -> dict[str, Any]:
    """The error event sent when a stream cannot go on."""
    if isinstance(error, APIError):
        return error.body()
    dead = isinstance(error, EngineDeadError)
    return APIError(503 if dead else 500, str(error), code="engine_dead" if dead else None,
                    type_="service_unavailable_error" if dead else "server_error").body()


async def wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _final(state: ServerState, sub: SubRequest) -> RequestOutput:
    output = None
    async for output in state.engine.generate(sub.engine_prompt, sub.params, sub.request_id,
                                              sub.priority):
        pass
    assert output is not None
    return output


async def generate_final(state: ServerState, raw: Request,
                         subs: list[SubRequest]) -> list[RequestOutput] | None:
    """Run sub-requests to completion; None when the client went away first (then every
    sub-request has been aborted)."""
    state.enter(subs)
    tasks = [asyncio.ensure_future(_final(state, s)) for s in subs]
    work = asyncio.ensure_future(asyncio.gather(*tasks))
    disconnect = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            logger.info("client disconnected: aborted %s%s", subs[0].request_id,
                        f" and {len(subs) - 1} more" if len(subs) > 1 else "")
            return None
        return list(work.result())
    finally:
        state.leave(subs)
        disconnect.cancel()
        # no-ops for the finished; aborts the rest, also when one sub-request failed (the
        # gather's failure leaves its siblings running, which had then run unread)
        for task in tasks:
            task.cancel()


async def stream_outputs(state: ServerState, subs: list[SubRequest]
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(sub-request index, delta output) as they come, from all sub-requests. Closing the
    iterator (client disconnect) cancels and aborts the rest."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, sub: SubRequest) -> None:
        try:
            async for output in state.engine.generate(sub.engine_prompt, sub.params,
                                                      sub.request_id, sub.priority):
                queue.put_nowait((index, output))
        except Exception as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)

    state.enter(subs)
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(subs)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        # bookkeeping before any await: under a cancelled scope (sse-starlette's task group
        # when the client leaves) every await raises again, and what follows it never runs
        state.leave(subs)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def open_stream(state: ServerState, subs: list[SubRequest],
                      constraint_param: str | None = None
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`stream_outputs`, started before the response is: the first output is awaited (up to
    FIRST_OUTPUT_WAIT_S) so that a request the engine refuses at once answers 4xx (and a
    dead engine 503) instead of a 200 with the error inside the stream."""
    outputs = stream_outputs(state, subs)
    first = asyncio.ensure_future(outputs.__anext__())
    try:
        await asyncio.wait({first}, timeout=FIRST_OUTPUT_WAIT_S)
        if first.done():
            raise_if_failed(first.result()[1], constraint_param)
    except BaseException:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await outputs.aclose()   # type: ignore[attr-defined]
        raise
    return _continue(first, outputs)


async def _continue(first: asyncio.Future, outputs: AsyncIterator[tuple[int, RequestOutput]]
                    ) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        try:
            yield await first
        except StopAsyncIteration:
            return
        async for item in outputs:
            yield item
    finally:
        first.cancel()
        await outputs.aclose()   # type: ignore[attr-defined]


class EventStream(EventSourceResponse):
    """An SSE response of `content` (events made from `outputs`, an `open_stream`) that closes
    both when the response ends, however it ends (client gone, server shutdown): the engine
    requests behind it are aborted and leave the in-flight set at once rather than whenever
    the garbage collector runs."""

    def __init__(self, content: AsyncIterator[Any], outputs: AsyncIterator[Any]) -> None:
        super().__init__(content, ping=15, sep="\n")
        self.outputs = outputs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for iterator in (self.body_iterator, self.outputs):
                with contextlib.suppress(Exception):
                    await iterator.aclose()   # type: ignore[attr-defined]
