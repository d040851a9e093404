"""Bytes on the wire: msgpack encoding of protocol Structs with numpy arrays as extra frames,
and short ipc addresses for the sockets between processes.

A message is a list of frames: frame 0 is msgpack; an ndarray field is encoded inline as
[dtype, shape, bytes] when small, else as [dtype, shape, frame index] with its buffer sent as
its own frame, uncopied (decoded as a read-only view of the received frame).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

INLINE_ARRAY_BYTES = 256
IPC_PATH_MAX = 100  # libzmq refuses ipc paths over ~107 bytes


class Encoder:
    """Not thread-safe: one per sending thread."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Any] = []

    def encode(self, message: Any) -> list[Any]:
        self._frames = frames = [b""]
        frames[0] = self._encoder.encode(message)
        self._frames = []
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            array = np.ascontiguousarray(obj)
            if array.nbytes <= INLINE_ARRAY_BYTES:
                return [array.dtype.str, list(array.shape), array.tobytes()]
            self._frames.append(array)
            return [array.dtype.str, list(array.shape), len(self._frames) - 1]
        raise NotImplementedError(f"cannot encode {type(obj).__name__}")


class Decoder:
    """Decodes frames into `message_type` (a Struct or a tagged union of Structs)."""

    def __init__(self, message_type: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type, dec_hook=self._dec_hook)
        self._frames: list[Any] = []

    def decode(self, frames: list[Any]) -> Any:
        self._frames = frames
        try:
            return self._decoder.decode(frame_buffer(frames[0]))
        finally:
            self._frames = []

    def _dec_hook(self, cls: type, obj: Any) -> Any:
        if cls is np.ndarray:
            dtype, shape, data = obj
            if isinstance(data, int):
                data = frame_buffer(self._frames[data])
            return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
        raise NotImplementedError(f"cannot decode {cls.__name__}")


def frame_buffer(frame: Any) -> Any:
    """The bytes of a received frame (a zmq.Frame's buffer, or the bytes themselves)."""
    return frame.buffer if hasattr(frame, "buffer") else frame


@dataclass(frozen=True)
class IpcAddresses:
    """ipc:// endpoints in one private directory, chosen by the parent and passed to children.

    The frontend binds `inputs` (it pushes requests) and `outputs` (it pulls results); the
    core connects to both and pushes its startup result to `handshake`.
    """

    directory: str

    @property
    def inputs(self) -> str:
        return f"ipc://{self.directory}/in"

    @property
    def outputs(self) -> str:
        return f"ipc://{self.directory}/out"

    @property
    def handshake(self) -> str:
        return f"ipc://{self.directory}/hs"

    @classmethod
    def create(cls) -> "IpcAddresses":
        base = tempfile.gettempdir()
        if len(base) > IPC_PATH_MAX - 20:
            base = "/tmp"
        return cls(tempfile.mkdtemp(prefix="va-", dir=base))

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def exists(self) -> bool:
        return os.path.isdir(self.directory)


@dataclass(frozen=True)
class TcpAddresses:
    """tcp:// endpoints the frontend bound for an engine core on another machine (a data
    parallel core on Ray), and that core's own local directory for its workers' ipc sockets
    (empty until the core's side makes one: `with_local_directory`)."""

    inputs: str
    outputs: str
    handshake: str
    directory: str = ""

    def with_local_directory(self) -> "TcpAddresses":
        return TcpAddresses(self.inputs, self.outputs, self.handshake,
                            IpcAddresses.create().directory)

    def remove(self) -> None:
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
