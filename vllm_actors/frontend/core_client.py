"""The frontend's side of the engine core: start it, handshake, sockets, liveness.

The core runs as `python -m vllm_actors.enginecore.proc` (a fresh interpreter: no
`if __name__ == "__main__"` guard needed in user scripts, and it may start workers of its
own), or in a thread of this process when multiprocessing is off (debugging, profiling).
The frontend binds every socket, so a killed core leaves no ipc files behind; the config
travels over the handshake socket, and READY (or the startup error) comes back on it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import msgspec
import zmq

from vllm_actors.config import EngineConfig
from vllm_actors.errors import EngineDeadError, error_from_wire
from vllm_actors.frontend.socket_inbox import SocketInbox
from vllm_actors.protocol.engine import (CoreMessage, EngineReady, EngineStartupError,
                                         FrontendMessage, Shutdown)
from vllm_actors.protocol.wire import Decoder, Encoder, IpcAddresses

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 5.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class _Resources:
    """Everything to tear down, apart from the client so that a finalizer can do it when the
    client is garbage-collected or the interpreter exits."""

    def __init__(self, addresses: IpcAddresses) -> None:
        self.addresses = addresses
        self.sync_ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.inboxes: list[SocketInbox] = []
        self.process: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        self.pidfd: int | None = None

    def release(self, wait_s: float) -> None:
        """Wait up to `wait_s` for the core to exit by itself, then make it; close all."""
        if self.process is not None:
            for stop in (None, self.process.terminate, self.process.kill):
                if self.process.poll() is None:
                    if stop is not None:
                        stop()
                    try:
                        self.process.wait(wait_s if stop is None else SHUTDOWN_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        pass
        if self.thread is not None:
            self.thread.join(wait_s)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        for inbox in self.inboxes:
            inbox.close()
        for socket in self.sockets:
            socket.close(linger=0)
        self.sync_ctx.term()
        self.addresses.remove()


def _launch(addresses: IpcAddresses, env_overrides: dict[str, str] | None,
            cpus: frozenset[int] | None) -> subprocess.Popen:
    env = {**os.environ, **(env_overrides or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    # The affinity is set before exec, so BLAS and the kernels' thread pools size themselves
    # to it from the start.
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    return subprocess.Popen([sys.executable, "-m", "vllm_actors.enginecore.proc",
                             addresses.directory, str(os.getpid())], env=env, preexec_fn=pin)


class CoreChannel:
    """Messages to and from a core over the client's two sockets (shared by the local and
    the Ray core clients)."""

    input_socket: zmq.Socket
    output_socket: zmq.Socket
    outputs: SocketInbox
    encoder: Encoder
    decoder: Decoder
    _send_lock: threading.Lock

    def send(self, message: FrontendMessage) -> None:
        """Queue a message for the core; never blocks, callable from any thread."""
        with self._send_lock:
            self.input_socket.send_multipart(self.encoder.encode(message), copy=False)

    async def recv(self) -> Any:
        """The next CoreMessage (call from one task at a time)."""
        return self.decoder.decode(await self.outputs.recv())


class CoreClient(CoreChannel):
    """Starts the engine core and talks to it.

    Args:
        config: the engine configuration (sent to the core).
        use_process: run the core in its own process (True) or in a thread.
        env: variables set in the core process's environment (a data parallel core's share
            of the devices).
        cpus: the CPUs the core process (and its workers) may run on; None: all.
    Raises (from the core's startup):
        the core's own typed error (ValidationError, ModelLoadError, ...), or
        EngineDeadError when the core died without saying why.
    """

    def __init__(self, config: EngineConfig, use_process: bool = True,
                 env: dict[str, str] | None = None, cpus: frozenset[int] | None = None
                 ) -> None:
        self.addresses = IpcAddresses.create()
        self._res = res = _Resources(self.addresses)
        self._finalizer = weakref.finalize(self, res.release, 0.0)
        self._send_lock = threading.Lock()
        self.input_socket = res.sync_ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(self.addresses.inputs)
        self.output_socket = res.sync_ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(self.addresses.outputs)
        self.outputs = SocketInbox(self.output_socket)
        res.sockets += [self.input_socket, self.output_socket]
        res.inboxes.append(self.outputs)
        self.encoder = Encoder()
        self.decoder = Decoder(CoreMessage)
        self.closed = False
        try:
            self.ready = self._start(config, use_process, env, cpus)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, use_process: bool, env: dict[str, str] | None,
               cpus: frozenset[int] | None) -> EngineReady:
        handshake = self._res.sync_ctx.socket(zmq.PAIR)
        handshake.bind(self.addresses.handshake)
        try:
            if use_process:
                self._res.process = _launch(self.addresses, env, cpus)
                if hasattr(os, "pidfd_open"):
                    self._res.pidfd = os.pidfd_open(self._res.process.pid)
                handshake.send(msgspec.msgpack.encode(config))
            else:
                from vllm_actors.enginecore.proc import serve  # the core in this process
                self._res.thread = threading.Thread(target=serve, name="EngineCore",
                                                    args=(self.addresses, None, config),
                                                    daemon=True)
                self._res.thread.start()
            return self._await_ready(handshake)
        finally:
            handshake.close(linger=0)

    def _await_ready(self, handshake: zmq.Socket) -> EngineReady:
        return await_ready(handshake, self.decoder, self.is_alive, self.describe_exit)

    def is_alive(self) -> bool:
        if self._res.process is not None:
            return self._res.process.poll() is None
        return self._res.thread is not None and self._res.thread.is_alive()

    @property
    def exitcode(self) -> int | None:
        return None if self._res.process is None else self._res.process.poll()

    def describe_exit(self) -> str:
        """How the core ended, for error messages ("killed by signal SIGKILL", ...)."""
        return exit_status(self.exitcode)

    @property
    def pid(self) -> int | None:
        return None if self._res.process is None else self._res.process.pid

    @property
    def exit_fd(self) -> int | None:
        """A file descriptor that becomes readable when the core process ends (Linux pidfd),
        or None (thread mode, or no pidfd: then watch `is_alive`)."""
        return self._res.pidfd

    def shutdown(self) -> None:
        """Ask the core to stop, wait for it (terminate it if it hangs), close sockets and
        remove the ipc directory. Safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        if self.is_alive():
            try:   # not blocking: a core that failed at startup never connected
                with self._send_lock:
                    self.input_socket.send(self.encoder.encode(Shutdown())[0], zmq.NOBLOCK)
            except zmq.Again:
                pass
        self._finalizer.detach()
        self._res.release(SHUTDOWN_TIMEOUT_S)


def exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def await_ready(handshake: zmq.Socket, decoder: Decoder, is_alive: Callable[[], bool],
                describe_exit: Callable[[], str]) -> EngineReady:
    """The core's READY from the handshake socket; its startup error raised as itself, or
    EngineDeadError when it ends without one (or takes over STARTUP_TIMEOUT_S)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if handshake.poll(100):
            message = decoder.decode(handshake.recv_multipart())
            if isinstance(message, EngineStartupError):
                raise error_from_wire(message.error_type, message.message, message.param)
            assert isinstance(message, EngineReady)
            return message
        if not is_alive():
            raise EngineDeadError(f"the engine core exited during startup ({describe_exit()})")
    raise EngineDeadError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f}s")
