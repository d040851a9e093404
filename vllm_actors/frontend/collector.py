"""RequestOutputCollector: one request's outputs between the output handler and its consumer.

It holds at most one pending output and merges newer ones into it (deltas concatenate,
cumulative outputs replace, per completion index), so a slow consumer costs no memory and
gets everything on its next read. An exception put in is raised by the next `get`.
"""

from __future__ import annotations

import asyncio
import copy

from vllm_actors.outputs import RequestOutput
from vllm_actors.sampling_params import RequestOutputKind


def _merge(pending: RequestOutput, new: RequestOutput, kind: RequestOutputKind) -> None:
    by_index = {c.index: c for c in pending.outputs}
    for completion in new.outputs:
        old = by_index.get(completion.index)
        if old is None:
            pending.outputs.append(completion)
        elif kind == RequestOutputKind.DELTA:
            old.text += completion.text
            old.token_ids.extend(completion.token_ids)
            if old.logprobs is not None and completion.logprobs is not None:
                old.logprobs.extend(completion.logprobs)
            old.cumulative_logprob = completion.cumulative_logprob
            old.finish_reason, old.stop_reason = completion.finish_reason, completion.stop_reason
        else:
            pending.outputs[pending.outputs.index(old)] = completion
    pending.outputs.sort(key=lambda c: c.index)
    if pending.prompt_logprobs is None:
        pending.prompt_logprobs = new.prompt_logprobs   # deltas carry them once
    pending.finished = new.finished
    pending.num_cached_tokens = new.num_cached_tokens
    pending.error = new.error or pending.error
    pending.error_param = new.error_param or pending.error_param


class RequestOutputCollector:
    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self.pending: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self.pending, RequestOutput) and isinstance(item, RequestOutput):
            _merge(self.pending, item, self.kind)
        elif not isinstance(self.pending, BaseException):
            self.pending = item
        self.ready.set()

    def get_nowait(self) -> RequestOutput | None:
        item, self.pending = self.pending, None
        self.ready.clear()
        if isinstance(item, BaseException):
            # each consumer raises its own copy: one instance shared by every request the
            # engine's death failed grew a traceback with each raise
            raise copy.copy(item).with_traceback(None)
        return item

    async def get(self) -> RequestOutput:
        while self.pending is None:
            await self.ready.wait()
        item = self.get_nowait()
        assert item is not None
        return item

