"""AsyncLLM: the asyncio API over the engine core process.

    async with AsyncLLM() as llm:
        async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.outputs[0].text)

One background task per engine core reads its output socket and feeds each request's
collector; cancelling a consumer aborts its request in the core. When the core dies (an
EngineDead message, or its process exits) every pending and every new request raises
EngineDeadError. With data parallel cores (`EngineGroup`) a dead core fails only its own
requests: new ones route around it while a replacement starts, and the engine is dead only
when no core is left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import uuid
import weakref
from typing import Any, AsyncIterator, Callable, Sequence

import numpy as np

from vllm_actors.config import EngineArgs
from vllm_actors.errors import EngineDeadError, ValidationError, VllmActorsError
from vllm_actors.frontend.collector import RequestOutputCollector
from vllm_actors.frontend.core_client import CoreClient
from vllm_actors.frontend.engine_group import EngineGroup
from vllm_actors.frontend.engine_watch import EngineWatch, release_on_collect, running_loop
from vllm_actors.frontend.input_processor import InputProcessor, ProcessedRequest, PromptType
from vllm_actors.frontend.metrics import FrontendMetrics
from vllm_actors.frontend.output_processor import OutputProcessor, ParentRequest
from vllm_actors.loaders.chat_template import read_chat_template
from vllm_actors.loaders.generation_config import generation_defaults
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.loaders.tokenizer import Tokenizer, load_tokenizer, tokenizer_source
from vllm_actors.lora_request import LoRARequest, cache_key
from vllm_actors.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from vllm_actors.pooling_params import PoolingParams
from vllm_actors.protocol.engine import (AbortRequests, EngineCoreOutputs, EngineDead,
                                         SchedulerStats, UtilityCall, UtilityKind,
                                         UtilityResult)
from vllm_actors.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OUTPUT_CHUNK = 128      # outputs handled between yields to the event loop
LARGE_PROMPT_LOGPROBS = 512   # prompt logprobs of more positions are built off the loop


class AsyncLLM(EngineWatch):
    """Args: as `LLM` (model path or None for the default model, plus EngineArgs fields).

    Construction blocks until the core has loaded the model.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        config = args.create_engine_config()
        source = resolve_model(config.model.model)
        self.tokenizer = load_tokenizer(tokenizer_source(source, config.model.tokenizer),
                                        read_chat_template(config.model.chat_template))
        self.group = EngineGroup(config, use_process=args.multiprocessing)
        self.ready = self.group.ready
        self.model_name = config.model.served_model_name or source.name
        self.model_root = str(source.path)
        self.input_processor = InputProcessor(self.tokenizer, self.ready,
                                              config.model.max_logprobs,
                                              config.scheduler.policy)
        self.metrics = FrontendMetrics(self.model_name, self.group.size,
                                       config.lora.max_loras if config.lora else 0)
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self._engine_ids = itertools.count()   # the suffix that makes engine ids unique
        self.generation_defaults = generation_defaults(source, config.model.generation_config)
        self.lora_config = config.lora
        self.loras: dict[str, LoRARequest] = {}   # adapters loaded on every engine, by name
        self._dead: EngineDeadError | None = None
        self._tasks: dict[int, list[asyncio.Task]] = {}   # engine -> output (and watch) task
        self._restarting: set[asyncio.Task] = set()      # replacements of dead cores
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[int, tuple[int, asyncio.Future]] = {}   # call id -> engine, future
        self._call_ids = itertools.count()
        self._stopping = False
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        # dropped without shutdown(): the finalizer stops the cores (it holds what it needs,
        # not the engine; the loop holds the engine only weakly, see EngineWatch._watch)
        self._loop_box: list[asyncio.AbstractEventLoop | None] = [None]
        weakref.finalize(self, release_on_collect, self._loop_box, self.group, self._tasks)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **vllm_options: Any) -> "AsyncLLM":
        """vLLM's constructor (`AsyncEngineArgs` is `EngineArgs` here). vLLM's other options
        (usage_context, stat_loggers, start_engine_loop, ...) have nothing to set here."""
        return cls(**{f.name: getattr(engine_args, f.name)
                      for f in dataclasses.fields(engine_args)})

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """vLLM's flag: the engine serves (not shut down, not dead)."""
        return self._dead is None

    @property
    def is_stopped(self) -> bool:
        return self._dead is not None

    @property
    def client(self) -> CoreClient:
        """Engine core 0's client (the only one without data parallel)."""
        return self.group.clients[0]

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def engines_alive(self) -> int:
        """Engine cores serving now (`--data-parallel-size` when all are)."""
        return 0 if self._dead is not None else self.group.num_alive

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine is dead (None while it runs)."""
        return self._dead

    def on_engine_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback(error)` on the event loop when the engine core dies (not when it is
        shut down), after every pending request has been failed."""
        self._death_callbacks.append(callback)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def start(self) -> None:
        """Start reading outputs and watching the core on the running event loop (the first
        request does it otherwise); a server calls it at startup so that the core's death is
        noticed even before any request."""
        self._ensure_running()

    def _ensure_running(self) -> None:
        """Fail fast when dead; start the output handler on the running loop (again when an
        earlier loop has ended, as after a second `asyncio.run`)."""
        if self._dead is not None:
            raise self._dead
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and self._loop.is_running():
            raise VllmActorsError("this AsyncLLM is in use by another running event loop")
        if self._loop is not None and not self._loop.is_closed():
            for engine in list(self._tasks):      # the idle loop's tasks end when it runs
                self._unwatch(engine, self.group.clients[engine])
        self._tasks.clear()
        self._loop = self._loop_box[0] = loop
        for engine in self.group.live():
            self._watch(engine)

    def _fail(self, error: EngineDeadError) -> None:
        first = self._dead is None
        if first:
            self._dead = error
        self.output_processor.fail_all(self._dead)
        for _, future in self._calls.values():
            if not future.done():
                future.set_exception(self._dead)
        self._calls.clear()
        if first and not self._stopping:
            for callback in self._death_callbacks:
                callback(error)

    def shutdown(self) -> None:
        """Stop the core and release everything; idempotent. Pending requests fail with
        EngineDeadError. Callable from any thread."""
        if self._stopping:
            return
        self._stopping = True
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        loop = self._loop
        try:
            if loop is None or loop.is_closed():
                pass
            elif running_loop() is loop:
                self._stop_in_loop()
            elif loop.is_running():
                loop.call_soon_threadsafe(self._stop_in_loop)
            else:   # an idle loop: let the cancelled tasks finish on it, where none runs
                tasks = [t for ts in self._tasks.values() for t in ts] + list(self._restarting)
                self._stop_in_loop()
                if running_loop() is None:
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        finally:
            self.group.shutdown()

    def _stop_in_loop(self) -> None:
        assert self._loop is not None and self._dead is not None
        self._fail(self._dead)
        for engine in list(self._tasks):
            self._unwatch(engine, self.group.clients[engine])
        for task in list(self._restarting):
            task.cancel()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the output handler ----------------------------------------------------------------
    async def _on_message(self, engine: int, client: CoreClient, message: object) -> bool:
        """One message of engine core `engine` (`engine_watch._read_outputs`); False when
        no more are to be read from it (an exception: reading failed)."""
        try:
            match message:
                case Exception():
                    raise message
                case EngineCoreOutputs(outputs=outputs):
                    self.metrics.observe_step(message.scheduler_stats, engine)
                    await self._process(outputs, engine)
                case UtilityResult():
                    self._resolve(message)
                case EngineDead(reason=reason):
                    self._engine_died(engine, client, EngineDeadError(
                        f"the engine core{self._name(engine)} failed: {reason}"))
                    return False
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(EngineDeadError(f"the output handler failed: {type(e).__name__}: {e}"))
            return False
        return True

    async def _process(self, outputs: list, engine: int = 0) -> None:
        for start in range(0, len(outputs), OUTPUT_CHUNK):
            if start:
                await asyncio.sleep(0)
            chunk = outputs[start:start + OUTPUT_CHUNK]
            to_abort = self.output_processor.process_outputs(
                chunk, await self._large_prompt_logprobs(chunk))
            if to_abort:
                self.group.send(engine, AbortRequests(to_abort))
            self.group.release([o.request_id for o in chunk if o.finish_reason is not None]
                               + to_abort)

    async def _large_prompt_logprobs(self, outputs: list) -> dict[str, Any] | None:
        """Prompt logprobs of many positions (an echo request's, lm-eval's) as dicts, built in
        a thread: 7,000 positions x 21 alternatives take ~0.5 s that the event loop should
        spend on other requests. Only this handler waits for them."""
        large = [o for o in outputs if o.prompt_logprobs is not None
                 and len(o.prompt_logprobs.ranks) > LARGE_PROMPT_LOGPROBS]
        if not large:
            return None
        loop = asyncio.get_running_loop()
        built = {}
        for out in large:
            positions = await loop.run_in_executor(None, self.output_processor.prompt_positions,
                                                   out)
            if positions is not None:
                built[out.request_id] = positions
        return built

    def _resolve(self, result: UtilityResult) -> None:
        _, future = self._calls.pop(result.call_id, (None, None))
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(VllmActorsError(result.error))
        else:
            future.set_result(result.value if result.results is None else result.results)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType | ProcessedRequest,
                    params: SamplingParams, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> RequestOutputCollector:
        """Submit a request (n > 1: one message for n engine requests that share its params,
        seeds seed + i; see EngineCoreRequest.n); call from the event loop. `prompt` may be
        a ProcessedRequest (from `input_processor.process`, which the server runs off the
        event loop): it is then sent as it is, without checking again. `lora_request` (or
        the ProcessedRequest's) must have been added (`add_lora`; `generate` does that).
        Raises ValidationError or EngineDeadError before anything is sent."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        self._ensure_running()
        self._check_free(request_id)
        processed = prompt if isinstance(prompt, ProcessedRequest) else \
            self.input_processor.process(request_id, prompt, params, priority, lora_request)
        # the core knows the request by an id of its own, so an id used again right after
        # an abort cannot take outputs of the aborted request still on their way
        request = processed.engine_request(f"{request_id}-{next(self._engine_ids)}")
        lora = processed.request.lora_request
        if lora is not None and self.loras.get(lora.lora_name) != lora:
            raise ValidationError(f"LoRA adapter {lora.lora_name!r} is not loaded: call "
                                  "add_lora first", "lora_request")
        if self.group.num_alive == 0:
            raise EngineDeadError("no engine core is alive (a replacement is starting)")
        engine = self.group.route(processed.request.prompt_token_ids,
                                  cache_key(processed.request.cache_salt, lora))
        params = request.sampling_params
        collector = RequestOutputCollector(params.output_kind)
        parent = ParentRequest(request_id, processed.prompt, request.prompt_token_ids,
                               params.output_kind, collector, params.n)
        self.group.assign(engine, self.output_processor.add_request(parent, request, engine))
        try:
            self.group.send(engine, request)
        except BaseException:
            self.abort_requests([request_id])
            raise
        return collector

    def _check_free(self, request_id: str) -> None:
        """A ValueError (as vLLM's) when the id belongs to a request in flight: the two
        could not be told apart in `abort`."""
        if request_id in self.output_processor.children:
            raise ValidationError(f"request id {request_id!r} is already in use by a request "
                                  "in flight (one whose client has just gone away is "
                                  "cancelled within a moment)", "request_id")

    async def generate(self, prompt: PromptType | ProcessedRequest,
                       sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (shaped by sampling_params.output_kind); the last
        has `finished=True`. Cancelling the consumer aborts the request. `lora_request`: the
        adapter to run with, loaded first if it is new."""
        request_id = request_id or uuid.uuid4().hex
        if lora_request is not None:
            await self.add_lora(lora_request)
        collector = self.add_request(request_id, prompt, sampling_params or SamplingParams(),
                                     priority, lora_request)
        finished = False
        try:
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort_requests([request_id])

    async def encode(self, prompt: PromptType | ProcessedRequest,
                     pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     lora_request: LoRARequest | None = None, pair: str | None = None
                     ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request (vLLM's `AsyncLLM.encode`): yields one finished
        PoolingRequestOutput whose `outputs.data` is the pooled float32 array. `pair`: a
        cross-encoder's second text. Raises ValidationError for a request the model cannot
        serve (also when the engine refuses it), VllmActorsError when the engine failed it,
        EngineDeadError when the engine is gone. Cancelling the consumer aborts it."""
        request_id = request_id or uuid.uuid4().hex
        if not isinstance(prompt, ProcessedRequest):
            prompt = self.input_processor.process_pooling(
                request_id, prompt, pooling_params or PoolingParams(), priority,
                lora_request, pair)
        collector = self.add_request(request_id, prompt, prompt.request.sampling_params,
                                     priority, lora_request)
        finished = False
        try:
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
            yield pooling_output(output)
        finally:
            if not finished:
                self.abort_requests([request_id])

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort now (call from the event loop); see `abort`."""
        engine_ids = self.output_processor.abort_requests(request_ids)
        by_engine: dict[int, list[str]] = {}
        for engine_id in engine_ids:
            engine = self.group.engine_of(engine_id)
            if engine is not None:
                by_engine.setdefault(engine, []).append(engine_id)
        self.group.release(engine_ids)
        if self._dead is None:
            for engine, ids in by_engine.items():
                self.group.send(engine, AbortRequests(ids))

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests; their consumers receive a final output with finish_reason "abort"."""
        self.abort_requests([request_id] if isinstance(request_id, str) else list(request_id))

    # -- utilities -------------------------------------------------------------------------
    async def _call(self, kind: UtilityKind, args: list[Any] | None = None) -> list[Any]:
        """The call on every live engine core; their results in engine order."""
        self._ensure_running()
        futures = []
        for engine in self.group.live():
            call_id = next(self._call_ids)
            future = asyncio.get_running_loop().create_future()
            self._calls[call_id] = (engine, future)
            self.group.send(engine, UtilityCall(call_id, kind, args or []))
            futures.append(future)
        if not futures:
            raise EngineDeadError("no engine core is alive (a replacement is starting)")
        return list(await asyncio.gather(*futures))

    async def check_health(self) -> None:
        """Raises EngineDeadError when the core is gone; otherwise a round trip to it (to
        every live one with data parallel)."""
        await self._call(UtilityKind.PING)

    async def reset_prefix_cache(self) -> bool:
        """Every core forgets its cached prefixes; False when one refused (requests hold
        KV blocks there)."""
        done = all(await self._call(UtilityKind.RESET_PREFIX_CACHE))
        if done:
            self.group.router.forget()
        return done

    async def get_scheduler_stats(self) -> SchedulerStats:
        """The cores' scheduler state summed (KV usage: their mean)."""
        return _sum_stats(await self._call(UtilityKind.GET_STATS))

    async def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        """Call `method` on every worker rank (vLLM's collective_rpc; the methods are
        `workers.rank_host.RPC_METHODS`, e.g. "describe"); the results in rank order, engine
        core after engine core with data parallel.
        Raises VllmActorsError naming the available methods for an unknown one."""
        results = await self._call(UtilityKind.COLLECTIVE_RPC, [method, *args])
        return [r for per_engine in results for r in per_engine]


    # -- LoRA adapters ---------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every worker of every engine (vLLM's `add_lora`); a no-op for
        one already loaded. Raises ValidationError (LoRA off, a name or id taken by another
        adapter, or an adapter the workers refuse, with their reason)."""
        lora = lora_request
        if not isinstance(lora, LoRARequest):
            raise ValidationError("lora_request must be a LoRARequest", "lora_request")
        if self.lora_config is None:
            raise ValidationError(f"LoRA adapter {lora.lora_name!r}: this engine serves no "
                                  "adapters (start it with --enable-lora)", "lora_request")
        if self.loras.get(lora.lora_name) == lora:
            return True
        for other in self.loras.values():
            if other.lora_name == lora.lora_name or other.lora_int_id == lora.lora_int_id:
                raise ValidationError(f"LoRA adapter {lora.lora_name!r} (id "
                                      f"{lora.lora_int_id}): {other.lora_name!r} (id "
                                      f"{other.lora_int_id}) is loaded under that name or id; "
                                      "remove it first", "lora_request")
        try:
            await self.collective_rpc("add_lora", [lora])
        except VllmActorsError as e:
            raise ValidationError(str(e).split(": ", 1)[-1], "lora_request") from None
        self.loras[lora.lora_name] = lora
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter everywhere; False when none has that id. Requests already
        running with it finish with it (each worker keeps an adapter while a request uses
        it); new requests naming it are refused."""
        lora = next((x for x in self.loras.values() if x.lora_int_id == lora_id), None)
        if lora is None:
            return False
        del self.loras[lora.lora_name]
        await self.collective_rpc("remove_lora", [lora_id])
        return True

    async def list_loras(self) -> set[int]:
        return {lora.lora_int_id for lora in self.loras.values()}


def pooling_output(output: RequestOutput) -> PoolingRequestOutput:
    """A finished pooling request's RequestOutput as vLLM's PoolingRequestOutput. Raises
    ValidationError (the request's fault) or VllmActorsError when it failed."""
    if output.pooled is None:
        reason = output.outputs[0].finish_reason if output.outputs else None
        message = output.error or f"the request ended ({reason}) without an output"
        if output.error_param is not None:
            raise ValidationError(message, output.error_param)
        raise VllmActorsError(message)
    data = np.frombuffer(output.pooled.data, np.float32).reshape(output.pooled.shape)
    return PoolingRequestOutput(output.request_id, PoolingOutput(data),
                                output.prompt_token_ids)


def _sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    return SchedulerStats(sum(s.num_running_reqs for s in stats),
                          sum(s.num_waiting_reqs for s in stats),
                          sum(s.kv_cache_usage for s in stats) / len(stats))
