"""Hidden states from one pipeline stage to the next, over ZeroMQ.

Rank t of stage s pushes each step's residual stream to rank t of stage s + 1 (within a
stage the tensor-parallel ranks hold the same all-reduced rows, so each passes its own copy
on). One frame of header (shape, dtype) and one of raw bytes, sent without a copy. On one
machine the sockets are ipc files in the engine core's directory; a stage on another machine
would use tcp addresses instead (the socket code is the same). Steps reach every stage in
order (the broadcast ring, or each Ray actor's call order), so the messages need no step id:
a stage receives exactly one message per step that has tokens, in the order the steps were
sent.
"""

from __future__ import annotations

import os
from typing import Callable

import msgspec
import numpy as np
import zmq

from vllm_actors.models.base import PipelineStage
from vllm_actors.workers.shm import PeerGoneError

POLL_MS = 100


def stage_address(ipc_dir: str, stage: int, tp_rank: int) -> str:
    """Where stage `stage`'s rank `tp_rank` sends to (the next stage connects there)."""
    return "ipc://" + os.path.join(ipc_dir, f"pp-{stage}-{tp_rank}")


class StageChannel:
    """Args:
        ctx: the rank's ZeroMQ context.
        alive: False once the engine core is gone (a receive then gives up).
    Then `bind_sender` (every stage but the last) and `connect_receiver` (every stage but
    the first); `on_this_machine` does both for ranks that share an ipc directory.
    """

    def __init__(self, ctx: zmq.Context, alive: Callable[[], bool] = lambda: True) -> None:
        self.ctx, self.alive = ctx, alive
        self.sender = self.receiver = None

    @classmethod
    def on_this_machine(cls, ctx: zmq.Context, ipc_dir: str, stage: PipelineStage,
                        tp_rank: int, alive: Callable[[], bool] = lambda: True
                        ) -> "StageChannel":
        channel = cls(ctx, alive)
        if not stage.last:
            channel.bind_sender(stage_address(ipc_dir, stage.index, tp_rank))
        if not stage.first:
            channel.connect_receiver(stage_address(ipc_dir, stage.index - 1, tp_rank))
        return channel

    def bind_sender(self, address: str) -> str:
        """Bind where the next stage connects; "tcp://HOST" alone takes a free port. Returns
        the address bound."""
        self.sender = self.ctx.socket(zmq.PUSH)
        self.sender.setsockopt(zmq.SNDHWM, 0)
        if address.startswith("tcp://") and address.count(":") == 1:
            return f"{address}:{self.sender.bind_to_random_port(address)}"
        self.sender.bind(address)
        return address

    def connect_receiver(self, address: str) -> None:
        """Connect to the previous stage's sender."""
        self.receiver = self.ctx.socket(zmq.PULL)
        self.receiver.setsockopt(zmq.RCVHWM, 0)
        self.receiver.connect(address)

    def send(self, hidden: np.ndarray) -> None:
        assert self.sender is not None, "the last stage sends nothing on"
        hidden = np.ascontiguousarray(hidden)
        header = msgspec.msgpack.encode((list(hidden.shape), hidden.dtype.str))
        self.sender.send_multipart([header, hidden], copy=False)

    def recv(self) -> np.ndarray:
        """The previous stage's hidden states for the current step.

        Raises:
            PeerGoneError: the engine core went away while waiting.
        """
        assert self.receiver is not None, "the first stage receives nothing"
        while not self.receiver.poll(POLL_MS):
            if not self.alive():
                raise PeerGoneError("gave up waiting for the previous pipeline stage: the "
                                    "engine core is gone")
        header, payload = self.receiver.recv_multipart(copy=False)
        shape, dtype = msgspec.msgpack.decode(header.buffer)
        # a copy: the receiving model adds into its residual stream in place
        return np.frombuffer(payload.buffer, np.dtype(dtype)).reshape(shape).copy()
