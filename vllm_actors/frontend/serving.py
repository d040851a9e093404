"""What the OpenAI endpoints share: server state (the engine, in-flight requests, draining),
sub-request runners that abort on client disconnect, ids and usage."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request

from vllm_actors.config import ServerConfig
from vllm_actors.errors import EngineDeadError, ValidationError
from vllm_actors.frontend.async_llm import AsyncLLM
from vllm_actors.frontend.input_processor import PromptType
from vllm_actors.frontend.openai_schema import APIError
from vllm_actors.outputs import RequestOutput
from vllm_actors.sampling_params import SamplingParams

logger = logging.getLogger("vllm_actors.server")


@dataclass
class ServerState:
    engine: AsyncLLM
    config: ServerConfig
    model_name: str
    in_flight: set[str] = field(default_factory=set)
    draining: bool = False

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`", "model", "model_not_found")

    def admit(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down",
                           type_="service_unavailable_error")

    def validate(self, sub: "SubRequest", prompt_param: str | None = None,
                 constraint_param: str | None = None) -> None:
        """Limits, token ids and the output grammar, checked before any stream starts: a 400
        naming the field (prompt-level errors named `prompt_param`, grammar errors
        `constraint_param`, when given) instead of a failed stream."""
        try:
            self.engine.input_processor.process(sub.request_id, sub.prompt, sub.params)
        except ValidationError as e:
            param = e.param
            if prompt_param is not None and param in (None, "prompt_token_ids"):
                param = prompt_param
            elif constraint_param is not None and param == "structured_outputs":
                param = constraint_param
            raise APIError(400, str(e), param) from None


@dataclass
class SubRequest:
    """One engine request behind an HTTP request (completions fan out over prompts)."""

    request_id: str
    prompt: PromptType
    params: SamplingParams


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def raise_if_failed(output: RequestOutput) -> None:
    """A request the engine failed (finish_reason "error") answers 500 with the reason."""
    if output.error:
        raise APIError(500, f"the engine failed this request: {output.error}",
                       code="engine_error", type_="server_error")


def stream_error(error: Exception) -> dict[str, Any]:
    """The error event sent when a stream cannot go on."""
    dead = isinstance(error, EngineDeadError)
    return APIError(503 if dead else 500, str(error), code="engine_dead" if dead else None,
                    type_="service_unavailable_error" if dead else "server_error").body()


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _final(state: ServerState, sub: SubRequest) -> RequestOutput:
    output = None
    async for output in state.engine.generate(sub.prompt, sub.params, sub.request_id):
        pass
    assert output is not None
    return output


async def generate_final(state: ServerState, raw: Request,
                         subs: list[SubRequest]) -> list[RequestOutput] | None:
    """Run sub-requests to completion; None when the client went away first (then every
    sub-request has been aborted)."""
    state.in_flight.update(s.request_id for s in subs)
    work = asyncio.ensure_future(asyncio.gather(*(_final(state, s) for s in subs)))
    disconnect = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            logger.info("client disconnected: aborted %s", ", ".join(s.request_id for s in subs))
            return None
        return list(work.result())
    finally:
        disconnect.cancel()
        state.in_flight.difference_update(s.request_id for s in subs)


async def stream_outputs(state: ServerState, subs: list[SubRequest]
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(sub-request index, delta output) as they come, from all sub-requests. Closing the
    iterator (client disconnect) cancels and aborts the rest."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, sub: SubRequest) -> None:
        try:
            async for output in state.engine.generate(sub.prompt, sub.params, sub.request_id):
                queue.put_nowait((index, output))
        except Exception as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)

    state.in_flight.update(s.request_id for s in subs)
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
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        state.in_flight.difference_update(s.request_id for s in subs)
