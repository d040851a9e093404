"""RankHost: one rank's work, whatever carries its calls.

A rank is its backend on its device, its collective group and its ModelRunner over its shard
(`Platform` chooses the first two). The in-process executor calls a RankHost directly; a worker
process (`workers/worker.py`) feeds one from the shared-memory ring and answers on its socket;
a Ray actor would hold one and be called through Ray. The transport is not the host's concern.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from vllm_actors.config import EngineConfig
from vllm_actors.errors import ValidationError
from vllm_actors.lora_request import LoRARequest
from vllm_actors.models.base import PipelineStage, SingleRank
from vllm_actors.protocol.engine import EngineReady
from vllm_actors.protocol.step import StepInput, StepOutput
from vllm_actors.workers.kv_cache import kv_bytes_per_block
from vllm_actors.workers.model_runner import ModelRunner
from vllm_actors.workers.parallel_state import ShmCommunicator
from vllm_actors.workers.platform import Platform
from vllm_actors.workers.shm import set_oversubscribed

# what `collective_rpc` may call on every rank (vLLM calls any worker method by name; a
# closed list keeps a typo or a private method from running in every worker)
RPC_METHODS = ("describe", "kv_cache_bytes", "add_lora", "remove_lora", "list_loras")


class RankHost:
    """Args:
        config: the engine configuration.
        rank / world_size: this rank among the tensor-parallel ranks (of its stage).
        comm: the ranks' shared-memory communicator (None: a single rank, no group).
        allocate_kv: False leaves the KV cache to `init_kv_cache` (the block count every
            rank agrees on).
        stage / channel: this rank's pipeline stage and its link to the neighbouring
            stages (`workers/stage_channel.py`); None without pipeline parallelism.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 comm: ShmCommunicator | None = None, allocate_kv: bool = True,
                 stage: PipelineStage | None = None, channel: Any = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.stage = stage or PipelineStage()
        self.platform = Platform(config.device)
        global_rank = self.stage.index * world_size + rank
        backend = self.platform.backend(global_rank)
        group = SingleRank()
        if comm is not None:
            group = self.platform.group(comm, backend)
            # CPU ranks (numpy, cpu, OpenCL on PoCL) outnumbering the cores sleep, not spin
            # (pipeline stages too: a stage idles while the others work)
            set_oversubscribed(self.stage.size > 1 or
                               self.platform.shares_cores(backend, world_size))
        self.runner = ModelRunner(config, backend=backend, tp=group, allocate_kv=allocate_kv,
                                  stage=self.stage, channel=channel)

    @property
    def ready(self) -> EngineReady:
        return self.runner.ready

    def execute_step(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    # -- collective_rpc ------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Where this rank runs and what it holds."""
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                "pipeline_stage": self.stage.index,
                "layers": [self.runner.layer_ids[0], self.runner.layer_ids[-1] + 1],
                "device": self.platform.name, "backend": self.runner.backend.name,
                "num_kv_blocks": self.runner.num_blocks}

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV cache (its KV heads; the null block included)."""
        runner = self.runner
        return (runner.num_blocks + 1) * kv_bytes_per_block(
            runner.local_args, runner.block_size, runner.kv_groups, len(runner.kv_slots),
            runner.kv_format.name)

    def add_lora(self, lora: Any) -> bool:
        """Load a LoRA adapter (a LoRARequest, or its fields as a list off the wire).
        Raises LoRAAdapterError, or ValidationError without --enable-lora."""
        return self._loras().add(lora if isinstance(lora, LoRARequest) else LoRARequest(*lora))

    def remove_lora(self, lora_id: int) -> bool:
        return self._loras().remove(int(lora_id))

    def list_loras(self) -> list[int]:
        return self._loras().ids()

    def _loras(self) -> Any:
        if self.runner.lora is None:
            raise ValidationError("this engine serves no LoRA adapters: start it with "
                                  "--enable-lora", "enable_lora")
        return self.runner.lora

    def call(self, method: str, args: Sequence[Any] = ()) -> Any:
        """`collective_rpc`'s entry: one of RPC_METHODS with `args`.

        Raises:
            ValidationError: a method not in RPC_METHODS.
        """
        if method not in RPC_METHODS:
            raise ValidationError(f"collective_rpc: unknown method {method!r}; available: "
                                  f"{', '.join(RPC_METHODS)}", "method")
        return getattr(self, method)(*args)
