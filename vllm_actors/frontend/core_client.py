"""How the frontend reaches the engine core. `InprocClient` runs the core in this process
(vLLM's InprocClient); it is the one place the frontend may import `enginecore`."""

from __future__ import annotations

from vllm_actors.config import EngineConfig
from vllm_actors.protocol.engine import EngineCoreOutputs, EngineCoreRequest, EngineReady


class InprocClient:
    """Every call runs synchronously in the caller's thread; `get_output` runs one step."""

    def __init__(self, config: EngineConfig) -> None:
        from vllm_actors.enginecore.core import EngineCore
        self.core = EngineCore(config)

    @property
    def ready(self) -> EngineReady:
        return self.core.ready

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()
