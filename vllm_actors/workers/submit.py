"""Step submission for executors that run a step when asked (the in-process one)."""

from __future__ import annotations

import collections

from vllm_actors.protocol.step import StepInput, StepOutput


class SequentialSubmit:
    """`submit`/`collect` for executors that run a step when asked: the step runs at
    `collect` (no overlap; the pipelining executors are MultiprocExecutor and RayExecutor)."""

    _submitted: collections.deque

    def execute(self, step: StepInput) -> StepOutput:
        raise NotImplementedError

    def submit(self, step: StepInput) -> None:
        self._submitted.append(step)

    def collect(self) -> StepOutput:
        return self.execute(self._submitted.popleft())
