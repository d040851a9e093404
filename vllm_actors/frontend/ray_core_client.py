"""RayCoreClient: an engine core placed on a Ray cluster (`--data-parallel-backend ray`).

The same interface as `CoreClient` (ready, send, recv, is_alive, describe_exit, shutdown),
with the core as an `EngineCoreActor` that Ray places on a node (spread over the nodes)
instead of a local process. The frontend binds tcp sockets on its node's address (or
`--data-parallel-address`) and passes them to the actor, which connects back; requests and
outputs then flow exactly as over ipc. Liveness: the tcp connection from the core dropping
(a killed process's sockets close at once: noticed within the frontend's 0.5 s liveness
poll), or the actor's `run` call ending (it returns only when the core stops, and fails when
Ray declares the actor or its node dead, which takes Ray's own health checks when a machine
vanishes without closing its connections).
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import zmq

from vllm_actors.config import EngineConfig
from vllm_actors.enginecore.ray_actor import EngineCoreActor
from vllm_actors.errors import EngineDeadError
from vllm_actors.frontend.core_client import CoreChannel, await_ready
from vllm_actors.frontend.socket_inbox import SocketInbox
from vllm_actors.protocol.engine import CoreMessage, Shutdown
from vllm_actors.protocol.wire import Decoder, Encoder, TcpAddresses

SHUTDOWN_TIMEOUT_S = 5.0


class RayCoreClient(CoreChannel):
    """Args:
        config: the engine configuration.
        ray: the imported, initialized `ray` module.
        host: the address to bind on (reachable from every node); default: this node's.
        port: the first port to try (`--data-parallel-rpc-port`); default: any free one.
    Raises: the core's typed startup error, or EngineDeadError.
    """

    def __init__(self, config: EngineConfig, ray: Any, host: str | None = None,
                 port: int | None = None) -> None:
        self.ray = ray
        host = host or ray.util.get_node_ip_address()
        self.sync_ctx = zmq.Context()
        self.input_socket = self.sync_ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket = self.sync_ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.outputs = SocketInbox(self.output_socket)
        handshake = self.sync_ctx.socket(zmq.PAIR)
        urls = [_bind(s, host, port) for s in (self.input_socket, self.output_socket,
                                               handshake)]
        self.addresses = TcpAddresses(*urls)
        self.monitor = self.input_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.disconnected = False
        self._send_lock = threading.Lock()
        self.encoder, self.decoder = Encoder(), Decoder(CoreMessage)
        self.closed = False
        self.actor = ray.remote(EngineCoreActor).options(
            num_cpus=1, max_concurrency=2, scheduling_strategy="SPREAD").remote()
        self.run_ref = self.actor.run.remote(self.addresses, msgspec.msgpack.encode(config))
        try:
            self.ready = await_ready(handshake, self.decoder, self.is_alive,
                                     self.describe_exit)
        except BaseException:
            self.shutdown()
            raise
        finally:
            handshake.close(linger=0)

    def is_alive(self) -> bool:
        if not self.disconnected and self.monitor.poll(0):
            self.monitor.recv_multipart()
            self.disconnected = True
        if self.disconnected:
            return False
        done, _ = self.ray.wait([self.run_ref], timeout=0)
        return not done

    def describe_exit(self) -> str:
        if self.is_alive():
            return "still running"
        try:
            self.ray.get(self.run_ref, timeout=0)
        except self.ray.exceptions.GetTimeoutError:
            return "its connection dropped: the actor's process or node is gone"
        except Exception as e:   # the actor or its node died
            return f"its Ray actor is gone: {type(e).__name__}: {str(e).splitlines()[0]}"
        return "it stopped"

    exitcode = None    # no local process: `describe_exit` says what happened
    pid = None
    exit_fd = None

    def where(self) -> dict[str, object]:
        """The actor's pid and Ray node id."""
        return self.ray.get(self.actor.where.remote(), timeout=10)

    def shutdown(self) -> None:
        """Ask the core to stop, wait for its actor (kill it if it hangs), close the
        sockets. Safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        if self.is_alive():
            try:
                with self._send_lock:
                    self.input_socket.send(self.encoder.encode(Shutdown())[0], zmq.NOBLOCK)
            except zmq.Again:
                pass
            self.ray.wait([self.run_ref], timeout=SHUTDOWN_TIMEOUT_S)
        self.input_socket.disable_monitor()
        self.monitor.close(linger=0)
        try:
            self.ray.kill(self.actor)
        except Exception:   # already gone with its node
            pass
        self.outputs.close()
        for socket in (self.input_socket, self.output_socket):
            socket.close(linger=0)
        self.sync_ctx.term()


def _bind(socket: zmq.Socket, host: str, port: int | None) -> str:
    if port is None:
        return f"tcp://{host}:{socket.bind_to_random_port(f'tcp://{host}')}"
    for candidate in range(port, port + 100):
        try:
            socket.bind(f"tcp://{host}:{candidate}")
            return f"tcp://{host}:{candidate}"
        except zmq.ZMQError:
            continue
    raise EngineDeadError(f"no free port in {port}..{port + 99} on {host}")
