"""Executors: how the engine core reaches its workers (the only workers/ module it imports).

`Executor` is the seam every way of running ranks implements, and `executor_for(config)`
picks one. "uni" (tensor parallel size 1, the default) is the in-process executor: one
RankHost called directly (vLLM's UniProcExecutor), no copies, no IPC. "mp" starts one worker
process per rank on this machine, broadcasts each call through the shared-memory ring and
reads the answers on each rank's socket. A Ray executor is one more implementation: ranks as
actors holding a RankHost each (`workers/rank_host.py`), addressed over the network.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Protocol, Sequence

import msgspec
import zmq

from vllm_actors.config import EngineConfig
from vllm_actors.errors import ValidationError, WorkerDiedError
from vllm_actors.protocol.engine import EngineReady
from vllm_actors.protocol.step import StepInput, StepOutput
from vllm_actors.protocol.wire import Decoder, IpcAddresses
from vllm_actors.protocol.worker import (CallMethod, ExecuteStep, InitKVCache, RpcDone,
                                         StepDone, WorkerCall, WorkerFailed, WorkerInit,
                                         WorkerReply, WorkerShutdown)
from vllm_actors.workers import launcher
from vllm_actors.workers.parallel_state import DEFAULT_SLOT_BYTES, communicator_bytes
from vllm_actors.workers.shm import SharedBuffer
from vllm_actors.workers.shm_broadcast import RingWriter, SocketChannel, ring_bytes

logger = logging.getLogger(__name__)

POLL_MS = 50               # how often a waiting executor looks at its workers' processes
RING_SLOTS = 4             # StepInputs in flight at most (the core waits for each step's output)
RING_SLOT_BYTES = 1 << 20  # larger StepInputs (many new long prompts) go over the PAIR sockets
SHUTDOWN_WAIT_S = 5.0


class Executor(Protocol):
    """The ranks of one engine core, however they run."""

    ready: EngineReady

    def start(self) -> EngineReady:
        """Start every rank, load the model, size and allocate the KV cache (the smallest
        block count any rank allows). Raises the first failing rank's typed error."""

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step on every rank; the output rank's output (rank 0, or the last
        pipeline stage's first rank). Raises WorkerDiedError."""

    def submit(self, step: StepInput) -> None:
        """Start a step without waiting for it (pipeline parallel keeps several in
        flight); `collect` returns the outputs in submission order."""

    def collect(self) -> StepOutput:
        """The output of the oldest submitted step not collected yet (waits for it)."""

    def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        """`RankHost.call(method, args)` on every rank; the results in rank order.

        Raises:
            ValidationError: an unknown method or arguments it refuses (from any rank).
            WorkerDiedError: a rank died meanwhile.
        """

    def check_health(self) -> None:
        """Raises WorkerDiedError when a rank is gone."""

    def shutdown(self) -> None:
        """Stop every rank; safe to call more than once, and before `start`."""


class InprocExecutor:
    """One RankHost in this process; a submitted step runs when collected (no overlap)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.host: Any = None
        self._submitted = collections.deque()

    def start(self) -> EngineReady:
        from vllm_actors.workers.rank_host import RankHost
        self.host = RankHost(self.config)
        self.ready: EngineReady = self.host.ready
        return self.ready

    def execute(self, step: StepInput) -> StepOutput:
        return self.host.execute_step(step)

    def submit(self, step: StepInput) -> None:
        self._submitted.append(step)

    def collect(self) -> StepOutput:
        return self.execute(self._submitted.popleft())

    def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        return [self.host.call(method, list(args))]

    def check_health(self) -> None:
        """Nothing to watch: the rank is this process."""

    def shutdown(self) -> None:
        pass


class MultiprocExecutor:
    """One worker process per rank (see workers/launcher.py, worker.py): tensor-parallel
    size x pipeline-parallel size of them. Every rank reads every call from one ring; the
    ranks of a pipeline stage share a communicator, and the stages pass hidden states on
    (`workers/stage_channel.py`). Steps may be submitted before earlier ones finished
    (`submit`/`collect`); the last stage's first rank answers each in order.

    Args:
        config: the engine configuration.
        ipc_dir: directory for the workers' sockets (the engine core's own ipc directory,
            which its frontend removes whatever happens); a private one when None.
    """

    def __init__(self, config: EngineConfig, ipc_dir: str | None = None) -> None:
        self.config, self.ipc_dir = config, ipc_dir
        self._own_dir = None
        self.ctx: zmq.Context | None = None
        self.handles: list = []
        self.closed = False
        self.ring_buffer = None
        self.comm_buffers: list[SharedBuffer] = []

    def start(self) -> EngineReady:
        """Raises the first failing worker's typed startup error, or EngineDeadError."""
        config = self.config
        tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
        n = tp * pp
        if self.ipc_dir is None:
            self._own_dir = IpcAddresses.create()
        ipc_dir = self.ipc_dir or self._own_dir.directory
        self.ctx = zmq.Context()
        slots = max(RING_SLOTS, pp + 1)
        self.ring_buffer = SharedBuffer.create(ring_bytes(n, slots, RING_SLOT_BYTES))
        self.comm_buffers = [SharedBuffer.create(communicator_bytes(tp, DEFAULT_SLOT_BYTES))
                             for _ in range(pp)]
        ring = RingWriter(self.ring_buffer, n, [], slots, RING_SLOT_BYTES, self._all_alive)
        inits = [WorkerInit(r, n, launcher.encode_config(config), self.ring_buffer.name,
                            ring.num_slots, ring.slot_bytes, self.comm_buffers[r // tp].name,
                            DEFAULT_SLOT_BYTES, pp) for r in range(n)]
        try:
            self.handles = launcher.launch_workers(self.ctx, ipc_dir, inits, config.device)
            readies = launcher.await_ready(self.handles)
        except BaseException:
            self.shutdown()
            raise
        finally:   # mapped by every worker now (or never needed again): drop the names
            for buffer in (self.ring_buffer, *self.comm_buffers):
                buffer.unlink()
        ring.fallbacks = [SocketChannel(h.socket) for h in self.handles]
        self.ring = ring
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = Decoder(WorkerReply)
        self.poller = zmq.Poller()
        for handle in self.handles:
            self.poller.register(handle.socket, zmq.POLLIN)
        num_blocks = min(r.ready.num_kv_blocks for r in readies)
        self._call(InitKVCache(num_blocks))
        first = readies[0].ready
        self.ready = msgspec.structs.replace(first, num_kv_blocks=num_blocks)
        logger.info("%d workers ready (pids %s); %d KV blocks per rank", n,
                    [h.process.pid for h in self.handles], num_blocks)
        return self.ready

    def _call(self, call: WorkerCall) -> None:
        self.ring.enqueue(self.encoder.encode(call))

    def execute(self, step: StepInput) -> StepOutput:
        """Broadcast the step, then wait for its output while watching every worker.

        Raises:
            WorkerDiedError: a worker exited or reported a failure.
        """
        self.submit(step)
        return self.collect()

    def submit(self, step: StepInput) -> None:
        self._call(ExecuteStep(step))

    def collect(self) -> StepOutput:
        """The oldest submitted step's output (the output rank answers in order).

        Raises:
            WorkerDiedError: a worker exited or reported a failure.
        """
        while True:
            for socket, _ in self.poller.poll(POLL_MS):
                match self.decoder.decode(socket.recv_multipart(copy=False)):
                    case StepDone(output=output):
                        return output
                    case WorkerFailed(rank=rank, reason=reason):
                        raise WorkerDiedError(f"worker rank {rank} failed: {reason}")
            self.check_health()

    def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        self._call(CallMethod(method, list(args)))
        results: dict[int, RpcDone] = {}
        while len(results) < len(self.handles):
            for socket, _ in self.poller.poll(POLL_MS):
                match self.decoder.decode(socket.recv_multipart(copy=False)):
                    case RpcDone() as done:
                        results[done.rank] = done
                    case WorkerFailed(rank=rank, reason=reason):
                        raise WorkerDiedError(f"worker rank {rank} failed: {reason}")
            self.check_health()
        errors = [r.error for r in results.values() if r.error is not None]
        if errors:
            raise ValidationError(errors[0], "method")
        return [results[rank].result for rank in range(len(self.handles))]

    def _all_alive(self) -> bool:
        return all(h.process.poll() is None for h in self.handles)

    def check_health(self) -> None:
        """Raises WorkerDiedError when a worker process has exited."""
        for handle in self.handles:
            code = handle.process.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                raise WorkerDiedError(f"worker rank {handle.rank} (pid {handle.process.pid}) "
                                      f"exited unexpectedly ({how})")

    def shutdown(self) -> None:
        """Ask the workers to exit (if all are alive), then make sure they have; safe to call
        more than once."""
        if self.closed:
            return
        self.closed = True
        wait_s = 0.0
        if self.handles and self._all_alive() and hasattr(self, "ring"):
            try:
                self._call(WorkerShutdown())
                wait_s = SHUTDOWN_WAIT_S
            except Exception:   # a worker died meanwhile: stop them all below
                logger.warning("could not ask the workers to shut down", exc_info=True)
        launcher.stop_workers(self.handles, wait_s)
        for buffer in (self.ring_buffer, *self.comm_buffers):
            if buffer is not None:
                buffer.unlink()
        if self.ctx is not None:
            self.ctx.term()
        if self._own_dir is not None:
            self._own_dir.remove()


def executor_for(config: EngineConfig, ipc_dir: str | None = None) -> Executor:
    """The executor `config.parallel` asks for ("uni", "mp" or "ray"), not started yet.

    Args:
        ipc_dir: where worker processes' sockets go (see MultiprocExecutor).
    """
    if config.parallel.executor_backend == "mp":
        return MultiprocExecutor(config, ipc_dir)
    if config.parallel.executor_backend == "ray":
        from vllm_actors.workers.ray_executor import RayExecutor
        return RayExecutor(config)
    return InprocExecutor(config)
