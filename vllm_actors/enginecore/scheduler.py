"""Scheduler: decides each step's work and turns worker results into request outputs.

This first version runs one request at a time, first come first served: the whole prompt in
one step, then one token per step, with KV blocks from a free list. Continuous batching,
chunked prefill and prefix caching replace it in the batching issue; the interface
(`add_request`, `finish_requests`, `schedule`, `update_from_output`) stays.
"""

from __future__ import annotations

from collections import deque

from vllm_actors.enginecore.request import Request, RequestStatus
from vllm_actors.protocol.engine import EngineCoreOutput, FinishReason
from vllm_actors.protocol.step import CachedRequestData, NewRequestData, StepInput, StepOutput


class Scheduler:
    """Args:
        num_kv_blocks: usable KV blocks (ids 1..num_kv_blocks; block 0 is the null block).
        block_size: tokens per block.
        max_model_len: longest prompt + output of any request.
    """

    def __init__(self, num_kv_blocks: int, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.free_block_ids: deque[int] = deque(range(1, num_kv_blocks + 1))
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: Request | None = None
        self.block_ids: dict[str, list[int]] = {}
        self.finished_req_ids: list[str] = []
        self._sent_to_worker: set[str] = set()

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_requests(self) -> bool:
        return bool(self.waiting) or self.running is not None

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> None:
        """Finish (e.g. abort) requests; unknown or already finished ids are ignored."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request is self.running:
                self.running = None
            elif request in self.waiting:
                self.waiting.remove(request)
            request.finish_reason = reason
            self._free(request)

    def _free(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.free_block_ids.extend(reversed(self.block_ids.pop(request.request_id, [])))
        del self.requests[request.request_id]
        if request.request_id in self._sent_to_worker:
            self._sent_to_worker.discard(request.request_id)
            self.finished_req_ids.append(request.request_id)

    def _blocks_needed(self, request: Request, num_tokens: int) -> int:
        have = len(self.block_ids.get(request.request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def _allocate(self, request: Request, num_tokens: int) -> list[int]:
        need = self._blocks_needed(request, num_tokens)
        if need > len(self.free_block_ids):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self.free_block_ids)} free")
        new = [self.free_block_ids.popleft() for _ in range(need)]
        self.block_ids.setdefault(request.request_id, []).extend(new)
        return new

    def schedule(self) -> StepInput:
        step = StepInput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = []
        if self.running is None and self.waiting:
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running = request
            self._allocate(request, request.num_tokens)
            step.new_requests.append(NewRequestData(
                request.request_id, list(request.all_token_ids), request.params,
                list(self.block_ids[request.request_id]), request.num_computed_tokens))
            self._sent_to_worker.add(request.request_id)
        elif self.running is not None:
            request = self.running
            new_blocks = self._allocate(request, request.num_tokens)
            step.cached_requests = CachedRequestData([request.request_id], [new_blocks],
                                                     [request.num_computed_tokens])
        else:
            return step
        step.num_scheduled_tokens[request.request_id] = \
            request.num_tokens - request.num_computed_tokens
        return step

    def update_from_output(self, step: StepInput, output: StepOutput) -> list[EngineCoreOutput]:
        """Advance computed counts, append sampled tokens, apply stop rules."""
        outputs = []
        for req_id, token_ids in zip(output.req_ids, output.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens += step.num_scheduled_tokens[req_id]
            for token_id in token_ids:
                request.append_output_token(token_id)
                if request.check_stop():
                    break
            finished = request.finish_reason is not None
            outputs.append(EngineCoreOutput(req_id, list(token_ids), request.finish_reason,
                                            request.stop_reason, request.num_cached_tokens))
            if finished:
                self.running = None
                self._free(request)
        return outputs
