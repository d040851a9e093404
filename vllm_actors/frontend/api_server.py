"""The OpenAI-compatible HTTP server: Starlette routes, auth, errors, metrics, the chat page,
and a uvicorn server that drains on SIGTERM.

Run with `vllm-actors serve [MODEL] [flags]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.resources
import logging
import time
from typing import Any, AsyncIterator

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_actors.config import ServerConfig
from vllm_actors.errors import EngineDeadError, ValidationError
from vllm_actors.frontend.async_llm import AsyncLLM
from vllm_actors.frontend.openai_schema import APIError
from vllm_actors.frontend.serving import ServerState
from vllm_actors.frontend.serving_chat import create_chat_completion
from vllm_actors.frontend.serving_completion import create_completion
from vllm_actors.version import __version__

logger = logging.getLogger("vllm_actors.server")
HEALTH_TIMEOUT_S = 5.0
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/reset_prefix_cache", "/server_info")


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on the API routes (health, metrics, version
    and the chat page stay open for probes and browsers)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and \
                scope["path"].startswith(PROTECTED_PREFIXES):
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != self.expected:
                reason = "missing" if b"authorization" not in headers else "incorrect"
                response = _error(APIError(401, f"{reason} API key: send the header "
                                                f"'Authorization: Bearer <key>'",
                                           code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _json_body(raw: Request) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(await raw.body())
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def build_app(state: ServerState) -> Starlette:
    engine = state.engine
    page = importlib.resources.files("vllm_actors.frontend").joinpath(
        "static/index.html").read_text(encoding="utf-8")

    async def health(raw: Request) -> Response:
        try:
            await asyncio.wait_for(engine.check_health(), HEALTH_TIMEOUT_S)
        except (EngineDeadError, asyncio.TimeoutError) as e:
            return _error(APIError(503, f"the engine is not answering: {e or 'timeout'}",
                                   code="engine_dead", type_="service_unavailable_error"))
        return Response(status_code=200)

    async def models(raw: Request) -> Response:
        card = {"id": state.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "vllm-actors", "root": engine.model_root, "parent": None,
                "max_model_len": engine.ready.max_model_len, "permission": []}
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(raw: Request) -> Response:
        body = await _json_body(raw)
        state.check_model(body.get("model"))
        if "messages" in body:
            ids = engine.tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=body.get("add_generation_prompt", True))
        elif isinstance(body.get("prompt"), str):
            ids = engine.tokenizer.encode(body["prompt"], body.get("add_special_tokens", True))
        else:
            raise APIError(400, "give `prompt` (a string) or `messages`", "prompt")
        result: dict[str, Any] = {"count": len(ids), "max_model_len": engine.ready.max_model_len,
                                  "tokens": ids}
        if body.get("return_token_strs"):
            result["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(result)

    async def detokenize(raw: Request) -> Response:
        body = await _json_body(raw)
        state.check_model(body.get("model"))
        tokens = body.get("tokens")
        vocab = engine.ready.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab
                                                   for t in tokens):
            raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(tokens)})

    async def server_info(raw: Request) -> Response:
        ready = engine.ready
        return JSONResponse({"version": __version__, "model": state.model_name,
                             "engine": {f: getattr(ready, f) for f in ready.__struct_fields__},
                             "server": {k: v for k, v in dataclasses.asdict(state.config).items()
                                        if k != "api_key"}})

    async def reset_prefix_cache(raw: Request) -> Response:
        return JSONResponse({"reset": await engine.reset_prefix_cache()})

    async def metrics(raw: Request) -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    async def version(raw: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def index(raw: Request) -> Response:
        return HTMLResponse(page)

    async def chat(raw: Request) -> Response:
        return await create_chat_completion(state, raw)

    async def completions(raw: Request) -> Response:
        return await create_completion(state, raw)

    routes = [Route("/", index), Route("/health", health), Route("/version", version),
              Route("/ping", health, methods=["GET", "POST"]), Route("/metrics", metrics),
              Route("/v1/models", models),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/tokenize", tokenize, methods=["POST"]),
              Route("/detokenize", detokenize, methods=["POST"]),
              Route("/server_info", server_info),
              Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])]
    middleware = []
    if state.config.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(
            state.config.allowed_origins), allow_methods=["*"], allow_headers=["*"]))
    if state.config.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=state.config.api_key))

    async def api_error(raw: Request, e: Exception) -> Response:
        if isinstance(e, APIError):
            return _error(e)
        if isinstance(e, ValidationError):
            return _error(APIError(400, str(e), e.param))
        if isinstance(e, EngineDeadError):
            return _error(APIError(503, str(e), code="engine_dead",
                                   type_="service_unavailable_error"))
        logger.exception("unhandled error on %s", raw.url.path)
        return _error(APIError(500, f"internal error: {type(e).__name__}: {e}",
                               type_="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    # the request's own errors are answered inside the app and the connection stays open;
    # Starlette answers a bare `Exception` handler's errors, then re-raises (uvicorn then
    # logs a traceback and drops the keep-alive connection)
    handled = (APIError, ValidationError, EngineDeadError, Exception)
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers=dict.fromkeys(handled, api_error))


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains: stop accepting connections,
    refuse new requests with 503, let running ones finish for up to `drain_timeout` seconds,
    abort the rest, then exit 0. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or self._loop is None:
            self.should_exit = True
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        state, timeout = self.state, self.state.config.drain_timeout
        logger.info("draining: %d request(s) running, up to %.0fs", len(state.in_flight), timeout)
        for server in getattr(self, "servers", []):
            server.close()
        deadline = time.monotonic() + timeout
        while state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.in_flight:
            logger.info("drain timeout: aborting %d request(s)", len(state.in_flight))
            await state.engine.abort(list(state.in_flight))
            deadline = time.monotonic() + 5
            while state.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True


def run_server(engine_args: dict[str, Any], config: ServerConfig) -> None:
    """Load the engine, then serve until SIGTERM/SIGINT (drained) ends it."""
    engine = AsyncLLM(**engine_args)
    state = ServerState(engine, config, engine.model_name)
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    uv_config = uvicorn.Config(build_app(state), host=config.host, port=config.port,
                               loop=loop, log_level=config.uvicorn_log_level,
                               timeout_graceful_shutdown=5)
    logger.info("serving %s on http://%s:%d", state.model_name, config.host, config.port)
    try:
        DrainingServer(uv_config, state).run()
    finally:
        engine.shutdown()
