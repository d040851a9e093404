"""EngineCore: owns the scheduler and the executor; `step()` = schedule -> execute -> update.

With `--pipeline-parallel-size P` up to P steps are in flight (vLLM's batch queue): a step is
submitted and, while there is room and something left to schedule, the next one is scheduled
instead of waiting, so the stages work on different batches at once; a step's output is
applied in submission order."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from vllm_actors.config import EngineConfig
from vllm_actors.errors import ValidationError
from vllm_actors.enginecore.kv_cache_manager import KVCacheManager
from vllm_actors.enginecore.request import Request
from vllm_actors.enginecore.scheduler import Scheduler
from vllm_actors.enginecore.spec_decode import DraftPolicy
from vllm_actors.enginecore.structured_output import StructuredOutputManager
from vllm_actors.protocol.engine import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                         EngineReady, FinishReason, SchedulerStats)
from vllm_actors.protocol.step import StepInput, StepOutput
from vllm_actors.sampling_params import MAX_N
from vllm_actors.workers.executor import executor_for


GRAMMAR_WAIT_S = 0.02   # the busy loop's wait for a grammar compile when idle otherwise


class EngineCore:
    """The scheduling loop's body. Construction loads the model (through the executor) and
    sizes the KV cache; `ready` holds what was found."""

    def __init__(self, config: EngineConfig, ipc_dir: str | None = None) -> None:
        """ipc_dir: where worker processes' sockets go (multi-process executor)."""
        self.executor = executor_for(config, ipc_dir)
        self.ready: EngineReady = self.executor.start()
        self.block_size = self.ready.block_size
        kv = KVCacheManager(self.ready.num_kv_blocks, self.block_size,
                            config.cache.enable_prefix_caching, self.ready.kv_group_windows)
        self.max_in_flight = config.parallel.pipeline_parallel_size
        self.in_flight: collections.deque[StepInput] = collections.deque()
        drafts = DraftPolicy(config.speculative) if config.speculative else None
        scheduling = config.scheduler
        if self.ready.runner == "pooling":   # a pooling prompt runs whole, never chunked
            scheduling = dataclasses.replace(scheduling, max_num_batched_tokens=max(
                scheduling.max_num_batched_tokens, self.ready.max_model_len))
        self.scheduler = Scheduler(scheduling, kv, self.ready.max_model_len,
                                   pipeline_depth=self.max_in_flight, drafts=drafts,
                                   max_loras=config.lora.max_loras if config.lora else 0)
        self.structured = StructuredOutputManager(config.model.model, self.ready.vocab_size,
                                                  config.model.tokenizer)

    def collective_rpc(self, method: str, args: list[Any]) -> list[Any]:
        """`RankHost.call(method, args)` on every worker rank (`Executor.collective_rpc`)."""
        return self.executor.collective_rpc(method, args)

    def check_health(self) -> None:
        """Raises WorkerDiedError when a worker process is gone (called while idle)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers (worker processes exit; nothing to do in process)."""
        self.executor.shutdown()

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request, or its n completions (one Request each, sharing the message's
        params). Raises ValidationError, before queueing any, for one the frontend should
        have refused (a duplicate id, n out of range, an empty or too long prompt, ids
        outside the vocabulary)."""
        num_tokens = len(req.prompt_token_ids)
        if not 1 <= req.n <= MAX_N:
            raise ValidationError(f"n must be between 1 and {MAX_N}, got {req.n}", "n")
        for request_id in req.child_request_ids:
            if request_id in self.scheduler.requests or request_id in self.structured.pending:
                raise ValidationError(f"request id {request_id!r} is already in use")
        self._check_runner(req)
        longest = self.ready.max_model_len - (req.pooling_params is None)
        if not 0 < num_tokens <= longest:
            raise ValidationError(f"the prompt has {num_tokens} tokens; it must have between 1 "
                                  f"and {longest}")
        if req.lora_request is not None and not self.scheduler.max_loras:
            raise ValidationError(f"LoRA adapter {req.lora_request.lora_name!r}: this engine "
                                  "serves no adapters (start it with --enable-lora)",
                                  "lora_request")
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= self.ready.vocab_size:
            raise ValidationError(f"prompt token ids must be in [0, {self.ready.vocab_size})")
        for request in Request.children(req, self.ready.max_model_len, self.block_size):
            if req.sampling_params.structured_outputs is not None:
                self.structured.submit(request)   # joins the scheduler once compiled
            else:
                self.scheduler.add_request(request)

    def _check_runner(self, req: EngineCoreRequest) -> None:
        """A pooling model takes pooling requests only, a generative one generation only."""
        pooling = self.ready.runner == "pooling"
        if pooling and req.pooling_params is None:
            raise ValidationError("this model serves pooling requests (embeddings, "
                                  "classification, scores), not generation: it runs with "
                                  "--runner pooling", "runner")
        if not pooling and req.pooling_params is not None:
            raise ValidationError("this model generates text: pooling requests need a "
                                  "pooling model (--runner pooling)", "runner")
        if pooling and req.pooling_params.task not in self.ready.pooling_tasks:
            raise ValidationError(f"this model does not serve the {req.pooling_params.task!r} "
                                  f"task (it serves {', '.join(self.ready.pooling_tasks)})",
                                  "task")

    def abort_requests(self, request_ids: list[str]) -> None:
        self.structured.abort(request_ids)
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests()

    def has_work(self) -> bool:
        """Requests to run, or finished ones the worker has not been told about yet (one
        more step frees their rows and reports the new counts)."""
        return (self.scheduler.has_requests() or bool(self.scheduler.finished_req_ids)
                or self.structured.has_pending() or bool(self.in_flight))

    def get_stats(self) -> SchedulerStats:
        """The scheduler's current state (prefix-cache counters are left for the next step)."""
        s = self.scheduler
        return SchedulerStats(len(s.running), len(s.waiting) + len(self.structured.pending),
                              s.kv.usage)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while requests hold KV blocks."""
        return self.scheduler.kv.reset_prefix_cache()

    def step(self) -> EngineCoreOutputs:
        if not self.has_work():
            return EngineCoreOutputs(timestamp=time.time())
        if self.max_in_flight > 1:
            return self._step_pipelined()
        failed = self._admit_compiled_grammars()
        step_input = self.scheduler.schedule()
        self._add_grammar_bitmask(step_input)
        has_work = step_input.num_scheduled_tokens or step_input.finished_req_ids
        step_output = self.executor.execute(step_input) if has_work else StepOutput()
        outputs = self.scheduler.update_from_output(step_input, step_output)
        return self._outputs(failed + outputs)

    def _step_pipelined(self) -> EngineCoreOutputs:
        """Submit a new step while fewer than P are in flight and it has tokens to run;
        otherwise (full, or nothing new to run) wait for the oldest and apply its output."""
        failed = self._admit_compiled_grammars()
        submitted = False
        if len(self.in_flight) < self.max_in_flight:
            step_input = self.scheduler.schedule()
            if step_input.num_scheduled_tokens or step_input.finished_req_ids:
                self._add_grammar_bitmask(step_input)
                self.executor.submit(step_input)
                self.in_flight.append(step_input)
                submitted = bool(step_input.num_scheduled_tokens)
        outputs = []
        if self.in_flight and (not submitted or len(self.in_flight) >= self.max_in_flight):
            step_input = self.in_flight.popleft()
            outputs = self.scheduler.update_from_output(step_input, self.executor.collect())
        return self._outputs(failed + outputs)

    def _outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        stats = self.scheduler.make_stats()
        stats.num_waiting_reqs += len(self.structured.pending)   # waiting for their grammar
        return EngineCoreOutputs(outputs, time.time(), stats)

    def _admit_compiled_grammars(self) -> list[EngineCoreOutput]:
        """Requests whose grammar is ready join the scheduler; failed ones finish with an
        error. With nothing else to run, wait briefly for a compile instead of spinning."""
        if not self.structured.has_pending():
            return []
        if not self.scheduler.has_requests():
            self.structured.wait(GRAMMAR_WAIT_S)
        ready, failed = self.structured.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        return [EngineCoreOutput(r.request_id, [], FinishReason.ERROR, error=error,
                                 error_param="structured_outputs") for r, error in failed]

    def _add_grammar_bitmask(self, step: StepInput) -> None:
        """Allowed tokens for the structured-output requests that sample this step (their
        scheduled tokens reach their last known token)."""
        scheduled = map(self.scheduler.requests.__getitem__, step.num_scheduled_tokens)
        sampling = [r for r in scheduled
                    if r.grammar is not None and r.num_computed_tokens >= r.num_tokens]
        if sampling:
            step.grammar_req_ids = [r.request_id for r in sampling]
            drafts = [step.spec_token_ids.get(r.request_id, []) for r in sampling] \
                if step.spec_token_ids else None
            step.grammar_bitmask = self.structured.bitmask(sampling, drafts)
