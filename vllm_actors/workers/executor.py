"""Executors: how the engine core reaches its workers. The in-process executor calls one
ModelRunner directly (vLLM's UniProcExecutor); the multi-process one arrives with the actors
issue."""

from __future__ import annotations

from vllm_actors.config import EngineConfig
from vllm_actors.protocol.engine import EngineReady
from vllm_actors.protocol.step import StepInput, StepOutput


class InprocExecutor:
    """Loads the model in this process. `ready` reports KV blocks and limits."""

    def __init__(self, config: EngineConfig) -> None:
        from vllm_actors.workers.model_runner import ModelRunner
        self.runner = ModelRunner(config)
        self.ready: EngineReady = self.runner.ready

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)
