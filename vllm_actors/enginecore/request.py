"""A request's state inside the engine core, and the stop rules checked after every token."""

from __future__ import annotations

import enum

from vllm_actors.protocol.engine import EngineCoreRequest, FinishReason


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Request:
    """Token ids and progress of one request.

    `num_computed_tokens` catches up with `num_tokens` (prompt + outputs); a step computes
    the difference, or part of it.
    """

    def __init__(self, req: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = req.request_id
        self.params = req.sampling_params
        self.prompt_token_ids = req.prompt_token_ids
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.eos_token_ids = frozenset(req.eos_token_ids)
        self.stop_token_ids = frozenset(self.params.stop_token_ids)
        self.arrival_time = req.arrival_time
        self.priority = req.priority
        self.max_model_len = max_model_len
        budget = max_model_len - self.num_prompt_tokens
        self.max_tokens = budget if self.params.max_tokens is None else \
            min(self.params.max_tokens, budget)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """After an appended token: set finish_reason and return True when the request is done.

        Order as vLLM: length limits first, then nothing before min_tokens, then EOS, then
        stop_token_ids (which also records stop_reason).
        """
        if self.num_tokens >= self.max_model_len or self.num_output_tokens >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        if self.num_output_tokens < self.params.min_tokens:
            return False
        last = self.all_token_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            self.finish_reason = FinishReason.STOP
            return True
        if last in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
            self.stop_reason = last
            return True
        return False
