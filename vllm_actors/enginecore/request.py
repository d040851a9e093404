"""A request's state inside the engine core, and the stop rules checked after every token."""

from __future__ import annotations

import enum

from vllm_actors.enginecore.block_hash import BlockHash, extend_block_hashes
from vllm_actors.lora_request import cache_key
from vllm_actors.protocol.engine import EngineCoreRequest, FinishReason, child_request_id


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2   # back in the waiting queue; its KV was freed and will be recomputed
    FINISHED = 3


class Request:
    """Token ids and progress of one request.

    `num_computed_tokens` catches up with `num_tokens` (prompt + outputs); a step computes
    the difference, or part of it. `block_hashes` cover every full block of `all_token_ids`
    and grow as tokens are appended.

    Completion `child_index` of a request with n > 1 (see EngineCoreRequest.n) shares the
    message's params and prompt with its siblings; `sibling`, an already built one, lends
    it the stop sets and the prompt's block hashes instead of building them again.
    """

    def __init__(self, req: EngineCoreRequest, max_model_len: int, block_size: int = 16,
                 child_index: int = 0, sibling: Request | None = None) -> None:
        self.request_id = child_request_id(req.request_id, child_index, req.n)
        self.child_index = child_index
        self.params = req.sampling_params
        self.prompt_token_ids = req.prompt_token_ids
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.eos_token_ids = frozenset(req.eos_token_ids) if sibling is None else \
            sibling.eos_token_ids
        self.stop_token_ids = frozenset(self.params.stop_token_ids) if sibling is None else \
            sibling.stop_token_ids
        self.arrival_time = req.arrival_time
        self.priority = req.priority
        self.max_model_len = max_model_len
        budget = max_model_len - self.num_prompt_tokens
        self.max_tokens = budget if self.params.max_tokens is None else \
            min(self.params.max_tokens, budget)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1   # set at first admission
        self.num_preemptions = 0
        self.num_tokens_sent = 0       # tokens the workers hold (pipeline parallel only)
        self.scheduled_time: float | None = None   # first admission, reported once
        self.num_times_skipped = 0    # lpm admission passed it over for a later request
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.block_size = block_size
        self.lora = req.lora_request
        self.pooling = req.pooling_params   # a pooling request: one step, then its output
        # the adapter seeds the hash chain too: two adapters never share KV blocks
        self.cache_salt = cache_key(req.cache_salt, req.lora_request)
        self.lora_skips = 0   # steps it waited while --max-loras other adapters ran
        self.block_hashes: list[BlockHash] = []
        self.grammar = None   # an llguidance matcher, for structured outputs
        self.grammar_spec = req.grammar   # what it is compiled from (None: from the params)
        self.spec_token_ids: list[int] = []   # drafts to verify next (speculative decoding)
        # decayed (accepted, rejected) drafts and steps without drafts (spec_decode.py)
        self.spec_evidence = (2.0, 1.0)
        self.spec_idle_steps = 0
        self.error: str | None = None   # why the request failed (finish_reason ERROR)
        self.error_param: str | None = None   # the request field at fault, if it was
        if sibling is not None:   # built from the same prompt, before any output
            self.block_hashes = list(sibling.block_hashes)
        else:
            extend_block_hashes(self.block_hashes, self.all_token_ids, block_size,
                                self.cache_salt)

    @classmethod
    def children(cls, req: EngineCoreRequest, max_model_len: int,
                 block_size: int = 16) -> list[Request]:
        """The `req.n` requests a message stands for, in child order."""
        first = cls(req, max_model_len, block_size)
        return [first] + [cls(req, max_model_len, block_size, i, first)
                          for i in range(1, req.n)]

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
        if self.grammar is not None:
            self.grammar.consume_token(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size,
                                self.cache_salt)

    def check_stop(self) -> bool:
        """After an appended token: set finish_reason and return True when the request is done.

        Order as vLLM: length limits first, then nothing before min_tokens, then EOS, then
        stop_token_ids (which also records stop_reason). A structured-output request fails
        on a token its grammar rejects and ends (stop) once its grammar is complete, even
        before min_tokens (a complete grammar allows nothing but EOS).
        """
        if self.grammar is not None and self.grammar.is_error():
            self.finish_reason = FinishReason.ERROR
            # llguidance's first line names the cause; the rest dumps its state and grammar
            cause = (self.grammar.get_error() or "").partition("\n")[0][:200]
            self.error = f"the output left its grammar: {cause}"
            self.error_param = "structured_outputs"
            return True
        if self.num_tokens >= self.max_model_len or self.num_output_tokens >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        if self.grammar is not None and self.grammar.is_stopped():
            self.finish_reason = FinishReason.STOP
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
