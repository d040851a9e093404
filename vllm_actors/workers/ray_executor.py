"""RayExecutor (`--distributed-executor-backend ray`): tensor-parallel ranks as Ray actors.

Ray places, starts, watches and stops the processes; each actor hosts one `RankHost`. The
ranks of one engine are packed onto one node by a placement group (STRICT_PACK), so their
collectives keep the shared-memory communicator (NCCL among GPUs); steps and
collective_rpc calls travel as Ray method calls, msgpack-encoded. The core connects to the
cluster in RAY_ADDRESS (`ray start --head` / `ray start --address=...`) or starts a local one.

With `--pipeline-parallel-size P` each stage's ranks share a placement-group bundle (one node,
shared memory among them, the segment made on that node by the stage's rank 0) and the
bundles spread over the nodes; hidden states go stage to stage over tcp
(`workers/stage_channel.py`), and steps are submitted without waiting, so the stages overlap.
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

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
COLLECT_POLL_S = 0.2       # how often a waiting step looks for a failed rank


def import_ray() -> Any:
    """Raises ValidationError naming the extra when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise ValidationError("--distributed-executor-backend ray needs Ray: pip install "
                              "'vllm-actors[ray]'", "distributed_executor_backend") from None
    return ray


class RankActor:
    """The body of one Ray actor: a RankHost of a pipeline stage, over its stage's
    shared-memory communicator (made on the stage's node by its rank 0) and a tcp stage
    channel to the neighbouring stages. Set up in steps (`create_comm`, `bind_stage`,
    `load`) because each needs what the others' earlier steps returned."""

    def __init__(self, config: bytes, rank: int, world_size: int, stage: int,
                 num_stages: int) -> None:
        import zmq

        from vllm_actors.models.base import PipelineStage
        self.config = msgspec.msgpack.decode(config, type=EngineConfig)
        self.rank, self.world_size = rank, world_size
        self.stage = PipelineStage(stage, num_stages)
        self.answers = self.stage.last and rank == 0
        self.comm_buffer: SharedBuffer | None = None
        self.ctx = zmq.Context()
        self.channel = None
        if num_stages > 1:
            from vllm_actors.workers.stage_channel import StageChannel
            self.channel = StageChannel(self.ctx)
        self.host: Any = None
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(StepInput)

    def create_comm(self) -> str:
        """Rank 0 of a stage: the stage's communicator segment, on this node."""
        self.comm_buffer = SharedBuffer.create(communicator_bytes(self.world_size,
                                                                  DEFAULT_SLOT_BYTES))
        return self.comm_buffer.name

    def unlink_comm(self) -> None:
        if self.comm_buffer is not None:    # mapped by every rank of the stage now
            self.comm_buffer.unlink()

    def bind_stage(self) -> str:
        """Every stage but the last: where the next stage's rank connects."""
        import ray
        return self.channel.bind_sender(f"tcp://{ray.util.get_node_ip_address()}")

    def load(self, comm_name: str | None, receive_from: str | None) -> bytes:
        """Load this rank's layers (and shard); its EngineReady."""
        from vllm_actors.workers.parallel_state import ShmCommunicator
        from vllm_actors.workers.rank_host import RankHost
        comm = None
        if comm_name is not None:
            if self.comm_buffer is None:
                self.comm_buffer = SharedBuffer.attach(
                    comm_name, communicator_bytes(self.world_size, DEFAULT_SLOT_BYTES))
            comm = ShmCommunicator(self.comm_buffer, self.rank, self.world_size,
                                   DEFAULT_SLOT_BYTES, lambda: True)   # Ray kills actors
        if receive_from is not None:
            self.channel.connect_receiver(receive_from)
        self.host = RankHost(self.config, self.rank, self.world_size, comm, allocate_kv=False,
                             stage=self.stage, channel=self.channel)
        return self.encoder.encode(self.host.ready)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.host.init_kv_cache(num_blocks)

    def execute_step(self, step: bytes) -> bytes | None:
        output = self.host.execute_step(self.decoder.decode(step))
        return self.encoder.encode(output) if self.answers else None

    def call(self, method: str, args: list[Any]) -> Any:
        result = self.host.call(method, args)
        if method == "describe":
            import ray
            result["ray_node_id"] = ray.get_runtime_context().get_node_id()
        return result

    def ping(self) -> int:
        return os.getpid()


class RayExecutor:
    """Args:
        config: the engine configuration (`config.parallel.tensor_parallel_size` actors).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ray: Any = None
        self.actors: list = []
        self.placement = None
        self.started_cluster = False
        self.closed = False
        self._submitted = collections.deque()

    def start(self) -> EngineReady:
        ray = self.ray = import_ray()
        parallel = self.config.parallel
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     **({} if address else {"num_cpus": max(tp * pp, os.cpu_count() or 1)}))
            self.started_cluster = address is None
        try:
            readies = self._start_actors(ray, tp, pp)
        except BaseException:
            self.shutdown()
            raise
        num_blocks = min(r.num_kv_blocks for r in readies)
        self._get([a.init_kv_cache.remote(num_blocks) for a in self.actors])
        first = readies[0]
        self.ready = msgspec.structs.replace(first, num_kv_blocks=num_blocks)
        logger.info("%d Ray actors ready (%d stage(s) of %d); %d KV blocks per rank",
                    tp * pp, pp, tp, num_blocks)
        return self.ready

    def _start_actors(self, ray: Any, tp: int, pp: int) -> list[EngineReady]:
        """One placement-group bundle per stage holds its tp ranks (one node: shared-memory
        collectives); the bundles spread over the nodes where they can."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        platform = Platform(self.config.device)
        gpus = 1 if platform.name == "cuda" else 0
        self.placement = placement_group([{"CPU": tp, "GPU": tp * gpus}] * pp,
                                         strategy="STRICT_PACK" if pp == 1 else "SPREAD")
        ray.get(self.placement.ready(), timeout=60)
        encoded = msgspec.msgpack.encode(self.config)
        remote = ray.remote(RankActor)
        for rank in range(tp * pp):
            env = platform.rank_env(rank, tp * pp, env={}, cpu_count=os.cpu_count())
            if gpus:   # Ray sets CUDA_VISIBLE_DEVICES for the GPU it assigns
                env.pop("CUDA_VISIBLE_DEVICES", None)
            self.actors.append(remote.options(
                num_cpus=1, num_gpus=gpus, runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=rank // tp),
            ).remote(encoded, rank % tp, tp, rank // tp, pp))
        stages = [self.actors[s * tp:(s + 1) * tp] for s in range(pp)]
        comms = self._get([stage[0].create_comm.remote() for stage in stages]) if tp > 1 \
            else [None] * pp
        senders = self._get([a.bind_stage.remote() for stage in stages[:-1] for a in stage])
        try:
            return [msgspec.msgpack.decode(r, type=EngineReady) for r in self._get([
                a.load.remote(comms[rank // tp],
                              senders[rank - tp] if rank >= tp else None)
                for rank, a in enumerate(self.actors)])]
        finally:
            if tp > 1:
                self._get([stage[0].unlink_comm.remote() for stage in stages])

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
        self.submit(step)
        return self.collect()

    def submit(self, step: StepInput) -> None:
        """Every actor gets the step now (Ray runs each actor's calls in order, so the stages
        work on different steps at once)."""
        encoded = msgspec.msgpack.encode(step)
        self._submitted.append([a.execute_step.remote(encoded) for a in self.actors])

    def collect(self) -> StepOutput:
        """The oldest step's output, from the last stage's first rank. Raises
        WorkerDiedError as soon as any rank's call for it fails (a stage after a dead
        one would wait for its hidden states forever)."""
        refs = self._submitted.popleft()
        answer = refs[len(refs) - self.config.parallel.tensor_parallel_size]
        pending = list(refs)
        while pending:
            done, pending = self.ray.wait(pending, num_returns=len(pending),
                                          timeout=COLLECT_POLL_S)
            self._get(done)        # raises for a failed or dead rank
        return msgspec.msgpack.decode(self._get([answer])[0], type=StepOutput)

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
