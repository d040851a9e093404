"""Data parallel on one machine's CPU: N engine cores with their share of the cores each
against one engine core using all of them, same prompts, same run.

    python bench/data_parallel.py [--dp 2] [--streams 1 4 16 64] [--max-tokens 32] [--runs 3]

For each number of concurrent streams, every configuration generates that many requests at
once (distinct chat prompts of about 40-60 tokens, EOS ignored so each yields exactly
--max-tokens tokens) and the output tokens per second are timed; the engines are started
one after the other (never both at once, they would share the cores). Prefix caching is off
so that repeated runs measure the same work. Medians over --runs; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from vllm_actors import LLM, SamplingParams

TOPICS = ["the moon", "volcanoes", "bread", "rivers", "chess", "bees", "glass", "trains",
          "clouds", "copper", "owls", "tides", "paper", "salt", "maps", "bridges"]


def prompts(llm: LLM, n: int) -> list[dict]:
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.apply_chat_template(
        [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}, part {i}."}],
        add_generation_prompt=True)} for i in range(n)]


def measure(llm: LLM, streams: list[int], max_tokens: int, runs: int) -> dict[int, list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts(llm, 2), params, use_tqdm=False)          # warm up
    rates: dict[int, list[float]] = {}
    for n in streams:
        batch = prompts(llm, n)
        for _ in range(runs):
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            rates.setdefault(n, []).append(n * max_tokens / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    configs = [(f"DP=1, {cpus} threads", 1), (f"DP={args.dp}, {max(1, cpus // args.dp)} "
                                              f"thread(s) each", args.dp)]
    results = {}
    for name, dp in configs:
        start = time.perf_counter()
        with LLM(args.model, device=args.device, data_parallel_size=dp,
                 enable_prefix_caching=False) as llm:
            ready_s = time.perf_counter() - start
            results[name] = (ready_s, measure(llm, args.streams, args.max_tokens, args.runs))
    (one, (one_ready, base)), (many, (many_ready, rates)) = results.items()
    print(f"{cpus} CPUs; engine ready in {one_ready:.1f} s ({one}) and {many_ready:.1f} s "
          f"({many})\n")
    print(f"| streams | {one} tok/s | {many} tok/s | ratio | runs ({one} / {many}) |")
    print("|---|---|---|---|---|")
    for n in args.streams:
        a, b = statistics.median(base[n]), statistics.median(rates[n])
        print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x | "
              f"{', '.join(f'{x:.0f}' for x in base[n])} / "
              f"{', '.join(f'{x:.0f}' for x in rates[n])} |")


if __name__ == "__main__":
    main()
