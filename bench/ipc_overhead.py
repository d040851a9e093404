"""What the process split costs: codec time, message transit per engine step, round trips,
and end-to-end tokens/s through the split against the same engine in one process.

    python bench/ipc_overhead.py [--runs 3]

Transit = time from the core stamping a step's EngineCoreOutputs to the frontend having
decoded it (encode + output thread + socket + decode); both clocks are this machine's.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from vllm_actors import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from vllm_actors.config import EngineArgs
from vllm_actors.enginecore.core import EngineCore
from vllm_actors.protocol.engine import (CoreMessage, EngineCoreOutput, EngineCoreOutputs,
                                         EngineCoreRequest, SchedulerStats)
from vllm_actors.protocol.wire import Decoder, Encoder

STREAM = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)


def codec_us(num_outputs: int, repeat: int = 2000) -> tuple[float, float]:
    message = EngineCoreOutputs([EngineCoreOutput(f"req-{i}", [1234]) for i in range(num_outputs)],
                                time.time(), SchedulerStats(num_outputs, 0, 0.1))
    enc, dec = Encoder(), Decoder(CoreMessage)
    frames = enc.encode(message)
    t0 = time.perf_counter()
    for _ in range(repeat):
        enc.encode(message)
    t1 = time.perf_counter()
    for _ in range(repeat):
        dec.decode(frames)
    t2 = time.perf_counter()
    return (t1 - t0) / repeat * 1e6, (t2 - t1) / repeat * 1e6


async def transit_and_ping(llm: AsyncLLM, streams: int) -> tuple[float, float, float]:
    """Median transit (µs) of step messages, median step interval (ms), median ping (µs)."""
    transits, arrivals = [], []
    recv = llm.client.recv

    async def timed_recv():
        message = await recv()
        if isinstance(message, EngineCoreOutputs) and message.outputs:
            now = time.time()
            transits.append(now - message.timestamp)
            arrivals.append(now)
        return message

    llm.client.recv = timed_recv
    prompts = [f"Story number {i}:" for i in range(streams)]

    async def one(prompt, i):
        async for _ in llm.generate(prompt, STREAM, f"s{streams}-{i}"):
            pass

    await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))
    llm.client.recv = recv
    pings = []
    for _ in range(200):
        t = time.perf_counter()
        await llm.check_health()
        pings.append(time.perf_counter() - t)
    intervals = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return (statistics.median(transits) * 1e6, statistics.median(intervals) * 1e3,
            statistics.median(pings) * 1e6)


def tokens_per_s_core(prompts: list[str], params: SamplingParams, tokenizer) -> float:
    core = EngineCore(EngineArgs(enable_prefix_caching=False).create_engine_config())
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), tokenizer.encode(p), params, [2], 0.0))
    start, n = time.perf_counter(), 0
    while core.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in core.step().outputs)
    return n / (time.perf_counter() - start)


def tokens_per_s_llm(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print("| outputs per message | encode µs | decode µs |\n|---|---|---|")
    for n in (1, 64):
        enc, dec = codec_us(n)
        print(f"| {n} | {enc:.1f} | {dec:.1f} |")

    llm = AsyncLLM(enable_prefix_caching=False)
    print("\n| streams | transit per step message µs (median) | step interval ms | ping µs |")
    print("|---|---|---|---|")
    for streams in (1, 64):
        transit, interval, ping = asyncio.run(transit_and_ping(llm, streams))
        print(f"| {streams} | {transit:.0f} | {interval:.1f} | {ping:.0f} |")
    tokenizer = llm.get_tokenizer()
    llm.shutdown()

    prompts = [f"Tell me a fact about the number {i}." for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rows = {"in-process EngineCore.step loop (no frontend)": [],
            "LLM, core in a thread (multiprocessing off)": [],
            "LLM, core in its own process": []}
    for _ in range(args.runs):
        rows["in-process EngineCore.step loop (no frontend)"].append(
            tokens_per_s_core(prompts, params, tokenizer))
        for label, mp in (("LLM, core in a thread (multiprocessing off)", False),
                          ("LLM, core in its own process", True)):
            with LLM(enable_prefix_caching=False, multiprocessing=mp) as llm_:
                rows[label].append(tokens_per_s_llm(llm_, prompts, params))
    print(f"\n| 64 prompts x 32 tokens | output tok/s (median of {args.runs}) | runs |")
    print("|---|---|---|")
    for label, values in rows.items():
        print(f"| {label} | {statistics.median(values):.1f} | "
              f"{', '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
