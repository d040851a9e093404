"""Start worker processes, one per tensor-parallel rank, and wait for them to be ready.

Each worker is `python -m vllm_actors.workers.worker` (a fresh interpreter, like the engine
core: no `__main__` guard needed, nothing inherited by fork) with an environment of its own
(`Platform.rank_env`: its device's visibility and its share of the CPU cores for BLAS
threads), set before numpy is imported.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from vllm_actors.config import DeviceConfig, EngineConfig
from vllm_actors.errors import EngineDeadError, error_from_wire
from vllm_actors.protocol.engine import EngineStartupError
from vllm_actors.protocol.worker import WorkerInit, WorkerReady, WorkerStartupReply
from vllm_actors.protocol.wire import Decoder, Encoder
from vllm_actors.workers.platform import Platform

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def worker_address(ipc_dir: str, rank: int) -> str:
    """The PAIR socket between the engine core (binds) and worker `rank` (connects)."""
    return f"ipc://{ipc_dir}/w{rank}"


@dataclass
class WorkerHandle:
    rank: int
    process: subprocess.Popen
    socket: zmq.Socket


def worker_env(rank: int, world_size: int, device: DeviceConfig, cpu_count: int | None = None
               ) -> dict[str, str]:
    """The environment of worker `rank` (`Platform.rank_env`), with this package importable."""
    env = Platform(device).rank_env(rank, world_size, cpu_count=cpu_count)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def launch_workers(ctx: zmq.Context, ipc_dir: str, inits: list[WorkerInit],
                   device: DeviceConfig) -> list[WorkerHandle]:
    """Start one process per WorkerInit and send it; the caller awaits readiness."""
    encoder, handles = Encoder(), []
    envs = [worker_env(init.rank, init.world_size, device) for init in inits]
    for init, env in zip(inits, envs):
        socket = ctx.socket(zmq.PAIR)
        socket.bind(worker_address(ipc_dir, init.rank))
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm_actors.workers.worker", ipc_dir, str(init.rank),
             str(os.getpid())], env=env)
        handles.append(WorkerHandle(init.rank, process, socket))
        socket.send_multipart(encoder.encode(init))
    return handles


def await_ready(handles: list[WorkerHandle], timeout_s: float = STARTUP_TIMEOUT_S
                ) -> list[WorkerReady]:
    """Every worker's WorkerReady, in rank order.

    Raises:
        the first failing worker's own typed error (ValidationError, ModelLoadError, ...),
        EngineDeadError when a worker exited without saying why or none answered in time.
    """
    decoder = Decoder(WorkerStartupReply)
    poller = zmq.Poller()
    for handle in handles:
        poller.register(handle.socket, zmq.POLLIN)
    by_socket = {h.socket: h for h in handles}
    ready: dict[int, WorkerReady] = {}
    deadline = time.monotonic() + timeout_s
    while len(ready) < len(handles):
        if time.monotonic() > deadline:
            raise EngineDeadError(f"worker processes did not start within {timeout_s:.0f}s")
        for socket, _ in poller.poll(100):
            message = decoder.decode(socket.recv_multipart())
            if isinstance(message, EngineStartupError):
                raise error_from_wire(message.error_type, message.message, message.param)
            ready[by_socket[socket].rank] = message
        for handle in handles:
            if handle.rank not in ready and handle.process.poll() is not None:
                raise EngineDeadError(f"worker rank {handle.rank} exited during startup "
                                      f"(exit code {handle.process.returncode})")
    return [ready[r] for r in range(len(handles))]


def stop_workers(handles: list[WorkerHandle], wait_s: float) -> None:
    """Wait up to `wait_s` for the workers to exit, then terminate, then kill; close sockets."""
    deadline = time.monotonic() + wait_s
    for stop in (None, "terminate", "kill"):
        for handle in handles:
            if stop is not None and handle.process.poll() is None:
                getattr(handle.process, stop)()
        for handle in handles:
            try:
                handle.process.wait(max(0.0, deadline - time.monotonic()) if stop is None
                                    else 2.0)
            except subprocess.TimeoutExpired:
                pass
        if all(h.process.poll() is not None for h in handles):
            break
    for handle in handles:
        handle.socket.close(linger=0)


def encode_config(config: EngineConfig) -> bytes:
    return msgspec.msgpack.encode(config)
