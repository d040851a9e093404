"""EngineCore: owns the scheduler and the executor; `step()` = schedule -> execute -> update."""

from __future__ import annotations

import time

from vllm_actors.config import EngineConfig
from vllm_actors.enginecore.request import Request
from vllm_actors.enginecore.scheduler import Scheduler
from vllm_actors.protocol.engine import (EngineCoreOutputs, EngineCoreRequest, EngineReady,
                                         FinishReason)
from vllm_actors.protocol.step import StepOutput
from vllm_actors.workers.executor import InprocExecutor


class EngineCore:
    """The scheduling loop's body. Construction loads the model (through the executor) and
    sizes the KV cache; `ready` holds what was found."""

    def __init__(self, config: EngineConfig) -> None:
        self.executor = InprocExecutor(config)
        self.ready: EngineReady = self.executor.ready
        self.scheduler = Scheduler(self.ready.num_kv_blocks, self.ready.block_size,
                                   self.ready.max_model_len)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(req, self.ready.max_model_len))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(timestamp=time.time())
        step_input = self.scheduler.schedule()
        step_output = (self.executor.execute(step_input) if step_input.num_scheduled_tokens
                       else StepOutput())
        outputs = self.scheduler.update_from_output(step_input, step_output)
        return EngineCoreOutputs(outputs, time.time())
