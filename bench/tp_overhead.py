"""What tensor parallelism adds to a step on CPU workers: the StepInput broadcast and the
collectives, measured without the model, and the whole engine's decode step for context.

    python bench/tp_overhead.py comm   [--tp 2 3] [--batch 1 32] [--steps 200] [--runs 5]
    python bench/tp_overhead.py engine [--tp 1 3] [--batch 1 32] [--tokens 32] [--runs 3]

comm: N worker processes (spawned) run one SmolLM2 decode step's
communication and nothing else: read a real decode StepInput (B requests) from the shared-
memory ring, 61 all-reduces of [B, 576] float32 (embedding + 2 per layer x 30 layers), the
gather of [B, 49152 / N] logits to rank 0, the broadcast of B sampled ids; rank 0 answers over
ZeroMQ as the real worker does. Reported: median ms per step over --runs runs.
engine: `LLM.generate` of B prompts x --tokens greedy tokens on SmolLM2 at each size
(1: the in-process executor; 1mp: one worker process, i.e. the ring and process hop alone); ms per decode step = (wall time - the 1-token run's) /
(tokens - 1). Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import msgspec
import numpy as np
import zmq

HIDDEN, LAYERS, VOCAB = 576, 30, 49152
SLOT = 8 << 20


def decode_step(batch: int) -> bytes:
    from vllm_actors.protocol.step import CachedRequestData, StepInput
    from vllm_actors.protocol.worker import ExecuteStep
    ids = [f"cmpl-{i:08x}-0" for i in range(batch)]
    step = StepInput(cached_requests=CachedRequestData(ids, [[] for _ in ids],
                                                       [100 + i for i in range(batch)]),
                     num_scheduled_tokens={i: 1 for i in ids})
    return msgspec.msgpack.encode(ExecuteStep(step))


def comm_rank(rank, size, ring_name, comm_name, address, batch):
    from vllm_actors.protocol.worker import WorkerCall
    from vllm_actors.workers.parallel_state import ShmCommunicator, communicator_bytes
    from vllm_actors.workers.shm import (SharedBuffer, parent_alive, set_oversubscribed,
                                         usable_cpus)
    from vllm_actors.workers.shm_broadcast import RingReader, ring_bytes
    set_oversubscribed(size > usable_cpus())      # as workers/worker.py decides
    alive = parent_alive(os.getppid())            # leave if the benchmark dies
    ring = RingReader(SharedBuffer.attach(ring_name, ring_bytes(size)), size, rank, None,
                      alive=alive)
    comm = ShmCommunicator(SharedBuffer.attach(comm_name, communicator_bytes(size, SLOT)),
                           rank, size, SLOT, alive)
    ctx = zmq.Context()
    socket = ctx.socket(zmq.PAIR)       # a PAIR takes one peer: only rank 0 answers
    if rank == 0:
        socket.connect(address)
    decoder = msgspec.msgpack.Decoder(WorkerCall)
    hidden = np.random.default_rng(rank).standard_normal((batch, HIDDEN)).astype(np.float32)
    logits = np.ones((batch, VOCAB // size), np.float32)
    while True:
        data = ring.dequeue()
        if not data:
            return
        decoder.decode(data)
        for _ in range(2 * LAYERS + 1):
            comm.all_reduce(hidden)
        comm.gather_columns(logits, [VOCAB // size] * size)
        comm.broadcast_ids(np.zeros(batch, np.int64) if rank == 0 else None, batch)
        if rank == 0:
            socket.send(b"done")


def measure_comm(size: int, batch: int, steps: int) -> float:
    """One run: ms per step, averaged over `steps` steps."""
    from vllm_actors.workers.parallel_state import communicator_bytes
    from vllm_actors.workers.shm import SharedBuffer
    from vllm_actors.workers.shm_broadcast import RingWriter, ring_bytes
    ring_buffer = SharedBuffer.create(ring_bytes(size))
    comm_buffer = SharedBuffer.create(communicator_bytes(size, SLOT))
    address = f"ipc:///tmp/tp-overhead-{os.getpid()}-{size}-{batch}-{time.monotonic_ns()}"
    ctx_zmq = zmq.Context()
    socket = ctx_zmq.socket(zmq.PAIR)
    socket.bind(address)
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=comm_rank, args=(r, size, ring_buffer.name, comm_buffer.name,
                                                     address, batch)) for r in range(size)]
        for p in procs:
            p.start()
        writer = RingWriter(ring_buffer, size, [])
        message = decode_step(batch)
        for _ in range(20):                       # warm up
            writer.enqueue(message)
            socket.recv()
        start = time.perf_counter()
        for _ in range(steps):
            writer.enqueue(message)
            socket.recv()
        elapsed = time.perf_counter() - start
        writer.enqueue(b"")
        for p in procs:
            p.join()
    finally:
        ring_buffer.unlink()
        comm_buffer.unlink()
        socket.close(linger=0)
        ctx_zmq.term()
        if os.path.exists(address[len("ipc://"):]):
            os.unlink(address[len("ipc://"):])
    return elapsed / steps * 1e3


def measure_engine(size: str, batch: int, tokens: int) -> float:
    from vllm_actors import LLM, SamplingParams
    prompts = [{"prompt_token_ids": [1, 504 + i, 2, 3, 4, 5, 6, 7]} for i in range(batch)]
    backend = "mp" if size.endswith("mp") else None
    with LLM(tensor_parallel_size=int(size.rstrip("mp")),
             distributed_executor_backend=backend) as llm:
        def wall(n: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            llm.generate(prompts, params, use_tqdm=False)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start
        return (wall(tokens) - wall(1)) / (tokens - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["comm", "engine"])
    parser.add_argument("--tp", nargs="+", default=None,
                        help="sizes; engine mode also takes 1mp (one worker process)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    sizes = args.tp or (["2", "3"] if args.mode == "comm" else ["1", "1mp", "3"])
    print(f"| mode | TP | batch | ms / step (median of {args.runs}) | runs |")
    print("|---|---|---|---|---|")
    for size in sizes:
        for batch in args.batch:
            if args.mode == "comm":
                runs = [measure_comm(int(size), batch, args.steps) for _ in range(args.runs)]
            else:
                runs = [measure_engine(size, batch, args.tokens) for _ in range(args.runs)]
            print(f"| {args.mode} | {size} | {batch} | {statistics.median(runs):.2f} | "
                  f"{', '.join(f'{r:.2f}' for r in runs)} |", flush=True)


if __name__ == "__main__":
    main()
