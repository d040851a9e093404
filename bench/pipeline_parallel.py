"""Pipeline parallel on one machine: what the stage hop costs per step, and throughput with
the stages overlapping, against one worker process with the same cores.

    python bench/pipeline_parallel.py [--pp 2] [--streams 1 16 64] [--max-tokens 32] [--runs 3]

Configurations (started one after the other): `--pipeline-parallel-size 1` with one worker
process (`--distributed-executor-backend mp`, the same process hop) with all cores, the same
with cores // P threads (what each stage gets), and `--pipeline-parallel-size P` (P worker
processes, cores // P threads each). Decode step time = (wall of 16 output tokens - wall of
1) / 15 for one request; the hop is PP=P minus PP=1 at the same threads per process (one
request's step runs the stages one after the other).
Throughput: that many chat requests at once, EOS ignored, prefix caching off. Medians of
--runs; prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from vllm_actors import LLM, SamplingParams

TOPICS = ["the moon", "volcanoes", "bread", "rivers", "chess", "bees", "glass", "trains"]


def prompts(llm: LLM, n: int) -> list[dict]:
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.apply_chat_template(
        [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}, part {i}."}],
        add_generation_prompt=True)} for i in range(n)]


def decode_ms(llm: LLM, runs: int) -> list[float]:
    prompt = prompts(llm, 1)
    out = []
    for _ in range(runs):
        walls = []
        for tokens in (1, 16):
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            walls.append(time.perf_counter() - start)
        out.append((walls[1] - walls[0]) / 15 * 1000)
    return out


def throughput(llm: LLM, n: int, max_tokens: int, runs: int) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = prompts(llm, n)
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        out.append(n * max_tokens / (time.perf_counter() - start))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    share = max(1, cpus // args.pp)
    results = {}
    for name, pp, threads in (("one", 1, None), ("thin", 1, share), ("pp", args.pp, None)):
        saved = dict(os.environ)
        if threads is not None:     # the worker keeps variables the user set
            for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
                os.environ[var] = str(threads)
        try:
            with LLM(args.model, device=args.device, pipeline_parallel_size=pp,
                     distributed_executor_backend="mp", enable_prefix_caching=False) as llm:
                throughput(llm, 2, 4, 1)                               # warm up
                results[name] = (decode_ms(llm, args.runs),
                                 {n: throughput(llm, n, args.max_tokens, args.runs)
                                  for n in (args.streams if name != "thin" else [])})
        finally:
            os.environ.clear()
            os.environ.update(saved)
    one, thin, other = results["one"], results["thin"], results["pp"]
    med = statistics.median
    print(f"{cpus} CPUs\n")
    print(f"| decode step, 1 request | PP=1, {cpus} threads ms | PP=1, {share} thread(s) ms | "
          f"PP={args.pp} ms | hop cost ms | runs |")
    print("|---|---|---|---|---|---|")
    print(f"| | {med(one[0]):.2f} | {med(thin[0]):.2f} | {med(other[0]):.2f} | "
          f"{med(other[0]) - med(thin[0]):.2f} | "
          f"{', '.join(f'{x:.1f}' for x in one[0])} / "
          f"{', '.join(f'{x:.1f}' for x in thin[0])} / "
          f"{', '.join(f'{x:.1f}' for x in other[0])} |\n")
    print(f"| streams | PP=1 tok/s | PP={args.pp} tok/s | ratio | runs |")
    print("|---|---|---|---|---|")
    for n in args.streams:
        a, b = med(one[1][n]), med(other[1][n])
        print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x | "
              f"{', '.join(f'{x:.0f}' for x in one[1][n])} / "
              f"{', '.join(f'{x:.0f}' for x in other[1][n])} |")


if __name__ == "__main__":
    main()
