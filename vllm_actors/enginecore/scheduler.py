"""Scheduler: vLLM V1's single token budget per step, no prefill/decode phases.

Every request has `num_computed_tokens` catching up with `num_tokens`. A step serves running
requests first (decodes and unfinished prompt chunks), then admits waiting ones while the
budget, `max_num_seqs` and free KV blocks allow; long prompts are chunked. When blocks run
out, the last admitted running request (fcfs/lpm) or the lowest-priority one (priority) is
preempted: its KV is freed and it is recomputed later, cheaply when its blocks are still
prefix-cached.

With pipeline parallelism the core keeps P steps in flight (`EngineCore`): a request in one
of them is never chosen to be preempted (its KV is being written), and a decode waits for its
sampled token anyway (its computed count already reached its token count). A step takes at
most 1/P of the running requests, so the running set splits into P batches that follow each
other through the stages (otherwise every decode would ride in one batch and the stages
would take turns instead of working at once). The stages are told the tokens sampled since a
request's last step (`CachedRequestData.new_token_ids`).
"""

from __future__ import annotations

import time

from vllm_actors.config import SchedulerConfig
from vllm_actors.enginecore.admission import make_waiting_queue
from vllm_actors.enginecore.kv_cache_manager import KVCacheManager
from vllm_actors.enginecore.request import Request, RequestStatus
from vllm_actors.enginecore.spec_decode import DraftPolicy
from vllm_actors.protocol.engine import (EngineCoreOutput, FinishReason, SchedulerStats,
                                         SpecDecodingStats, TokenLogprobs)
from vllm_actors.protocol.step import CachedRequestData, NewRequestData, StepInput, StepOutput
from vllm_actors.sampling_params import SamplingParams


_PARAMS_ELSEWHERE = SamplingParams()   # NewRequestData.params_from names the real ones
# a request whose adapter waits for a --max-loras slot is passed over at most this many
# steps; then nothing behind it is admitted until its adapter fits (no starvation)
LORA_MAX_SKIPS = 8


class Scheduler:
    """Args:
        config: limits and policy.
        kv: the KV cache manager (block accounting and prefix cache).
        max_model_len: longest prompt + output of any request.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 pipeline_depth: int = 1, drafts: DraftPolicy | None = None,
                 max_loras: int = 0) -> None:
        """pipeline_depth: steps in flight at most (pipeline parallel size).
        drafts: speculative decoding's rules for the workers' drafts (None: no drafts).
        max_loras: most distinct LoRA adapters among the running requests (--max-loras)."""
        self.config = config
        self.max_loras = max_loras
        self.drafts = drafts
        self.num_lookahead_tokens = drafts.num_lookahead_tokens if drafts else 0
        self.spec_stats: SpecDecodingStats | None = None   # this step's verifications
        self.pipeline_depth = pipeline_depth
        # request id -> its steps not yet updated (kept with pipeline parallelism only:
        # otherwise every step is updated before the next is scheduled)
        self.in_flight: dict[str, int] = {}
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = make_waiting_queue(config.policy, kv.cached_prefix_tokens,
                                          config.lpm_max_skips)
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []   # to tell workers on the next step
        self.num_preemptions = 0                # in the current step

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> None:
        """Finish (e.g. abort) requests; unknown or already finished ids are ignored."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason = reason
            self._free(request)

    def _free(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.finished_req_ids.append(request.request_id)
        request.status = RequestStatus.FINISHED
        self.kv.free(request)
        del self.requests[request.request_id]

    def _pick_victim(self) -> Request | None:
        """The request to preempt, never one with a step in flight (None: no candidate)."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
        if not candidates:
            return None
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, victim: Request, step: StepInput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.spec_token_ids = []
        step.spec_token_ids.pop(victim.request_id, None)
        if step.num_scheduled_tokens.pop(victim.request_id, None) is not None:
            # already scheduled earlier in this step: take it out again
            cached = step.cached_requests
            i = cached.req_ids.index(victim.request_id)
            for column in (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                           cached.new_token_ids):
                if column:
                    del column[i]
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.append(victim.request_id)
        self.waiting.prepend(victim)

    def _schedule_running(self, step: StepInput, budget: int) -> int:
        i, left = 0, -(-len(self.running) // self.pipeline_depth)   # this step's share
        while i < len(self.running) and budget > 0 and left > 0:
            request = self.running[i]
            num_new = min(request.num_tokens + len(request.spec_token_ids)
                          - request.num_computed_tokens, budget,
                          self.max_model_len - 1 - request.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            lookahead = min(self.num_lookahead_tokens,
                            self.max_model_len - request.num_computed_tokens - num_new)
            new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            while new_blocks is None:
                victim = self._pick_victim()
                if victim is None:     # every candidate is in flight: wait for them
                    return 0
                budget += step.num_scheduled_tokens.get(victim.request_id, 0)
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim, step)
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, num_new,
                                                    num_lookahead_tokens=lookahead)
            if new_blocks is None:
                continue
            cached = step.cached_requests
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append([[b.block_id for b in group] for group in new_blocks])
            cached.num_computed_tokens.append(request.num_computed_tokens)
            if self.pipeline_depth > 1:
                cached.new_token_ids.append(request.all_token_ids[request.num_tokens_sent:])
                request.num_tokens_sent = request.num_tokens
            step.num_scheduled_tokens[request.request_id] = num_new
            num_drafts = request.num_computed_tokens + num_new - request.num_tokens
            if num_drafts > 0:
                step.spec_token_ids[request.request_id] = request.spec_token_ids[:num_drafts]
            request.num_computed_tokens += num_new
            budget -= num_new
            left -= 1
            i += 1
        return budget

    def _running_loras(self) -> set[int]:
        return {r.lora.lora_int_id for r in self.running if r.lora is not None}

    def _lora_blocked(self, request: Request, loras: set[int]) -> bool:
        """Whether admitting `request` would run more than --max-loras adapters at once."""
        return request.lora is not None and request.lora.lora_int_id not in loras and \
            len(loras) >= self.max_loras

    def _schedule_waiting(self, step: StepInput, budget: int) -> None:
        sent: dict[int, str] = {}   # id of params -> the first new request carrying them
        loras = self._running_loras() if self.max_loras else set()
        passed_over: list[Request] = []
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if self._lora_blocked(request, loras):
                request.lora_skips += 1
                if request.lora_skips > LORA_MAX_SKIPS:
                    break       # it has waited long enough: nothing overtakes it now
                self.waiting.pop(request)
                passed_over.append(request)
                continue
            # prompt logprobs need every prompt position computed, and a pooling request
            # its every hidden state: no prefix-cache reads
            whole = request.params.prompt_logprobs is not None or request.pooling is not None
            hits, num_hit = (None, 0) if whole else self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if request.pooling is not None and num_new < request.num_tokens:
                break   # a pooling prompt runs whole: it waits for a step with room
            lookahead = min(self.num_lookahead_tokens,
                            self.max_model_len - num_hit - num_new)
            if self.kv.allocate_slots(request, num_new, hits, lookahead) is None:
                break
            self.waiting.pop(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.scheduled_time = time.time()
            first = sent.setdefault(id(request.params), request.request_id)
            shared = first != request.request_id   # a sibling's params already travel
            step.new_requests.append(NewRequestData(
                request.request_id, list(request.all_token_ids),
                _PARAMS_ELSEWHERE if shared else request.params,
                self.kv.get_block_ids(request.request_id), num_hit, request.num_prompt_tokens,
                sorted(request.eos_token_ids), request.child_index, first if shared else "",
                request.lora, request.pooling))
            step.num_scheduled_tokens[request.request_id] = num_new
            request.num_tokens_sent = request.num_tokens
            request.num_computed_tokens = num_hit + num_new
            budget -= num_new
            if request.lora is not None:
                loras.add(request.lora.lora_int_id)
        for request in reversed(passed_over):   # back at the front, in their order
            self.waiting.prepend(request)

    def schedule(self) -> StepInput:
        """Choose this step's work; computed counts advance as if the step will succeed."""
        self.num_preemptions = 0
        step = StepInput(cached_requests=CachedRequestData(), spec_token_ids={})
        budget = self._schedule_running(step, self.config.max_num_batched_tokens)
        if self.num_preemptions == 0:
            self._schedule_waiting(step, budget)
        step.finished_req_ids = self.finished_req_ids
        self.finished_req_ids = []
        if self.pipeline_depth > 1:
            for req_id in step.num_scheduled_tokens:
                self.in_flight[req_id] = self.in_flight.get(req_id, 0) + 1
        return step

    def update_from_output(self, step: StepInput, output: StepOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free finished requests. Partial prompt
        chunks (no sampled token) produce no output."""
        if self.pipeline_depth > 1:
            for req_id in step.num_scheduled_tokens:
                left = self.in_flight.pop(req_id) - 1
                if left:
                    self.in_flight[req_id] = left
        outputs = []
        for req_id, reason in output.failed.items():
            request = self.requests.get(req_id)
            if request is not None:
                self.finish_requests([req_id], FinishReason.ERROR)
                outputs.append(EngineCoreOutput(req_id, [], FinishReason.ERROR,
                                                num_cached_tokens=request.num_cached_tokens,
                                                error=reason,
                                                error_param=output.failed_params.get(req_id)))
        outputs.extend(self._finish_pooled(output))
        for req_id, token_ids in zip(output.req_ids, output.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or not token_ids:   # aborted meanwhile, or mid-prompt
                continue
            drafts = step.spec_token_ids.get(req_id)
            if drafts:   # the rejected drafts' KV is stale: compute from the first again
                request.num_computed_tokens -= len(drafts) + 1 - len(token_ids)
                self._observe_drafts(request, len(drafts), len(token_ids) - 1)
            num_appended = 0
            for token_id in token_ids:
                request.append_output_token(token_id)
                num_appended += 1
                if request.check_stop():
                    break
            logprobs = output.logprobs.get(req_id)
            if num_appended < len(token_ids):   # stopped before the last accepted token
                token_ids = token_ids[:num_appended]
                logprobs = logprobs and _first_positions(logprobs, num_appended)
            elif self.drafts is not None:
                request.spec_token_ids = self.drafts.accept(
                    request, output.draft_token_ids.get(req_id, ()), len(self.running))
            outputs.append(EngineCoreOutput(
                req_id, list(token_ids), request.finish_reason, request.stop_reason,
                request.num_cached_tokens, request.error, scheduled_time=request.scheduled_time,
                logprobs=logprobs,
                prompt_logprobs=output.prompt_logprobs.get(req_id),
                error_param=request.error_param))
            request.scheduled_time = None
            if request.finish_reason is not None:
                self.running.remove(request)
                self._free(request)
        return outputs

    def _finish_pooled(self, output: StepOutput) -> list[EngineCoreOutput]:
        """Pooling requests end with their pooled output (finish reason stop)."""
        outputs = []
        for req_id, pooled in output.pooled.items():
            request = self.requests.get(req_id)
            if request is None:   # aborted meanwhile
                continue
            request.finish_reason = FinishReason.STOP
            outputs.append(EngineCoreOutput(req_id, [], FinishReason.STOP,
                                            num_cached_tokens=0,
                                            scheduled_time=request.scheduled_time,
                                            pooled=pooled))
            self.running.remove(request)
            self._free(request)
        return outputs

    def _observe_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        if self.spec_stats is None:
            self.spec_stats = SpecDecodingStats()
        self.spec_stats.observe(num_drafts, num_accepted)
        if self.drafts is not None:
            self.drafts.observe(request, num_drafts, num_accepted)

    def make_stats(self) -> SchedulerStats:
        queries, hits = self.kv.take_prefix_stats()
        spec, self.spec_stats = self.spec_stats, None
        stats = SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, queries,
                               hits, self.num_preemptions, spec)
        if self.max_loras:
            stats.running_lora_adapters = sorted({r.lora.lora_name for r in self.running
                                                  if r.lora is not None})
            stats.waiting_lora_adapters = sorted({r.lora.lora_name for r in self.waiting
                                                  if r.lora is not None})
        return stats


def _first_positions(logprobs: TokenLogprobs, n: int) -> TokenLogprobs:
    return TokenLogprobs(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])
