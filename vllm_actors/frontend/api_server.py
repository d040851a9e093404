"""The OpenAI-compatible HTTP server: Starlette routes, auth, errors, metrics, the chat page,
and a uvicorn server that drains on SIGTERM.

Run with `vllm-actors serve [MODEL] [flags]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import importlib.resources
import logging
import sys
import time
from typing import Any, AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_actors.config import ServerConfig
from vllm_actors.errors import EngineDeadError, ValidationError
from vllm_actors.frontend.async_llm import AsyncLLM
from vllm_actors.frontend.http_protocol import HeaderDeadlineProtocol
from vllm_actors.frontend.openai_schema import APIError
from vllm_actors.frontend.serving import JSONBody, ServerState
from vllm_actors.frontend.serving_chat import create_chat_completion
from vllm_actors.frontend.serving_completion import create_completion
from vllm_actors.frontend.serving_pooling import (create_classify, create_embedding,
                                                  create_pooling, create_rerank, create_score)
from vllm_actors.frontend.serving_lora import (adapter_cards, add_module, load_lora_adapter,
                                               runtime_updates_allowed, unload_lora_adapter)
from vllm_actors.frontend.serving_responses import (ResponseStore, create_response,
                                                    delete_response, retrieve_response)
from vllm_actors.frontend.serving_tokenize import detokenize, tokenize, tokenizer_info
from vllm_actors.version import __version__

logger = logging.getLogger("vllm_actors.server")
ENGINE_DEATH_EXIT_DELAY_S = 1.0   # in-flight streams get their error event, then the exit
EVENT_LOOP_SWITCH_S = 0.001   # the server process's GIL switch interval (CPython's: 5 ms)
PROTECTED_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/reset_prefix_cache",
                      "/server_info", "/pooling", "/classify", "/score", "/rerank")


def _error(e: APIError) -> JSONBody:
    return JSONBody(e.body(), status_code=e.status)


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on the API routes (health, metrics, version
    and the chat page stay open for probes and browsers)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and \
                scope["path"].startswith(PROTECTED_PREFIXES):
            sent = [v for k, v in scope["headers"] if k == b"authorization"]
            if sent != [self.expected]:
                # more than one header is refused: a proxy may have checked another one
                reason = {0: "missing", 1: "incorrect"}.get(len(sent), "more than one")
                response = _error(APIError(401, f"{reason} API key: send one header "
                                                f"'Authorization: Bearer <key>'",
                                           code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def error_response(e: Exception, path: str) -> JSONBody:
    """The OpenAI-shaped answer for an exception raised while handling `path`: one log line
    for a handled error, a traceback only for a bug (an unexpected exception, 500)."""
    if isinstance(e, ValidationError):
        e = APIError(400, str(e), e.param)
    elif isinstance(e, EngineDeadError):
        e = APIError(503, str(e), code="engine_dead", type_="service_unavailable_error")
    elif not isinstance(e, APIError):
        logger.exception("unhandled error on %s", path)
        e = APIError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error")
    if e.status < 500 or e.code in ("engine_dead", "shutting_down", "engine_error"):
        logger.info("%d on %s: %s", e.status, path, e.message)
    return _error(e)


def endpoint(handler: Any) -> Any:
    """Wraps a route handler so every exception becomes its error response in the handler
    itself: the response is complete, nothing is re-raised to the ASGI server, so no
    traceback is logged and the keep-alive connection stays usable."""
    async def wrapped(raw: Request) -> Response:
        try:
            return await handler(raw)
        except Exception as e:
            return error_response(e, raw.url.path)
    return wrapped


async def _http_error(raw: Request, e: Exception) -> Response:
    """Unknown routes and methods, in OpenAI's error shape."""
    assert isinstance(e, HTTPException)
    message = {404: f"no route {raw.url.path}", 405: f"{raw.method} is not allowed on "
               f"{raw.url.path}"}.get(e.status_code, str(e.detail))
    return _error(APIError(e.status_code, message, code={404: "not_found"}.get(e.status_code)))


class _Routes:
    """The small handlers (health, models, info, metrics, the page); endpoints with request
    bodies live in serving_*.py."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine
        self.responses_store = ResponseStore()
        self.page = importlib.resources.files("vllm_actors.frontend").joinpath(
            "static/index.html").read_text(encoding="utf-8")

    async def health(self, raw: Request) -> Response:
        """As vLLM's: 200 unless the engine is dead (its death is noticed by itself: the
        core's exit or its EngineDead message); with data parallel cores down but some left,
        200 with a body saying "degraded" and how many serve. No round trip to the core, so
        a core busy with a long step is not reported unhealthy."""
        engine = self.engine
        if engine.errored:
            return _error(APIError(503, f"the engine is dead: {engine.dead_error}",
                                   code="engine_dead", type_="service_unavailable_error"))
        alive, size = engine.engines_alive, engine.group.size
        if alive == 0:
            return _error(APIError(503, "no engine core is alive; a replacement is starting",
                                   code="engine_dead", type_="service_unavailable_error"))
        if alive < size:   # data parallel with a core down: still serving, on the others
            return JSONBody({"status": "degraded", "engines_alive": alive,
                             "data_parallel_size": size})
        return Response(status_code=200)

    def _model_cards(self) -> list[dict[str, Any]]:
        card = {"id": self.state.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "vllm-actors", "root": self.engine.model_root, "parent": None,
                "max_model_len": self.engine.ready.max_model_len, "permission": []}
        return [card, *adapter_cards(self.state)]

    async def models(self, raw: Request) -> Response:
        return JSONBody({"object": "list", "data": self._model_cards()})

    async def model(self, raw: Request) -> Response:
        """GET /v1/models/{model} (OpenAI's retrieve): one card, or a 404 naming the id."""
        name = raw.path_params["model"]
        try:
            self.state.check_model(name, None)
        except APIError as e:
            return _error(e)
        return JSONBody(next(c for c in self._model_cards() if c["id"] == name))

    async def load_lora_adapter(self, raw: Request) -> Response:
        return await load_lora_adapter(self.state, raw)

    async def unload_lora_adapter(self, raw: Request) -> Response:
        return await unload_lora_adapter(self.state, raw)

    async def server_info(self, raw: Request) -> Response:
        ready, config = self.engine.ready, self.state.config
        return JSONBody({"version": __version__, "model": self.state.model_name,
                         "engine": {f: getattr(ready, f) for f in ready.__struct_fields__},
                         "server": {k: v for k, v in dataclasses.asdict(config).items()
                                    if k != "api_key"}})

    async def reset_prefix_cache(self, raw: Request) -> Response:
        return JSONBody({"reset": await self.engine.reset_prefix_cache()})

    async def metrics(self, raw: Request) -> Response:
        return Response(self.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    async def version(self, raw: Request) -> Response:
        return JSONBody({"version": __version__})

    async def index(self, raw: Request) -> Response:
        return HTMLResponse(self.page)

    async def chat(self, raw: Request) -> Response:
        return await create_chat_completion(self.state, raw)

    async def completions(self, raw: Request) -> Response:
        return await create_completion(self.state, raw)

    async def embeddings(self, raw: Request) -> Response:
        return await create_embedding(self.state, raw)

    async def pooling(self, raw: Request) -> Response:
        return await create_pooling(self.state, raw)

    async def classify(self, raw: Request) -> Response:
        return await create_classify(self.state, raw)

    async def score(self, raw: Request) -> Response:
        return await create_score(self.state, raw)

    async def rerank(self, raw: Request) -> Response:
        return await create_rerank(self.state, raw)

    async def tokenize(self, raw: Request) -> Response:
        return await tokenize(self.state, raw)

    async def detokenize(self, raw: Request) -> Response:
        return await detokenize(self.state, raw)

    async def tokenizer_info(self, raw: Request) -> Response:
        return JSONBody(tokenizer_info(self.state))

    async def responses(self, raw: Request) -> Response:
        return await create_response(self.state, self.responses_store, raw)

    async def stored_response(self, raw: Request) -> Response:
        handler = retrieve_response if raw.method == "GET" else delete_response
        return await handler(self.responses_store, raw.path_params["response_id"])

    def table(self) -> list[tuple[str, Any, list[str]]]:
        return [("/health", self.health, ["GET"]), ("/version", self.version, ["GET"]),
                ("/ping", self.health, ["GET", "POST"]), ("/metrics", self.metrics, ["GET"]),
                ("/v1/models", self.models, ["GET"]),
                ("/v1/models/{model:path}", self.model, ["GET"]),
                ("/v1/chat/completions", self.chat, ["POST"]),
                ("/v1/completions", self.completions, ["POST"]),
                ("/v1/embeddings", self.embeddings, ["POST"]),
                ("/pooling", self.pooling, ["POST"]), ("/classify", self.classify, ["POST"]),
                ("/score", self.score, ["POST"]), ("/v1/score", self.score, ["POST"]),
                *((path, self.rerank, ["POST"]) for path in ("/rerank", "/v1/rerank",
                                                             "/v2/rerank")),
                ("/tokenize", self.tokenize, ["POST"]),
                ("/detokenize", self.detokenize, ["POST"]),
                ("/v1/responses", self.responses, ["POST"]),
                ("/v1/responses/{response_id}", self.stored_response, ["GET", "DELETE"]),
                ("/server_info", self.server_info, ["GET"]),
                ("/reset_prefix_cache", self.reset_prefix_cache, ["POST"]),
                *self._lora_routes(), *self._tokenizer_info_route()]

    def _tokenizer_info_route(self) -> list[tuple[str, Any, list[str]]]:
        """Only with --enable-tokenizer-info-endpoint (else 404, as vLLM)."""
        if not self.state.config.enable_tokenizer_info_endpoint:
            return []
        return [("/tokenizer_info", self.tokenizer_info, ["GET"])]

    def _lora_routes(self) -> list[tuple[str, Any, list[str]]]:
        """Only with VLLM_ALLOW_RUNTIME_LORA_UPDATING (else 404, as vLLM)."""
        if not runtime_updates_allowed():
            return []
        return [("/v1/load_lora_adapter", self.load_lora_adapter, ["POST"]),
                ("/v1/unload_lora_adapter", self.unload_lora_adapter, ["POST"])]


def build_app(state: ServerState) -> Starlette:
    handlers = _Routes(state)
    routes = [Route("/", handlers.index),
              *(Route(path, endpoint(fn), methods=methods)
                for path, fn, methods in handlers.table())]
    middleware = []
    if state.config.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(
            state.config.allowed_origins), allow_methods=["*"], allow_headers=["*"]))
    if state.config.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=state.config.api_key))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.engine.start()
        for module in state.config.lora_modules:
            try:
                lora = await add_module(state, module)
            except ValidationError as e:
                state.startup_error = f"--lora-modules {module.name}: {e}"
                logger.error("%s", state.startup_error)
                raise
            logger.info("LoRA adapter %s (id %d) loaded from %s", lora.lora_name,
                        lora.lora_int_id, lora.lora_path)
        yield
        state.engine.shutdown()

    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers={HTTPException: _http_error})


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains: stop accepting connections,
    refuse new requests with 503, let running ones finish for up to `drain_timeout` seconds,
    abort the rest, then exit 0. A second signal exits at once.

    When the engine dies the server logs why, and (unless --no-exit-on-engine-death) exits
    with status 1 after ENGINE_DEATH_EXIT_DELAY_S, so a supervisor restarts it."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        state.engine.on_engine_death(self._on_engine_death)

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def _on_engine_death(self, error: EngineDeadError) -> None:
        if not self.state.config.exit_on_engine_death:
            logger.error("%s; requests are answered 503 until the server is restarted", error)
            return
        logger.error("%s; the server exits in %.0fs with status 1", error,
                     ENGINE_DEATH_EXIT_DELAY_S)
        self.exit_code = 1
        asyncio.get_running_loop().call_later(ENGINE_DEATH_EXIT_DELAY_S, self._exit_now)

    def _exit_now(self) -> None:
        self.should_exit = True

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


def run_server(engine_args: dict[str, Any], config: ServerConfig) -> int:
    """Load the engine, then serve until SIGTERM/SIGINT (drained) or the engine's death
    ends it. Returns the process exit status (0, or 1 after engine death)."""
    engine = AsyncLLM(**engine_args)
    state = ServerState(engine, config, engine.model_name)
    # what startup built lives as long as the server: keep it out of every later collection,
    # whose full passes would otherwise walk it (pauses of ~0.5 s after a request with large
    # logprobs, measured: docs/BENCHMARKS.md)
    gc.collect()
    gc.freeze()
    # a thread wanting the GIL waits a whole switch interval for each handoff, and the event
    # loop hands it off at every socket wait: beside two heavy preparation threads, /health
    # took up to 0.44 s at CPython's 5 ms, 0.03 s at 1 ms (docs/BENCHMARKS.md, "The event
    # loop and the GIL's switch interval")
    sys.setswitchinterval(EVENT_LOOP_SWITCH_S)
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    uv_config = uvicorn.Config(build_app(state), host=config.host, port=config.port,
                               loop=loop, log_level=config.uvicorn_log_level,
                               timeout_graceful_shutdown=5, http=HeaderDeadlineProtocol,
                               root_path=config.root_path, ssl_keyfile=config.ssl_keyfile,
                               ssl_certfile=config.ssl_certfile)
    engine.metrics.spec_log.enabled = not config.disable_log_stats
    scheme = "https" if config.ssl_certfile else "http"
    logger.info("serving %s on %s://%s:%d", state.model_name, scheme, config.host, config.port)
    server = DrainingServer(uv_config, state)
    try:
        server.run()
    finally:
        engine.shutdown()
        state.shutdown()
    return 1 if state.startup_error else server.exit_code
