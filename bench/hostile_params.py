"""Per-request costs that grew with n and with list sizes (issue 29): medians of --runs.

    python bench/hostile_params.py [--runs 3] [--only sampler,latency,add_request,rss]

- sampler: one sampler step over SmolLM2's vocabulary (49,152) for 8 rows that share 200,000
  bad words (1-4 tokens each, random ids) and one plain row; also the time to give the 9
  rows their params (where the bad-word index is built).
- latency: a plain greedy 16-token request alone, next to an n=8 request (started once that
  one has its first token), and next to the same n=8 request with 200,000 bad words; and
  the n=8 request's time to its first token (the default model, engine core in its own
  process).
- add_request: the event-loop time of `AsyncLLM.add_request` for a processed request with
  2,000,000 stop_token_ids at n=32, and with 1,024 stop strings (32 characters each) at
  n=128 (then aborted).
- rss: the engine core's peak resident set above its resident set before the request, for
  a request at n=16 whose bad words are 4 MB of text (what the frontend tokenizes it into:
  each word as written and with a leading space), a fresh engine per run.

List sizes beyond the request bounds are set on the params after construction (the limits
are what this measures around). Results: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import time

import numpy as np
import psutil

from vllm_actors.sampling_params import SamplingParams
from vllm_actors.workers.sampler import Sampler
from vllm_actors.workers.sampling_state import SamplingState

VOCAB = 49152
PROMPT = "The capital of France is"


def random_words(num: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, num)
    ids = rng.integers(0, VOCAB, int(lengths.sum())).tolist()
    out, start = [], 0
    for n in lengths.tolist():
        out.append(ids[start:start + n])
        start += n
    return out


def set_rows(state: SamplingState, params: SamplingParams, rows: range) -> None:
    child = "child_index" in inspect.signature(state.set_row).parameters
    for i, row in enumerate(rows):
        if child:
            state.set_row(row, params, [2], child_index=i)
        else:
            state.set_row(row, params, [2])


def bench_sampler(runs: int) -> dict[str, float]:
    words = random_words(200_000)
    hostile = SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=64)
    hostile.bad_words_token_ids = words
    plain = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(1)
    token_ids = rng.integers(0, VOCAB, (9, 128)).astype(np.int32)
    num_prompt = np.full(9, 32)
    num_tokens = np.full(9, 96)
    logits = rng.standard_normal((9, VOCAB)).astype(np.float32)
    setup, step = [], []
    for _ in range(runs):
        state = SamplingState(9)
        t0 = time.perf_counter()
        set_rows(state, hostile, range(8))
        state.set_row(8, plain, [2])
        setup.append(time.perf_counter() - t0)
        sampler = Sampler(0)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            sampler.sample(logits, np.arange(9), state, token_ids, num_prompt, num_tokens)
            times.append(time.perf_counter() - t0)
        step.append(statistics.median(times))
    return {"set_rows_s": statistics.median(setup), "step_s": statistics.median(step)}


async def _final(collector) -> None:
    while True:
        out = collector.get_nowait() or await collector.get()
        if out.finished:
            return


async def _plain_latency(llm, rid: str) -> float:
    t0 = time.perf_counter()
    collector = llm.add_request(rid, PROMPT, SamplingParams(temperature=0.0, max_tokens=16,
                                                            ignore_eos=True))
    await _final(collector)
    return time.perf_counter() - t0


async def bench_latency(llm, runs: int) -> dict[str, float]:
    await _plain_latency(llm, "warm")
    alone = [await _plain_latency(llm, f"alone-{i}") for i in range(runs)]
    words = random_words(200_000)
    beside: dict[str, list[float]] = {"plain": [], "bad_words": []}
    first: dict[str, list[float]] = {"plain": [], "bad_words": []}
    for i in range(runs):
        for kind in beside:
            params = SamplingParams(n=8, temperature=1.0, seed=i, max_tokens=32,
                                    ignore_eos=True)
            if kind == "bad_words":
                params.bad_words_token_ids = words
            rid = f"{kind}-{i}"
            processed = llm.input_processor.process(rid, PROMPT, params)
            t0 = time.perf_counter()
            neighbour = llm.add_request(rid, processed, params)
            await neighbour.get()         # its first token: admitted (masks built), decoding
            first[kind].append(time.perf_counter() - t0)
            beside[kind].append(await _plain_latency(llm, f"beside-{rid}"))
            await llm.abort(rid)
            await _final(neighbour)
    return {"plain_alone_s": statistics.median(alone),
            "plain_beside_n8_s": statistics.median(beside["plain"]),
            "plain_beside_n8_bad_words_s": statistics.median(beside["bad_words"]),
            "n8_first_token_s": statistics.median(first["plain"]),
            "n8_bad_words_first_token_s": statistics.median(first["bad_words"])}


async def _loop_time(llm, rid: str, params: SamplingParams, field: str, value) -> float:
    processed = llm.input_processor.process(rid, PROMPT, params)
    setattr(processed.request.sampling_params, field, value)
    t0 = time.perf_counter()
    collector = llm.add_request(rid, processed, processed.request.sampling_params)
    elapsed = time.perf_counter() - t0
    await llm.abort(rid)
    await _final(collector)
    return elapsed


async def bench_add_request(llm, runs: int) -> dict[str, float]:
    stop_ids = np.random.default_rng(2).integers(3, VOCAB, 2_000_000).tolist()
    stops = [f"{i:06d}" + "x" * 26 for i in range(1024)]
    ids, strings = [], []
    for i in range(runs):
        ids.append(await _loop_time(llm, f"ids-{i}", SamplingParams(n=32, max_tokens=1),
                                    "stop_token_ids", stop_ids))
        strings.append(await _loop_time(llm, f"stop-{i}", SamplingParams(n=128, max_tokens=1),
                                        "stop", stops))
    return {"add_request_2M_stop_ids_n32_s": statistics.median(ids),
            "add_request_1024_stops_n128_s": statistics.median(strings)}


def bad_words_4mb(tokenizer) -> list[list[int]]:
    rng = np.random.default_rng(3)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words, size = [], 0
    while size < 4 * 2**20:
        w = "".join(rng.choice(letters, int(rng.integers(3, 11))))
        words.append(w)
        size += len(w) + 4                # as a JSON list: quotes, comma, space
    variants = words + [" " + w for w in words]
    unique = {tuple(e.ids): None for e in tokenizer.backend.encode_batch(
        variants, add_special_tokens=False) if e.ids}
    return [list(w) for w in unique]


def _core_pid(llm) -> int:
    return llm.group.clients[0].pid


async def bench_rss(runs: int) -> dict[str, float]:
    from vllm_actors import AsyncLLM
    words = None
    peaks = []
    for i in range(runs):
        with AsyncLLM() as llm:
            words = words or bad_words_4mb(llm.tokenizer)
            await _plain_latency(llm, "warm")
            proc = psutil.Process(_core_pid(llm))
            before = proc.memory_info().rss
            _reset_peak(proc.pid)
            params = SamplingParams(n=16, temperature=1.0, seed=i, max_tokens=4,
                                    ignore_eos=True)
            params.bad_words_token_ids = words
            processed = llm.input_processor.process(f"rss-{i}", PROMPT, params)
            await _final(llm.add_request(f"rss-{i}", processed, params))
            peak = _vm_hwm(proc.pid)
            peaks.append((peak - before) / 2**20)
            print(f"  run {i}: {len(words)} bad words, core RSS {before / 2**20:.0f} MiB, "
                  f"peak {peak / 2**20:.0f} MiB")
    return {"core_peak_rss_above_before_mib": statistics.median(peaks)}


def _reset_peak(pid: int) -> None:
    """Set the process's peak resident set (VmHWM) to its current one."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


async def main_async(args: argparse.Namespace) -> None:
    only = set(args.only.split(","))
    results: dict[str, float] = {}
    if "sampler" in only:
        results.update(bench_sampler(args.runs))
        print(results)
    if only & {"latency", "add_request"}:
        from vllm_actors import AsyncLLM
        with AsyncLLM() as llm:
            if "latency" in only:
                results.update(await bench_latency(llm, args.runs))
                print(results)
            if "add_request" in only:
                results.update(await bench_add_request(llm, args.runs))
                print(results)
    if "rss" in only:
        results.update(await bench_rss(args.runs))
    for name, value in results.items():
        print(f"{name}: {value:.4g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="sampler,latency,add_request,rss")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
