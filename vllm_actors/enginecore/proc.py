"""The engine core process: handshake, two socket threads, and the busy loop.

    input thread:  PULL socket -> decode -> input queue   (and a watch on the parent process)
    main thread:   drain input queue -> EngineCore.step() -> output queue; blocks when idle
    output thread: output queue -> encode -> PUSH socket

The busy loop never touches a socket. A bad request finishes alone with finish_reason
"error"; any other exception is fatal: EngineDead is sent, then the process exits. If the
frontend process disappears, the core exits by itself and removes the ipc directory.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import traceback

import msgspec
import zmq

from vllm_actors.config import EngineConfig
from vllm_actors.enginecore.core import EngineCore
from vllm_actors.errors import ValidationError, VllmActorsError
from vllm_actors.process_exit import exit_process
from vllm_actors.protocol.engine import (AbortRequests, EngineCoreOutput, EngineCoreOutputs,
                                         EngineCoreRequest, EngineDead, EngineStartupError,
                                         FinishReason, FrontendMessage, Shutdown, UtilityCall,
                                         UtilityKind, UtilityResult, child_request_ids)
from vllm_actors.protocol.wire import Decoder, Encoder, IpcAddresses, frame_buffer
from vllm_actors.sampling_params import MAX_N

logger = logging.getLogger(__name__)

POLL_MS = 100          # how often the input thread looks at the parent process
REQUEST_TAG = EngineCoreRequest.__struct_config__.tag
# where `n` sits in an encoded EngineCoreRequest (array_like: the tag, then the fields)
REQUEST_N_FIELD = 1 + EngineCoreRequest.__struct_fields__.index("n")
_STOP = object()       # output-queue sentinel: flush and close


class EngineCoreProc:
    """Runs an EngineCore behind sockets until Shutdown, parent death or a fatal error."""

    def __init__(self, core: EngineCore, addresses: IpcAddresses, parent_pid: int | None) -> None:
        self.core = core
        self.addresses = addresses
        self.parent_pid = parent_pid
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.parent_gone = False
        # Both sockets connect now, before READY is sent, so the frontend's first request
        # finds a peer; each is then used by its own thread only.
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(addresses.inputs)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.connect(addresses.outputs)
        self.threads = [threading.Thread(target=self._input_loop, name="core-input", daemon=True),
                        threading.Thread(target=self._output_loop, name="core-output",
                                         daemon=True)]

    def run(self) -> bool:
        """Serve until stopped; False after a fatal error (already reported)."""
        for thread in self.threads:
            thread.start()
        try:
            while not self.stopping.is_set():
                idle = not self.core.has_work()
                self._process_input(block=idle)
                if idle:
                    self.core.check_health()
                if self.core.has_work() and not self.stopping.is_set():
                    self.output_queue.put(self.core.step())
            return True
        except Exception as e:  # fatal: tell the frontend, then leave
            logger.exception("engine core failed")
            self.output_queue.put(EngineDead(f"{type(e).__name__}: {e}"))
            return False
        finally:
            self.stopping.set()
            try:
                self.core.shutdown()
            except Exception:   # the frontend still gets its answer and the sockets close
                logger.exception("stopping the workers failed")
            self.output_queue.put(_STOP)
            for thread in self.threads:
                thread.join(timeout=5)
            self.ctx.term()
            if self.parent_gone:
                self.addresses.remove()

    def _process_input(self, block: bool) -> None:
        try:
            message = self.input_queue.get(timeout=POLL_MS / 1000) if block else \
                self.input_queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(message)
            try:
                message = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, message: object) -> None:
        match message:
            case EngineCoreRequest():
                self._add_request(message)
            case AbortRequests(request_ids=ids):
                self.core.abort_requests(ids)
            case UtilityCall():
                self.output_queue.put(self._utility(message))
            case Shutdown():
                self.stopping.set()

    def _add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (its n completions); whatever goes wrong while admitting it fails
        it alone (every completion)."""
        try:
            self.core.add_request(request)
        except ValidationError as e:
            self._fail_request(request.request_id, request.n, str(e), e.param or "prompt")
        except Exception as e:
            logger.exception("admitting request %s failed", request.request_id)
            self._fail_request(request.request_id, request.n, f"{type(e).__name__}: {e}",
                               None)

    def _fail_request(self, request_id: str, n: object, error: str,
                      param: str | None) -> None:
        """Fail the engine requests a message stood for (only its own id when its n is
        not a valid count: the frontend never sends such)."""
        ids = child_request_ids(request_id, n) if isinstance(n, int) and 1 <= n <= MAX_N \
            else [request_id]
        self.output_queue.put(EngineCoreOutputs([
            EngineCoreOutput(i, [], FinishReason.ERROR, error=error, error_param=param)
            for i in ids]))

    def _undecodable(self, frames: list, error: Exception) -> None:
        """A message that does not decode: if it is a request, fail that request (the
        frontend validates, so this is a client bypassing it or a version mismatch); the
        core goes on either way."""
        logger.error("dropped an undecodable message: %s", error)
        try:
            raw = msgspec.msgpack.decode(frame_buffer(frames[0]))
        except msgspec.DecodeError:
            return
        if isinstance(raw, list) and len(raw) > 1 and raw[0] == REQUEST_TAG and \
                isinstance(raw[1], str):
            n = raw[REQUEST_N_FIELD] if len(raw) > REQUEST_N_FIELD else 1
            self._fail_request(raw[1], n, f"the request could not be decoded: {error}",
                               "sampling_params")

    def _utility(self, call: UtilityCall) -> UtilityResult:
        try:
            match call.kind:
                case UtilityKind.RESET_PREFIX_CACHE:
                    return UtilityResult(call.call_id, self.core.reset_prefix_cache())
                case UtilityKind.GET_STATS:
                    return UtilityResult(call.call_id, self.core.get_stats())
                case UtilityKind.PING:
                    return UtilityResult(call.call_id, "pong")
                case UtilityKind.COLLECTIVE_RPC:
                    return UtilityResult(call.call_id, results=self.core.collective_rpc(
                        str(call.args[0]), call.args[1:]))
        except Exception as e:
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")
        return UtilityResult(call.call_id, error=f"unknown utility {call.kind}")

    def _input_loop(self) -> None:
        socket = self.input_socket
        decoder = Decoder(FrontendMessage)
        try:
            while not self.stopping.is_set():
                if socket.poll(POLL_MS):
                    frames = socket.recv_multipart(copy=False)
                    try:
                        message = decoder.decode(frames)
                    except (msgspec.ValidationError, msgspec.DecodeError) as e:
                        self._undecodable(frames, e)
                        continue
                    self.input_queue.put(message)
                    if isinstance(message, Shutdown):   # nothing follows; the loop's join
                        return                          # need not wait out a poll
                elif self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.warning("frontend process %d is gone; engine core exits",
                                   self.parent_pid)
                    self.parent_gone = True
                    self.input_queue.put(Shutdown())
                    return
        finally:
            socket.close(linger=0)

    def _output_loop(self) -> None:
        socket = self.output_socket
        encoder = Encoder()
        try:
            while True:
                item = self.output_queue.get()
                if item is _STOP:
                    return
                socket.send_multipart(encoder.encode(item), copy=False)
        finally:
            socket.close(linger=1000)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def serve(addresses: IpcAddresses, parent_pid: int | None,
          config: EngineConfig | None = None) -> bool:
    """Engine core entry, in a child process or a thread: connect to the frontend's
    handshake socket, receive the config there unless given, build the core, answer READY
    (or the startup error) and serve until told to stop.

    `parent_pid` is None when the core runs in a thread of the frontend's process.
    Returns False when startup or serving failed (the frontend has been told why).
    """
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.PAIR)
    handshake.connect(addresses.handshake)
    encoder = Encoder()
    try:
        if config is None:
            config = msgspec.msgpack.decode(handshake.recv(), type=EngineConfig)
        try:
            core = EngineCore(config, addresses.directory)
        except Exception as e:
            if not isinstance(e, VllmActorsError):
                logger.error("engine core startup failed:\n%s", traceback.format_exc())
            handshake.send_multipart(encoder.encode(EngineStartupError(
                type(e).__name__, str(e), getattr(e, "param", None))))
            return False
        proc = EngineCoreProc(core, addresses, parent_pid)
        handshake.send_multipart(encoder.encode(core.ready))
    finally:
        handshake.close(linger=5000)
        ctx.term()
    return proc.run()


def main() -> None:
    """`python -m vllm_actors.enginecore.proc IPC_DIR PARENT_PID`, started by the frontend."""
    ipc_dir, parent_pid = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the frontend decides on Ctrl-C
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="(EngineCore) %(levelname)s %(message)s")
    exit_process(0 if serve(IpcAddresses(ipc_dir), parent_pid) else 1)


if __name__ == "__main__":
    main()
