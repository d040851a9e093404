"""LLM: the offline API. Prompts in, finished `RequestOutput`s out, in the order given.

It drives the same engine core process as AsyncLLM, through an AsyncLLM whose event loop
runs in a private thread, so there is one code path for both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import msgspec
from tqdm import tqdm

from vllm_actors.errors import EngineDeadError, ValidationError
from vllm_actors.frontend.async_llm import AsyncLLM
from vllm_actors.frontend.input_processor import PromptType
from vllm_actors.loaders.tokenizer import Tokenizer
from vllm_actors.lora_request import LoRARequest
from vllm_actors.frontend.pooling_tasks import encode_all, pair_up, score_pairs
from vllm_actors.outputs import (ClassificationOutput, EmbeddingOutput, PoolingRequestOutput,
                                 RequestOutput, ScoringOutput)
from vllm_actors.pooling_params import PoolingParams
from vllm_actors.sampling_params import RequestOutputKind, SamplingParams

Messages = list[dict[str, Any]]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _close(engine: AsyncLLM | None, loop: asyncio.AbstractEventLoop,
           thread: threading.Thread) -> None:
    """Shut the engine down, then stop its loop thread (not joined from itself: a collection
    may run this on any thread)."""
    if engine is not None:
        engine.shutdown()
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
        if threading.current_thread() is not thread:
            thread.join(5)


def _per_prompt(name: str, value: Any, count: int, kind: type | tuple[type, ...]
                ) -> list[Any]:
    """`value` for every prompt: one of `kind` for all, or a list of `count` of them.
    Raises ValidationError naming `name` otherwise."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count:
        raise ValidationError(f"got {count} prompts but {len(values)} {name} entries", name)
    for v in values:
        if not isinstance(v, kind) or isinstance(v, bool):
            names = kind.__name__ if isinstance(kind, type) else kind[0].__name__
            names = f"an {names}" if names[0] in "aeiou" else f"a {names}"
            raise ValidationError(f"{name} must be {names} or a list of them, got "
                                  f"{type(v).__name__}", name)
    return values


class LLM:
    """Load a model (in the engine core process) and generate with it.

    Args:
        model: a .gguf file or an HF directory; None = the default model (SmolLM2).
        **engine_args: any `EngineArgs` field (max_model_len, max_num_seqs, seed, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="LLM-loop",
                                        daemon=True)
        self._thread.start()
        try:
            self.engine = AsyncLLM(model, **engine_args)
        except BaseException:
            _close(None, self._loop, self._thread)
            raise
        # an LLM dropped without shutdown() ends its core and thread when it is collected
        # (the loop holds the engine, not the LLM), as vLLM's finalizer does
        self._closer = weakref.finalize(self, _close, self.engine, self._loop, self._thread)
        self._request_counter = itertools.count()

    @property
    def llm_engine(self) -> AsyncLLM:
        """vLLM's name for the engine behind this LLM."""
        return self.engine

    # -- plumbing ------------------------------------------------------------------------
    def _submit(self, coro: Any) -> "concurrent.futures.Future":
        if not self._loop.is_running():
            coro.close()
            raise EngineDeadError("the engine was shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Any) -> Any:
        return self._submit(coro).result()

    def shutdown(self) -> None:
        """Stop the engine core and the loop thread; idempotent."""
        self._closer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- queries -------------------------------------------------------------------------
    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_metrics(self) -> dict[str, float]:
        """Engine counters since start (preemptions, prefix-cache queries and hits, in tokens)
        and gauges of the latest step, under vLLM's metric names."""
        return self.engine.metrics.snapshot()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults (see
        --generation-config) where this engine implements them, else vLLM's defaults."""
        return SamplingParams(**self.engine.generation_defaults)

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes; False while requests still hold KV blocks."""
        return self._run(self.engine.reset_prefix_cache())

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (`generate` loads those it is given anyway)."""
        return self._run(self.engine.add_lora(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        return self._run(self.engine.remove_lora(lora_id))

    def list_loras(self) -> set[int]:
        return self._run(self.engine.list_loras())

    def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        """Call `method` on every worker rank; the results in rank order (see
        `AsyncLLM.collective_rpc`)."""
        return self._run(self.engine.collective_rpc(method, args))

    # -- generation ----------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in order.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt;
        `priority`: one per prompt (with --scheduling-policy priority); `use_tqdm`: a bool,
        or a tqdm-like class to make the progress bar with (vLLM's).

        Raises:
            ValidationError: a bad prompt, a sampling_params, lora_request or priority list
                of the wrong length or type, or an adapter that cannot be loaded (then
                nothing is left running).
            EngineDeadError: the engine core died.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise ValidationError("prompts must be a string, a prompt dict or a list of them, "
                                  f"got {type(prompts).__name__}", "prompts")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt("sampling_params", sampling_params, len(prompts), SamplingParams)
        final = [msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                 for p in params]
        loras = _per_prompt("lora_request", lora_request, len(prompts), (LoRARequest, type(None)))
        priorities = _per_prompt("priority", 0 if priority is None else priority, len(prompts),
                                 int)
        for lora in {id(x): x for x in loras if x is not None}.values():
            self._run(self.engine.add_lora(lora))
        ids = [str(next(self._request_counter)) for _ in prompts]
        bar = use_tqdm if callable(use_tqdm) else tqdm
        progress = bar(total=len(ids), desc="Processed prompts", unit="req",
                       disable=not use_tqdm or len(ids) < 2)
        future = self._submit(self._generate_all(ids, list(prompts), final, progress, loras,
                                                 priorities))
        try:
            return future.result()
        except KeyboardInterrupt:
            self._loop.call_soon_threadsafe(self.engine.abort_requests, ids)
            raise
        finally:
            progress.close()

    async def _generate_all(self, ids: list[str], prompts: list[PromptType],
                            params: list[SamplingParams], progress: tqdm,
                            loras: list[LoRARequest | None], priorities: list[int]
                            ) -> list[RequestOutput]:
        collectors = []
        try:
            for request_id, prompt, p, lora, rank in zip(ids, prompts, params, loras,
                                                         priorities):
                collectors.append(self.engine.add_request(request_id, prompt, p, rank,
                                                          lora_request=lora))
        except BaseException:
            self.engine.abort_requests(ids[:len(collectors)])
            raise

        async def finished(collector: Any) -> RequestOutput:
            output = await collector.get()
            progress.update(1)
            return output

        return list(await asyncio.gather(*(finished(c) for c in collectors)))

    # -- pooling models --------------------------------------------------------------------
    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """A pooling model's raw outputs (`outputs.data`, float32), one per prompt, in
        order; `pooling_task` overrides the params' task (default: one vector per token,
        vLLM's "encode"). Raises ValidationError for a generative model or bad inputs."""
        params = pooling_params or PoolingParams(task="encode")
        if pooling_task is not None:
            params = msgspec.structs.replace(params, task=pooling_task)
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return self._run(encode_all(self.engine, prompts, params))

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`), normalized unless the params say
        otherwise."""
        params = self._params(pooling_params, "embed", truncate_prompt_tokens)
        return [_view(o, EmbeddingOutput(o.outputs.data.tolist()))
                for o in self.encode(prompts, params)]

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Class probabilities per prompt (`outputs.probs`), for a classifier model."""
        params = self._params(pooling_params, "classify", truncate_prompt_tokens)
        return [_view(o, ClassificationOutput(o.outputs.data.tolist()))
                for o in self.encode(prompts, params)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Relevance of each (data_1, data_2) pair (`outputs.score`): one data_1 against
        every data_2, or the lists zipped. A cross-encoder scores the pair; an embedding
        model gives the cosine similarity of the two embeddings."""
        params = self._params(pooling_params, "score", truncate_prompt_tokens)
        pairs = pair_up(data_1, data_2)
        scores, _ = self._run(score_pairs(self.engine, pairs, params))
        return [PoolingRequestOutput(str(i), ScoringOutput(s), [])
                for i, s in enumerate(scores)]

    @staticmethod
    def _params(params: PoolingParams | None, task: str,
                truncate: int | None) -> PoolingParams:
        params = msgspec.structs.replace(params or PoolingParams(), task=task)
        if truncate is not None:
            params = msgspec.structs.replace(params, truncate_prompt_tokens=truncate)
            params.__post_init__()
        return params

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None
               ) -> Iterator[str]:
        """Generate for one prompt, yielding text as it is produced (our addition to vLLM's
        API). Closing the iterator early aborts the request."""
        params = msgspec.structs.replace(sampling_params or SamplingParams(),
                                         output_kind=RequestOutputKind.DELTA, n=1)
        pieces: queue.Queue = queue.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for output in self.engine.generate(prompt, params):
                    pieces.put(output.outputs[0].text)
            except BaseException as e:  # delivered to the consumer
                pieces.put(e)
            finally:
                pieces.put(done)

        future = self._submit(pump())
        try:
            while (item := pieces.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                if item:
                    yield item
        finally:
            future.cancel()

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             continue_final_message: bool = False,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts; content a
        string or OpenAI's text parts) or to a list of conversations, rendered with the
        model's chat template (which also sees `tools`, OpenAI-style function definitions,
        and `chat_template_kwargs`, as in vLLM's LLM.chat). `continue_final_message` leaves
        the last message open for the model to go on."""
        if continue_final_message and add_generation_prompt:
            raise ValidationError("continue_final_message and add_generation_prompt cannot "
                                  "both be true (set add_generation_prompt=False)",
                                  "continue_final_message")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.input_processor.chat_prompt(
            list(c), chat_template, add_generation_prompt, tools, chat_template_kwargs,
            continue_final_message=continue_final_message) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)


def _view(output: PoolingRequestOutput, outputs: object) -> PoolingRequestOutput:
    """The output with its task's view of the data (an EmbeddingOutput, ...)."""
    return PoolingRequestOutput(output.request_id, outputs, output.prompt_token_ids,
                                output.finished)
