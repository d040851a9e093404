"""CPU each process and thread spends a streamed token: an `AsyncLLM` single stream (DELTA
outputs, greedy, EOS ignored), the frontend's threads and the engine core's read from
/proc before and after; and, with `--socket`, the frontend's receive path alone.

    python bench/frontend_cpu.py [--model PATH] [--tokens 256] [--runs 3] [--busy-ms 0]
    python bench/frontend_cpu.py --socket [--messages 4000]

On a machine of few cores the frontend's CPU a token competes with the kernels' threads:
`--busy-ms X` spins X ms in the consumer after each token, to see what more frontend work a
token costs the stream (alternate it with 0: the host's noise is large). `--socket`: CPU a message of a receiving asyncio task,
`zmq.asyncio` against the engine's `SocketInbox`, a sender thread pushing a message every
0.5 ms. Linux only (/proc and the thread CPU clock).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _task_ticks(pid: str) -> dict[str, tuple[str, int]]:
    """Each thread of process `pid`: (name, user + system clock ticks)."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = tail.split()
        out[f"{pid}/{task}"] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
    return out


def _core_pids() -> list[str]:
    pids = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                if b"vllm_actors.enginecore.proc" in f.read():
                    pids.append(path.split("/")[2])
        except OSError:
            pass
    return pids


def _ticks() -> dict[str, tuple[str, int]]:
    """Every thread of this process and the engine core's, labelled by process, name and
    (the core's, whose threads share a name) thread id."""
    pid = str(os.getpid())
    out = {k: (f"frontend {name}{' main' if k == f'{pid}/{pid}' else ''}", t)
           for k, (name, t) in _task_ticks(pid).items()}
    for core in _core_pids():
        out.update({k: (f"core {name} {k.split('/')[1]}", t)
                    for k, (name, t) in _task_ticks(core).items()})
    return out


async def _stream(engine, tokens: int, busy_s: float, tag: str) -> tuple[float, dict]:
    from vllm_actors import SamplingParams
    from vllm_actors.sampling_params import RequestOutputKind
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    n, before, first = 0, None, 0.0
    async for _ in engine.generate({"prompt_token_ids": list(range(100, 116))}, params, tag):
        if before is None:
            before, first = _ticks(), time.perf_counter()
        n += 1
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass
    rate = (n - 1) / (time.perf_counter() - first)
    after, tick_ms = _ticks(), 1000 / os.sysconf("SC_CLK_TCK")
    per_token = {}
    for key, (name, t) in after.items():
        used = t - before.get(key, (name, 0))[1]
        if used:
            per_token[name] = used * tick_ms / (n - 1)
    return rate, per_token


def engine_main(args: argparse.Namespace) -> None:
    from vllm_actors import AsyncLLM
    from vllm_actors.loaders.model_files import default_model_path

    async def run() -> None:
        engine = AsyncLLM(args.model or str(default_model_path()),
                          enable_prefix_caching=False, max_model_len=1024)
        try:
            await _stream(engine, 16, 0.0, "warm")
            rates, cpu = [], {}
            for r in range(args.runs):
                rate, per = await _stream(engine, args.tokens, args.busy_ms / 1000, f"r{r}")
                rates.append(rate)
                for k, v in per.items():
                    cpu.setdefault(k, []).append(v)
        finally:
            engine.shutdown()
        print(f"decode tok/s: median {statistics.median(rates):.1f} "
              f"({', '.join(f'{r:.1f}' for r in rates)}); busy {args.busy_ms} ms a token")
        print("| thread | CPU ms a token (median) | runs |\n|---|---|---|")
        for k, v in sorted(cpu.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"| {k} | {statistics.median(v):.3f} | {', '.join(f'{x:.3f}' for x in v)} |")
    asyncio.run(run())


def _sender(address: str, messages: int) -> None:
    import zmq
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.connect(address)
    for _ in range(messages):
        socket.send_multipart([b"x" * 200], copy=False)
        time.sleep(0.0005)
    socket.close()


async def _receive(kind: str, address: str, messages: int) -> float:
    """This thread's CPU a message (us) after the first, receiving by `kind`."""
    import zmq
    import zmq.asyncio

    from vllm_actors.frontend.socket_inbox import SocketInbox
    ctx = zmq.asyncio.Context() if kind == "zmq.asyncio" else zmq.Context()
    socket = ctx.socket(zmq.PULL)
    socket.bind(address)
    inbox = SocketInbox(socket) if kind == "inbox" else None
    recv = inbox.recv if inbox else (lambda: socket.recv_multipart(copy=False))
    sender = threading.Thread(target=_sender, args=(address, messages))
    sender.start()
    await recv()
    start = time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)
    for _ in range(messages - 1):
        await recv()
    used = time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID) - start
    sender.join()
    if inbox:
        inbox.close()
    socket.close(linger=0)
    ctx.term()
    return used / (messages - 1) * 1e6


def socket_main(args: argparse.Namespace) -> None:
    import tempfile
    results: dict[str, list[float]] = {"zmq.asyncio": [], "inbox": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            for kind in results:
                address = f"ipc://{tmp}/{kind}{r}"
                results[kind].append(asyncio.run(_receive(kind, address, args.messages)))
    for kind, values in results.items():
        print(f"{kind}: median {statistics.median(values):.1f} us of CPU a message "
              f"({', '.join(f'{v:.1f}' for v in values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--busy-ms", type=float, default=0.0)
    parser.add_argument("--socket", action="store_true")
    parser.add_argument("--messages", type=int, default=4000)
    args = parser.parse_args()
    if args.socket:
        socket_main(args)
    else:
        engine_main(args)


if __name__ == "__main__":
    main()
