"""One writer, N readers: a ring of message slots in shared memory (vLLM's MessageQueue shape).

Layout: per slot a header line (sequence number, payload length) and one line per reader (the
last sequence number that reader consumed from this slot), then the payload areas. The writer
fills slot (seq - 1) % num_slots once every reader has consumed the message it held before,
writes the payload and length, and publishes the sequence number last. Each flag has a single
writer, so no atomics are needed (aligned 8-byte stores; x86 keeps store order).

A message larger than a slot is published with length -1 and travels over the `fallback`
channel instead (per reader, in order): the engine core's ZeroMQ socket to that worker.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from vllm_actors.workers.shm import CACHE_LINE, SharedBuffer, wait_for

DEFAULT_SLOTS = 4
DEFAULT_SLOT_BYTES = 1 << 20
_OVER_FALLBACK = -1
_LINE = CACHE_LINE // 8        # int64s per cache line


class Fallback(Protocol):
    def send(self, data: bytes) -> None: ...

    def recv(self) -> bytes: ...


class SocketChannel:
    """A fallback channel over one ZeroMQ socket (a PAIR between the core and a worker)."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket

    def send(self, data: bytes) -> None:
        self.socket.send(data)

    def recv(self) -> bytes:
        return self.socket.recv()


def ring_bytes(num_readers: int, num_slots: int = DEFAULT_SLOTS,
               slot_bytes: int = DEFAULT_SLOT_BYTES) -> int:
    return num_slots * (1 + num_readers) * CACHE_LINE + num_slots * slot_bytes


class _Ring:
    def __init__(self, buffer: SharedBuffer, num_readers: int, num_slots: int,
                 slot_bytes: int) -> None:
        self.buffer, self.num_readers = buffer, num_readers
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        head = num_slots * (1 + num_readers) * CACHE_LINE
        lines = np.frombuffer(buffer.buf, np.int64, head // 8).reshape(
            num_slots, 1 + num_readers, _LINE)
        self.seq = lines[:, 0, 0]              # [num_slots] published sequence numbers
        self.length = lines[:, 0, 1]           # [num_slots] payload bytes (-1: fallback)
        self.read = lines[:, 1:, 0]            # [num_slots, num_readers] consumed sequence
        self.payload = np.frombuffer(buffer.buf, np.uint8, num_slots * slot_bytes,
                                     head).reshape(num_slots, slot_bytes)
        self.next_seq = 1


class RingWriter(_Ring):
    """The engine core's end.

    Args:
        fallbacks: one channel per reader for messages over `slot_bytes`.
        alive: checked while the ring is full; False raises shm.PeerGoneError.
    """

    def __init__(self, buffer: SharedBuffer, num_readers: int, fallbacks: list[Fallback],
                 num_slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 alive: Callable[[], bool] = lambda: True) -> None:
        super().__init__(buffer, num_readers, num_slots, slot_bytes)
        self.fallbacks, self.alive = fallbacks, alive

    def enqueue(self, data: bytes) -> None:
        seq = self.next_seq
        slot = (seq - 1) % self.num_slots
        previous = seq - self.num_slots        # what this slot held last (<= 0: nothing)
        read = self.read[slot]
        wait_for(lambda: read.min() >= previous, self.alive, "a worker to read the ring")
        if len(data) <= self.slot_bytes:
            self.payload[slot, :len(data)] = np.frombuffer(data, np.uint8)
            self.length[slot] = len(data)
        else:
            for channel in self.fallbacks:
                channel.send(data)
            self.length[slot] = _OVER_FALLBACK
        self.seq[slot] = seq                   # publish last
        self.next_seq = seq + 1


class RingReader(_Ring):
    """A worker's end (reader `index`)."""

    def __init__(self, buffer: SharedBuffer, num_readers: int, index: int, fallback: Fallback,
                 num_slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 alive: Callable[[], bool] = lambda: True) -> None:
        super().__init__(buffer, num_readers, num_slots, slot_bytes)
        self.index, self.fallback, self.alive = index, fallback, alive

    def dequeue(self) -> bytes:
        """The next message (blocks; sleeps when idle)."""
        seq = self.next_seq
        slot = (seq - 1) % self.num_slots
        seqs = self.seq
        wait_for(lambda: seqs[slot] == seq, self.alive, "the engine core")
        length = int(self.length[slot])
        data = self.fallback.recv() if length == _OVER_FALLBACK else \
            self.payload[slot, :length].tobytes()
        self.read[slot, self.index] = seq
        self.next_seq = seq + 1
        return data
