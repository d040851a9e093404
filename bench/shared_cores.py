"""Single-stream decode when another process keeps the cores busy: each backend alone and
beside `--competitors` busy processes (pure-Python spin loops, one core each), alternating.

    python bench/shared_cores.py [--devices cpu,numpy] [--competitors 1] [--runs 3]

Why: a kernel pool whose threads spin-wait, or splits work statically, stalls whenever the OS
runs the competitor on one of its cores (OpenBLAS under numpy measured 1.3-1.9 tok/s beside a
busy engine, against ~50 alone). Each backend's engine runs in its own process (the default
LLM setup), prefix caching off. Prints a Markdown table of medians with the runs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

from vllm_actors import LLM, SamplingParams

PROMPT = [504, 3575, 282, 4649, 314] * 8


def _spin() -> None:
    while True:
        pass


def decode_rate(llm: LLM, tokens: int) -> float:
    one = SamplingParams(temperature=0.0, max_tokens=1)
    many = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": PROMPT}, one)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": PROMPT}, many)
    return tokens / (time.perf_counter() - start - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--devices", default="cpu,numpy")
    parser.add_argument("--competitors", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()

    engines = {d: LLM(args.model, device=d, enable_prefix_caching=False, max_model_len=512)
               for d in args.devices.split(",")}
    results: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.runs):
        for busy in (False, True):
            spinners = [multiprocessing.Process(target=_spin, daemon=True)
                        for _ in range(args.competitors if busy else 0)]
            for p in spinners:
                p.start()
            try:
                for device, llm in engines.items():
                    decode_rate(llm, 8)   # warm
                    results.setdefault((device, busy), []).append(
                        decode_rate(llm, args.decode_tokens))
            finally:
                for p in spinners:
                    p.kill()
                    p.join()
    print(f"| backend | alone, tok/s | beside {args.competitors} busy process(es), tok/s | "
          "runs (alone; busy) |")
    print("|---|---|---|---|")
    for device in engines:
        alone, busy = results[(device, False)], results[(device, True)]
        print(f"| {device} | {statistics.median(alone):.1f} | {statistics.median(busy):.1f} | "
              f"{', '.join(f'{x:.1f}' for x in alone)}; "
              f"{', '.join(f'{x:.1f}' for x in busy)} |")


if __name__ == "__main__":
    main()
