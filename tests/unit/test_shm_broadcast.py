"""The shared-memory broadcast ring and the shared-memory communicator, with readers and
ranks as threads (the same code runs across processes): ordering, wrap-around, the large-
message fallback, N readers, bit-identical all-reduce, gather and id broadcast, and the NCCL
group's plumbing with a stand-in for cupy.cuda.nccl."""

import queue
import threading

import numpy as np
import pytest

from vllm_actors.workers.nccl import NCCL_UNIQUE_ID_BYTES, NcclGroup
from vllm_actors.workers.parallel_state import ShmCommunicator, communicator_bytes
from vllm_actors.workers.shm import PeerGoneError, SharedBuffer, wait_for
from vllm_actors.workers.shm_broadcast import RingReader, RingWriter, ring_bytes


class QueueChannel:
    def __init__(self):
        self.q = queue.Queue()

    def send(self, data):
        self.q.put(data)

    def recv(self):
        return self.q.get(timeout=10)


@pytest.fixture
def segment():
    made = []

    def make(size):
        made.append(SharedBuffer.create(size))
        return made[-1]

    yield make
    for buffer in made:
        buffer.unlink()


def in_threads(n, body):
    results, errors = [None] * n, []

    def run(i):
        try:
            results[i] = body(i)
        except BaseException as e:   # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results, errors


def join(threads, errors):
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("num_readers", [1, 3])
def test_ring_delivers_every_message_in_order_to_every_reader(segment, num_readers):
    slots, slot_bytes = 2, 64      # 2 slots: 40 messages wrap around 20 times
    buffer = segment(ring_bytes(num_readers, slots, slot_bytes))
    channels = [QueueChannel() for _ in range(num_readers)]
    writer = RingWriter(buffer, num_readers, channels, slots, slot_bytes)
    messages = [bytes([i]) * (i * 7 % 60) for i in range(40)]
    messages[5] = messages[23] = b"x" * 1000          # over a slot: through the fallback

    def read(i):
        reader = RingReader(buffer, num_readers, i, channels[i], slots, slot_bytes)
        return [reader.dequeue() for _ in messages]

    threads, results, errors = in_threads(num_readers, read)
    for message in messages:
        writer.enqueue(message)
    join(threads, errors)
    assert results == [messages] * num_readers


def test_writer_waits_for_the_slowest_reader(segment):
    buffer = segment(ring_bytes(2, 2, 16))
    writer = RingWriter(buffer, 2, [], 2, 16)
    fast = RingReader(buffer, 2, 0, None, 2, 16)
    slow = RingReader(buffer, 2, 1, None, 2, 16)
    writer.enqueue(b"a")
    writer.enqueue(b"b")
    assert fast.dequeue() == b"a" and fast.dequeue() == b"b"
    done = threading.Event()
    third = threading.Thread(target=lambda: (writer.enqueue(b"c"), done.set()))
    third.start()
    assert not done.wait(0.2)              # slot 0 still unread by the slow reader
    assert slow.dequeue() == b"a"
    assert done.wait(5)
    third.join()
    assert slow.dequeue() == b"b" and slow.dequeue() == b"c" and fast.dequeue() == b"c"


def test_waits_give_up_when_the_peer_is_gone():
    with pytest.raises(PeerGoneError):
        wait_for(lambda: False, alive=lambda: False)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_is_the_sum_and_bit_identical_on_every_rank(segment, world_size):
    slot_bytes = 4 * 100                   # [37, 11] floats run as 5 chunks
    buffer = segment(communicator_bytes(world_size, slot_bytes))
    parts = [np.random.default_rng(r).standard_normal((37, 11)).astype(np.float32)
             for r in range(world_size)]
    widths = [3, 5, 2][:world_size]
    columns = [np.full((9, widths[r]), r + 1, np.float32) for r in range(world_size)]

    def rank(r):
        comm = ShmCommunicator(buffer, r, world_size, slot_bytes)
        reduced = [comm.all_reduce(parts[r]) for _ in range(3)]
        gathered = comm.gather_columns(columns[r], widths)
        ids = comm.broadcast_ids(np.arange(7, dtype=np.int64) * 3 if r == 0 else None, 7)
        return reduced, gathered, ids, comm.all_gather_columns(columns[r], widths)

    threads, results, errors = in_threads(world_size, rank)
    join(threads, errors)
    expected = parts[0] + parts[1]
    for part in parts[2:]:
        expected += part
    for reduced, gathered, ids, everyone in results:
        for value in reduced:
            assert value.tobytes() == expected.tobytes()
        assert ids.tolist() == [0, 3, 6, 9, 12, 15, 18]
        assert everyone.tolist() == np.concatenate(columns, axis=1).tolist()
    assert results[0][1].tolist() == np.concatenate(columns, axis=1).tolist()
    assert all(r[1] is None for r in results[1:])


class FakeNccl:
    """Records what NcclGroup hands to cupy.cuda.nccl."""
    NCCL_FLOAT32, NCCL_SUM = 7, 0
    made = []

    @staticmethod
    def get_unique_id():
        return tuple(range(-64, 64))

    class NcclCommunicator:
        def __init__(self, size, unique_id, rank):
            FakeNccl.made.append((size, unique_id, rank))
            self.calls = []

        def allReduce(self, send, recv, count, dtype, op, stream):   # noqa: N802 - CuPy's name
            self.calls.append((send, recv, count, dtype, op, stream))


class FakeDeviceArray:
    class data:
        ptr = 4096

    size = 12


def test_nccl_group_shares_rank_0s_id_and_reduces_in_place(segment):
    assert NCCL_UNIQUE_ID_BYTES == 128
    buffer = segment(communicator_bytes(2, 4096))
    FakeNccl.made.clear()

    def rank(r):
        group = NcclGroup(ShmCommunicator(buffer, r, 2, 4096), backend=object(), nccl=FakeNccl)
        x = FakeDeviceArray()
        assert group.all_reduce(x) is x
        return group.nccl_comm.calls

    threads, results, errors = in_threads(2, rank)
    join(threads, errors)
    assert sorted(FakeNccl.made) == [(2, tuple(range(-64, 64)), 0),
                                     (2, tuple(range(-64, 64)), 1)]
    assert results == [[(4096, 4096, 12, 7, 0, 0)]] * 2


def test_nccl_without_cupy_says_what_to_install(monkeypatch):
    import sys

    from vllm_actors.workers.nccl import nccl_module
    monkeypatch.setitem(sys.modules, "cupy", None)      # as if CuPy were not installed
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    with pytest.raises(RuntimeError, match="needs NCCL through CuPy"):
        nccl_module()
