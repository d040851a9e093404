"""OutputProcessor: engine outputs -> RequestOutputs in each request's collector.

The frontend's one loop over a step's outputs: append tokens, detokenize, apply stop strings
(the core is then told to abort), shape the output by kind (cumulative, delta, final-only),
and merge the n completions of a parent request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_actors.frontend.collector import RequestOutputCollector
from vllm_actors.frontend.detokenizer import IncrementalDetokenizer, StopPrefixes
from vllm_actors.frontend.logprobs import LogprobsBuilder
from vllm_actors.frontend.metrics import FrontendMetrics
from vllm_actors.loaders.tokenizer import Tokenizer
from vllm_actors.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from vllm_actors.protocol.engine import (EngineCoreOutput, EngineCoreRequest, FinishReason,
                                         TokenLogprobs)
from vllm_actors.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


@dataclass
class ParentRequest:
    """The user's request behind n engine requests (completion i is engine request i)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    collector: RequestOutputCollector
    num_children: int
    finals: dict[int, CompletionOutput] = field(default_factory=dict)

    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False
    pooled: Any = None     # a pooling request's output, when it arrives

    def output_for(self, completion: CompletionOutput, num_cached_tokens: int,
                   error: str | None, error_param: str | None = None) -> RequestOutput | None:
        if completion.finished():
            self.finals[completion.index] = completion
        finished = len(self.finals) == self.num_children
        if self.kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            completions = [self.finals[i] for i in sorted(self.finals)]
        else:
            completions = [completion]
        prompt_logprobs = self.prompt_logprobs
        if self.kind == RequestOutputKind.DELTA and self.sent_prompt_logprobs:
            prompt_logprobs = None   # deltas carry them once
        self.sent_prompt_logprobs |= prompt_logprobs is not None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished, num_cached_tokens, error, prompt_logprobs, error_param,
                             self.pooled)


@dataclass
class RequestState:
    """One engine request as the frontend tracks it."""

    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    sent_tokens: int = 0
    sent_chars: int = 0
    last_token_time: float | None = None
    queue_s: float | None = None
    num_logprobs: int | None = None          # the request's k, when it asked for logprobs
    num_prompt_logprobs: int | None = None   # k, when it asked for prompt logprobs
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    sent_logprobs: int = 0
    eos_token_ids: frozenset[int] = frozenset()    # EOS, unless ignored (shared by siblings)
    stop_token_ids: Sequence[int] = ()             # the params' own list, not copied
    engine: int = 0                # the data parallel engine core serving it

    def stopped_by_token(self, out: EngineCoreOutput) -> bool:
        """The engine stopped `out`'s request on EOS or a stop token id (a STOP on another
        token ended a complete grammar). The core names a stop id it stopped on; only a
        grammar's end needs the list itself (no set of it is built on the event loop)."""
        if out.finish_reason != FinishReason.STOP or not out.new_token_ids:
            return False
        last = out.new_token_ids[-1]
        return out.stop_reason is not None or last in self.eos_token_ids or \
            last in self.stop_token_ids

    def record_timing(self, out: EngineCoreOutput, metrics: FrontendMetrics) -> None:
        now = time.time()
        if out.scheduled_time is not None:
            self.queue_s = out.scheduled_time - self.arrival_time
        if out.new_token_ids:
            first = now - self.arrival_time if self.last_token_time is None else None
            since = None if self.last_token_time is None else now - self.last_token_time
            metrics.observe_tokens(len(out.new_token_ids), first, since, self.engine)
            self.last_token_time = now

    def completion(self, finish_reason: str | None, stop_reason: int | str | None
                   ) -> CompletionOutput | None:
        """This step's completion output for the parent's kind (None: nothing to send)."""
        finished = finish_reason is not None
        kind = self.parent.kind
        text = self.detokenizer.output_text
        end = self.detokenizer.releasable_text_length(finished)
        with_lp = self.num_logprobs is not None
        cumulative = self.cumulative_logprob if with_lp else None
        if kind == RequestOutputKind.DELTA:
            new_text, new_ids = text[self.sent_chars:end], self.token_ids[self.sent_tokens:]
            if not (new_text or new_ids or finished):
                return None
            new_lp = self.logprobs[self.sent_logprobs:] if with_lp else None
            self.sent_chars, self.sent_tokens = max(self.sent_chars, end), len(self.token_ids)
            self.sent_logprobs = len(self.logprobs)
            return CompletionOutput(self.index, new_text, new_ids, finish_reason, stop_reason,
                                    new_lp, cumulative)
        return CompletionOutput(self.index, text[:end], list(self.token_ids), finish_reason,
                                stop_reason, list(self.logprobs) if with_lp else None,
                                cumulative)

    def record_logprobs(self, out: EngineCoreOutput, builder: LogprobsBuilder,
                        prompt_positions: list[PositionLogprobs] | None = None) -> None:
        """`prompt_positions`: the prompt logprobs already built (off the event loop)."""
        if out.logprobs is not None and self.num_logprobs is not None:
            positions = builder.positions(out.logprobs, self.num_logprobs)
            self.logprobs.extend(positions)
            self.cumulative_logprob += sum(lp[0] for lp in out.logprobs.logprobs)
        if self.parent.prompt_logprobs is not None or self.num_prompt_logprobs is None:
            return
        if out.prompt_logprobs is not None:
            if prompt_positions is None:
                prompt_positions = builder.positions(out.prompt_logprobs,
                                                     self.num_prompt_logprobs)
            self.parent.prompt_logprobs = [None, *prompt_positions]
        elif self.num_prompt_tokens == 1 and out.error is None:
            self.parent.prompt_logprobs = [None]    # no position follows a lone token


class OutputProcessor:
    """Tracks every engine request in flight, by engine request id."""

    def __init__(self, tokenizer: Tokenizer, metrics: FrontendMetrics) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.logprobs_builder = LogprobsBuilder(tokenizer)
        self.states: dict[str, RequestState] = {}
        self.children: dict[str, list[str]] = {}   # user request id -> engine request ids

    def add_request(self, parent: ParentRequest, request: EngineCoreRequest,
                    engine: int = 0) -> list[str]:
        """Track the `request.n` completions of `parent` (`request.child_request_ids`),
        served by engine core `engine`; returns their engine ids. What is derived from the
        params (the EOS set, the stop-string index) is built once and shared by them."""
        params = request.sampling_params
        eos_token_ids = frozenset(request.eos_token_ids)
        stop_prefixes = StopPrefixes(params.stop) if params.stop else None
        engine_ids = request.child_request_ids
        for index, engine_id in enumerate(engine_ids):
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params,
                                           stop_prefixes)
            self.states[engine_id] = RequestState(
                parent, index, detok, request.arrival_time, len(request.prompt_token_ids),
                num_logprobs=params.logprobs, num_prompt_logprobs=params.prompt_logprobs,
                eos_token_ids=eos_token_ids, stop_token_ids=params.stop_token_ids,
                engine=engine)
        self.children.setdefault(parent.request_id, []).extend(engine_ids)
        return engine_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def _finish(self, engine_id: str) -> None:
        state = self.states.pop(engine_id)
        siblings = self.children.get(state.parent.request_id, [])
        if engine_id in siblings:
            siblings.remove(engine_id)
        if not siblings:
            self.children.pop(state.parent.request_id, None)

    def prompt_positions(self, out: EngineCoreOutput) -> list[PositionLogprobs] | None:
        """The prompt logprobs `out` carries as per-position dicts, or None when its request
        is gone. Safe to run off the event loop while the output handler waits for it."""
        state = self.states.get(out.request_id)
        if state is None or out.prompt_logprobs is None:
            return None
        return self.logprobs_builder.positions(out.prompt_logprobs,
                                               state.num_prompt_logprobs or 0)

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        prompt_positions: dict[str, list[PositionLogprobs]] | None = None
                        ) -> list[str]:
        """Apply one step's outputs; returns engine ids that stop strings finished, which the
        core must abort. `prompt_positions`: prompt logprobs built beforehand, by id."""
        to_abort = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:   # aborted meanwhile
                continue
            try:
                self._process_output(out, state, to_abort,
                                     (prompt_positions or {}).get(out.request_id))
            except Exception as e:   # this request's alone: fail it, keep the others
                logger.exception("processing the output of %s failed", out.request_id)
                to_abort.append(out.request_id)
                if out.request_id in self.states:
                    self._emit(out.request_id, state, "error", None, out.num_cached_tokens,
                               f"processing the output failed: {type(e).__name__}: {e}")
        return to_abort

    def _process_output(self, out: EngineCoreOutput, state: RequestState,
                        to_abort: list[str],
                        prompt_positions: list[PositionLogprobs] | None) -> None:
        reason, stop_reason = out.finish_reason, out.stop_reason
        # a STOP on a token other than EOS / stop ids ended a complete grammar: keep it
        by_token = state.stopped_by_token(out)
        stop_str = state.detokenizer.update(out.new_token_ids, reason is not None, by_token)
        if stop_str is not None:
            if reason is None:
                to_abort.append(out.request_id)
            reason, stop_reason = FinishReason.STOP, stop_str
            used = state.detokenizer.num_used_tokens
            if used < len(out.new_token_ids):   # a stop inside several tokens: drop the rest
                out = msgspec.structs.replace(out, new_token_ids=out.new_token_ids[:used],
                                              logprobs=out.logprobs and TokenLogprobs(
                                                  out.logprobs.token_ids[:used],
                                                  out.logprobs.logprobs[:used],
                                                  out.logprobs.ranks[:used]))
        if out.pooled is not None:
            state.parent.pooled = out.pooled
        state.record_timing(out, self.metrics)
        state.record_logprobs(out, self.logprobs_builder, prompt_positions)
        state.token_ids.extend(out.new_token_ids)
        self._emit(out.request_id, state, None if reason is None else str(reason),
                   stop_reason, out.num_cached_tokens, out.error, out.error_param)

    def _emit(self, engine_id: str, state: RequestState, finish_reason: str | None,
              stop_reason: int | str | None, num_cached_tokens: int, error: str | None,
              error_param: str | None = None) -> None:
        completion = state.completion(finish_reason, stop_reason)
        if finish_reason is not None:
            self._finish(engine_id)
            self.metrics.observe_finished(finish_reason, state.num_prompt_tokens,
                                          time.time() - state.arrival_time, state.queue_s,
                                          state.engine)
        if completion is not None:
            output = state.parent.output_for(completion, num_cached_tokens, error, error_param)
            if output is not None:
                state.parent.collector.put(output)

    def engine_ids(self, request_ids: list[str]) -> list[str]:
        """The engine requests behind user request ids (unknown ids are skipped)."""
        return [e for r in request_ids for e in self.children.get(r, [])]

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Finish user requests with "abort" (their consumers get a final output); returns
        the engine ids to abort in the core."""
        engine_ids = self.engine_ids(request_ids)
        for engine_id in engine_ids:
            state = self.states.get(engine_id)
            if state is not None:
                self._emit(engine_id, state, "abort", None, 0, None)
        return engine_ids

    def fail_engine(self, engine: int, error: BaseException) -> list[str]:
        """Engine core `engine` died: the consumers of its requests (all children of a
        parent go to one core) get `error`; returns the engine ids dropped."""
        dropped = [i for i, state in self.states.items() if state.engine == engine]
        for engine_id in dropped:
            state = self.states[engine_id]
            self._finish(engine_id)
            state.parent.collector.put(error)
        return dropped

    def fail_all(self, error: BaseException) -> None:
        """The engine died: every consumer's next read raises `error`."""
        for state in self.states.values():
            state.parent.collector.put(error)
        self.states.clear()
        self.children.clear()
