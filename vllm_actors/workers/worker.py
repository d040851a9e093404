"""A worker process: one tensor-parallel rank on one device, reached over shared memory.

    python -m vllm_actors.workers.worker IPC_DIR RANK PARENT_PID

Startup: connect the PAIR socket `IPC_DIR/w<RANK>`, receive WorkerInit, attach the ring and
the communicator, build this rank's RankHost (backend, group, model shard), answer
WorkerReady (or the startup error). Then loop: read the next WorkerCall from the ring; on
ExecuteStep run the step (rank 0 sends the StepOutput back); InitKVCache allocates;
CallMethod answers RpcDone from every rank; WorkerShutdown exits. Any exception is sent as
WorkerFailed before exiting. The worker dies with its parent (PR_SET_PDEATHSIG, and the
parent is checked while waiting in shared memory).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback

import msgspec
import zmq

from vllm_actors.config import EngineConfig
from vllm_actors.errors import VllmActorsError
from vllm_actors.models.base import PipelineStage
from vllm_actors.process_exit import exit_process
from vllm_actors.protocol.engine import EngineStartupError
from vllm_actors.protocol.worker import (CallMethod, ExecuteStep, InitKVCache, RpcDone,
                                         StepDone, WorkerCall, WorkerFailed, WorkerInit,
                                         WorkerReady, WorkerShutdown)
from vllm_actors.protocol.wire import Decoder, Encoder
from vllm_actors.workers.launcher import worker_address
from vllm_actors.workers.parallel_state import ShmCommunicator, communicator_bytes
from vllm_actors.workers.rank_host import RankHost
from vllm_actors.workers.shm import SharedBuffer, parent_alive
from vllm_actors.workers.shm_broadcast import RingReader, SocketChannel, ring_bytes
from vllm_actors.workers.stage_channel import StageChannel

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


class Worker:
    """One rank's transport: the ring it reads calls from, the socket it answers on, and the
    communicator it shares with the other ranks; the work is its RankHost's."""

    def __init__(self, init: WorkerInit, socket: zmq.Socket, parent_pid: int | None,
                 ctx: zmq.Context | None = None, ipc_dir: str = "") -> None:
        self.rank, self.socket = init.rank, socket
        alive = parent_alive(parent_pid)
        config = msgspec.msgpack.decode(init.config, type=EngineConfig)
        n = init.world_size
        tp = n // init.pipeline_parallel_size
        stage = PipelineStage(init.rank // tp, init.pipeline_parallel_size)
        tp_rank = init.rank % tp
        self.ring_buffer = SharedBuffer.attach(
            init.ring_name, ring_bytes(n, init.ring_slots, init.ring_slot_bytes))
        self.ring = RingReader(self.ring_buffer, n, init.rank, SocketChannel(socket),
                               init.ring_slots, init.ring_slot_bytes, alive)
        self.comm_buffer = SharedBuffer.attach(init.comm_name,
                                               communicator_bytes(tp, init.comm_slot_bytes))
        comm = ShmCommunicator(self.comm_buffer, tp_rank, tp, init.comm_slot_bytes, alive)
        self.channel = None
        if stage.size > 1:
            assert ctx is not None
            self.channel = StageChannel.on_this_machine(ctx, ipc_dir, stage, tp_rank, alive)
        # the rank that answers each step: the last stage's first
        self.answers = stage.last and tp_rank == 0
        self.host = RankHost(config, tp_rank, tp, comm, allocate_kv=False, stage=stage,
                             channel=self.channel)

    def run(self) -> None:
        """Serve WorkerCalls until WorkerShutdown."""
        decoder = msgspec.msgpack.Decoder(WorkerCall)
        encoder = Encoder()
        while True:
            match decoder.decode(self.ring.dequeue()):
                case ExecuteStep(step=step):
                    output = self.host.execute_step(step)
                    if self.answers:
                        self.socket.send_multipart(encoder.encode(StepDone(output)), copy=False)
                case InitKVCache(num_blocks=num_blocks):
                    self.host.init_kv_cache(num_blocks)
                case CallMethod(method=method, args=args):
                    try:
                        reply = RpcDone(self.rank, self.host.call(method, args))
                    except Exception as e:   # the caller's error, not the worker's
                        reply = RpcDone(self.rank, error=f"{type(e).__name__}: {e}")
                    self.socket.send_multipart(encoder.encode(reply))
                case WorkerShutdown():
                    return


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:   # not Linux: the shared-memory waits still check the parent
        pass


def serve(ipc_dir: str, rank: int, parent_pid: int) -> int:
    """Worker entry. Returns the exit code."""
    ctx = zmq.Context()
    socket = ctx.socket(zmq.PAIR)
    socket.connect(worker_address(ipc_dir, rank))
    encoder = Encoder()
    try:
        init = Decoder(WorkerInit).decode([socket.recv()])
        try:
            worker = Worker(init, socket, parent_pid, ctx, ipc_dir)
        except Exception as e:
            if not isinstance(e, VllmActorsError):
                logger.error("worker %d startup failed:\n%s", rank, traceback.format_exc())
            socket.send_multipart(encoder.encode(EngineStartupError(
                type(e).__name__, str(e), getattr(e, "param", None))))
            return 1
        socket.send_multipart(encoder.encode(WorkerReady(rank, worker.host.ready)))
        try:
            worker.run()
        except Exception as e:
            logger.exception("worker %d failed", rank)
            try:   # never block on a core that is gone
                socket.send_multipart(encoder.encode(WorkerFailed(
                    rank, f"{type(e).__name__}: {e}")), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            return 1
        return 0
    finally:
        socket.close(linger=1000)
        ctx.destroy(linger=0)    # and the pipeline stage sockets, whatever state they are in


def main() -> None:
    ipc_dir, rank, parent_pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    _die_with_parent()
    if os.getppid() != parent_pid:     # the parent died before PDEATHSIG was armed
        sys.exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the frontend decides on Ctrl-C
    logging.basicConfig(level=logging.INFO,
                        format=f"(Worker rank {rank}) %(levelname)s %(message)s")
    exit_process(serve(ipc_dir, rank, parent_pid))


if __name__ == "__main__":
    main()
