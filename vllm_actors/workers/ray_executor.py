"""RayExecutor (`--distributed-executor-backend ray`): tensor-parallel ranks as Ray actors.

Ray places, starts, watches and stops the processes; each actor hosts one `RankHost`. The
ranks of one engine are packed onto one node by a placement group (STRICT_PACK), so their
collectives keep the shared-memory communicator (NCCL among GPUs); steps and
collective_rpc calls travel as Ray method calls, msgpack-encoded. The core connects to the
cluster in RAY_ADDRESS (`ray start --head` / `ray start --address=...`) or starts a local one.

Not here yet (issue 18): pipeline stages across nodes and data-parallel engine cores placed
on the cluster.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any, Sequence

import msgspec

from vllm_actors.config import EngineConfig
from vllm_actors.errors import ValidationError, WorkerDiedError
from vllm_actors.protocol.engine import EngineReady
from vllm_actors.protocol.step import StepInput, StepOutput
from vllm_actors.workers.parallel_state import DEFAULT_SLOT_BYTES, communicator_bytes
from vllm_actors.workers.platform import Platform
from vllm_actors.workers.shm import SharedBuffer
from vllm_actors.workers.submit import SequentialSubmit

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0


def import_ray() -> Any:
    """Raises ValidationError naming the extra when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise ValidationError("--distributed-executor-backend ray needs Ray: pip install "
                              "'vllm-actors[ray]'", "distributed_executor_backend") from None
    return ray


class RankActor:
    """The body of one Ray actor: a RankHost over the shared-memory communicator."""

    def __init__(self, config: bytes, rank: int, world_size: int, comm_name: str,
                 comm_slot_bytes: int) -> None:
        from vllm_actors.workers.parallel_state import ShmCommunicator
        from vllm_actors.workers.rank_host import RankHost
        self.rank = rank
        self.comm_buffer = SharedBuffer.attach(comm_name,
                                               communicator_bytes(world_size, comm_slot_bytes))
        comm = ShmCommunicator(self.comm_buffer, rank, world_size, comm_slot_bytes,
                               lambda: True)   # Ray kills its actors with their owner
        self.host = RankHost(msgspec.msgpack.decode(config, type=EngineConfig), rank,
                             world_size, comm, allocate_kv=False)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(StepInput)

    def ready(self) -> bytes:
        return self.encoder.encode(self.host.ready)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.host.init_kv_cache(num_blocks)

    def execute_step(self, step: bytes) -> bytes | None:
        output = self.host.execute_step(self.decoder.decode(step))
        return self.encoder.encode(output) if self.rank == 0 else None

    def call(self, method: str, args: list[Any]) -> Any:
        return self.host.call(method, args)

    def ping(self) -> int:
        return os.getpid()


class RayExecutor(SequentialSubmit):
    """Args:
        config: the engine configuration (`config.parallel.tensor_parallel_size` actors).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ray: Any = None
        self.actors: list = []
        self.placement = None
        self.comm_buffer: SharedBuffer | None = None
        self.started_cluster = False
        self.closed = False
        self._submitted = collections.deque()

    def start(self) -> EngineReady:
        ray = self.ray = import_ray()
        config, n = self.config, self.config.parallel.tensor_parallel_size
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     **({} if address else {"num_cpus": max(n, os.cpu_count() or 1)}))
            self.started_cluster = address is None
        platform = Platform(config.device)
        gpus = 1 if platform.name == "cuda" else 0
        try:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            self.placement = placement_group([{"CPU": 1, "GPU": gpus}] * n,
                                             strategy="STRICT_PACK")
            ray.get(self.placement.ready(), timeout=60)
            self.comm_buffer = SharedBuffer.create(communicator_bytes(n, DEFAULT_SLOT_BYTES))
            encoded = msgspec.msgpack.encode(config)
            remote = ray.remote(RankActor)
            for rank in range(n):
                env = platform.rank_env(rank, n, env={}, cpu_count=os.cpu_count())
                if gpus:   # Ray sets CUDA_VISIBLE_DEVICES for the GPU it assigns
                    env.pop("CUDA_VISIBLE_DEVICES", None)
                self.actors.append(remote.options(
                    num_cpus=1, num_gpus=gpus, runtime_env={"env_vars": env},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement, placement_group_bundle_index=rank),
                ).remote(encoded, rank, n, self.comm_buffer.name, DEFAULT_SLOT_BYTES))
            readies = [msgspec.msgpack.decode(r, type=EngineReady)
                       for r in self._get([a.ready.remote() for a in self.actors])]
        except BaseException:
            self.shutdown()
            raise
        finally:
            if self.comm_buffer is not None:   # mapped by every actor now (or never needed)
                self.comm_buffer.unlink()
        num_blocks = min(r.num_kv_blocks for r in readies)
        self._get([a.init_kv_cache.remote(num_blocks) for a in self.actors])
        first = readies[0]
        self.ready = EngineReady(num_blocks, first.block_size, first.max_model_len,
                                 first.vocab_size, first.kv_group_windows)
        logger.info("%d Ray actors ready; %d KV blocks per rank", n, num_blocks)
        return self.ready

    def _get(self, refs: list, timeout: float | None = None) -> list:
        """ray.get, with a dead actor as WorkerDiedError and an actor's own typed error
        (a ValidationError at load, say) as itself."""
        try:
            return self.ray.get(refs, timeout=timeout)
        except self.ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, ValidationError) or not isinstance(cause, Exception):
                raise cause from None
            raise WorkerDiedError(f"a Ray worker failed: {e}") from None
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as e:
            raise WorkerDiedError(f"a Ray worker is gone: {type(e).__name__}: {e}") from None

    def execute(self, step: StepInput) -> StepOutput:
        encoded = msgspec.msgpack.encode(step)
        outputs = self._get([a.execute_step.remote(encoded) for a in self.actors])
        return msgspec.msgpack.decode(outputs[0], type=StepOutput)

    def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        return self._get([a.call.remote(method, list(args)) for a in self.actors])

    def check_health(self) -> None:
        self._get([a.ping.remote() for a in self.actors], timeout=HEALTH_TIMEOUT_S)

    def shutdown(self) -> None:
        if self.closed or self.ray is None:
            return
        self.closed = True
        for actor in self.actors:
            self.ray.kill(actor)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.placement)
        if self.started_cluster:
            self.ray.shutdown()
