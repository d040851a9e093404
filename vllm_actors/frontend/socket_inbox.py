"""A receiving ZeroMQ socket read from an asyncio loop, with less Python a message than
`zmq.asyncio` spends on its futures and event handlers (docs/BENCHMARKS.md): the frontend
shares the machine's cores with the engine's kernel threads, and this runs once a step.

The loop watches the socket's file descriptor; ZeroMQ signals it by edges, so each time it
fires (and before each wait) the socket is drained without blocking for as long as its
EVENTS say a message is in.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import zmq


class SocketInbox:
    """Messages (lists of frames) of `socket` for one task at a time of one loop."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self.fd = socket.getsockopt(zmq.FD)
        self.messages: collections.deque[list[Any]] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def recv(self) -> list[Any]:
        """The next message's frames (zero-copy `zmq.Frame`s)."""
        if not self.messages:
            self._drain()
        while not self.messages:
            loop = asyncio.get_running_loop()
            if self.loop is not loop:
                self._unwatch()
                loop.add_reader(self.fd, self._ready)
                self.loop = loop
            self.waiter = loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.messages.popleft()

    def close(self) -> None:
        """Stop watching the socket (before it closes; the socket is the caller's) and cancel
        a pending wait, as closing a `zmq.asyncio` socket does, so that the reading task
        ends rather than lingers until its loop is destroyed. Callable from any thread."""
        loop, waiter = self.loop, self.waiter
        self._unwatch()
        if waiter is None or waiter.done() or loop is None or loop.is_closed():
            return
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            waiter.cancel()
        else:
            loop.call_soon_threadsafe(waiter.cancel)

    def _drain(self) -> None:
        socket = self.socket
        while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.messages.append(socket.recv_multipart(zmq.NOBLOCK, copy=False))

    def _ready(self) -> None:
        waiter = self.waiter
        try:
            self._drain()
        except zmq.ZMQError as e:     # closed under us: the waiting task hears of it
            self._unwatch()
            if waiter is not None and not waiter.done():
                waiter.set_exception(e)
            return
        if self.messages and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _unwatch(self) -> None:
        loop, self.loop = self.loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.fd)
