"""SocketInbox: every message in order, whether it came before the first wait (ZeroMQ's
descriptor signalled an edge no one was watching), in a burst while a task waited, or from
another thread; close stops the loop watching the socket."""

from __future__ import annotations

import asyncio
import threading

import zmq

from vllm_actors.frontend.socket_inbox import SocketInbox


def _pair(tmp_path):
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    address = f"ipc://{tmp_path}/inbox"
    pull.bind(address)
    push.connect(address)
    return ctx, pull, push


def test_messages_arrive_in_order_before_during_and_across_threads(tmp_path):
    ctx, pull, push = _pair(tmp_path)
    inbox = SocketInbox(pull)
    for i in range(3):                         # before anyone waits
        push.send_multipart([b"early", str(i).encode()])

    def later() -> None:
        for i in range(50):
            push.send_multipart([b"late", str(i).encode()])

    async def read() -> list[tuple[bytes, bytes]]:
        got = [await inbox.recv() for _ in range(3)]
        sender = threading.Thread(target=later)
        sender.start()
        got += [await asyncio.wait_for(inbox.recv(), 5) for _ in range(50)]
        sender.join()
        loop = asyncio.get_running_loop()
        inbox.close()
        assert not loop.remove_reader(inbox.fd)        # close took the reader off
        return [(bytes(a), bytes(b)) for a, b in got]

    got = asyncio.run(read())
    assert got == [(b"early", str(i).encode()) for i in range(3)] + \
        [(b"late", str(i).encode()) for i in range(50)]
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


def test_a_new_loop_watches_again_and_a_closed_socket_fails_the_wait(tmp_path):
    ctx, pull, push = _pair(tmp_path)
    inbox = SocketInbox(pull)

    async def one() -> bytes:
        asyncio.get_running_loop().call_later(0.05, push.send, b"x")
        return bytes((await asyncio.wait_for(inbox.recv(), 5))[0])

    assert asyncio.run(one()) == b"x"          # a loop, closed after
    assert asyncio.run(one()) == b"x"          # the next loop registers its own reader

    async def closed_under() -> BaseException | None:
        loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(inbox.recv())
        await asyncio.sleep(0.01)
        pull.close(linger=0)
        inbox._ready()                          # the descriptor's last signal
        try:
            await asyncio.wait_for(waiting, 5)
        except zmq.ZMQError as e:
            return e
        finally:
            assert not loop.remove_reader(inbox.fd)
        return None

    assert isinstance(asyncio.run(closed_under()), zmq.ZMQError)
    push.close(linger=0)
    ctx.term()


def test_close_cancels_a_pending_wait_from_the_loop_or_another_thread(tmp_path):
    """As closing a zmq.asyncio socket cancels its pending receive: the reading task ends
    (an engine shut down at interpreter exit left it pending, and asyncio complained)."""
    ctx, pull, push = _pair(tmp_path)

    async def closed_while_waiting(from_thread: bool) -> bool:
        inbox = SocketInbox(pull)
        waiting = asyncio.ensure_future(inbox.recv())
        await asyncio.sleep(0.01)
        if from_thread:
            closer = threading.Thread(target=inbox.close)
            closer.start()
            closer.join()
        else:
            inbox.close()
        try:
            await asyncio.wait_for(waiting, 5)
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(closed_while_waiting(False))
    assert asyncio.run(closed_while_waiting(True))
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()
