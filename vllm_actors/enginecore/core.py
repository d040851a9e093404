"""EngineCore: owns the scheduler and the executor; `step()` = schedule -> execute -> update."""

from __future__ import annotations

import logging
import time

from vllm_actors.config import EngineConfig
from vllm_actors.enginecore.kv_cache_manager import KVCacheManager
from vllm_actors.enginecore.request import Request
from vllm_actors.enginecore.scheduler import Scheduler
from vllm_actors.protocol.engine import (EngineCoreOutputs, EngineCoreRequest, EngineReady,
                                         FinishReason)
from vllm_actors.protocol.step import StepOutput
from vllm_actors.workers.executor import InprocExecutor

logger = logging.getLogger(__name__)


class EngineCore:
    """The scheduling loop's body. Construction loads the model (through the executor) and
    sizes the KV cache; `ready` holds what was found."""

    def __init__(self, config: EngineConfig) -> None:
        self.executor = InprocExecutor(config)
        self.ready: EngineReady = self.executor.ready
        self.block_size = self.ready.block_size
        kv = KVCacheManager(self.ready.num_kv_blocks, self.block_size,
                            config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, kv, self.ready.max_model_len)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(req, self.ready.max_model_len, self.block_size))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while requests hold KV blocks."""
        return self.scheduler.kv.reset_prefix_cache()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(timestamp=time.time())
        step_input = self.scheduler.schedule()
        has_work = step_input.num_scheduled_tokens or step_input.finished_req_ids
        step_output = self.executor.execute(step_input) if has_work else StepOutput()
        outputs = self.scheduler.update_from_output(step_input, step_output)
        return EngineCoreOutputs(outputs, time.time(), self.scheduler.make_stats())
