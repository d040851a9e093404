"""Single-stream decode when another process keeps the cores busy: each backend alone and
beside `--competitors` busy processes (pure-Python spin loops, one core each), alternating.

    python bench/shared_cores.py [--devices cpu,numpy] [--competitors 1] [--runs 3]

Why: a kernel pool whose threads spin-wait, or splits work statically, stalls whenever the OS
runs the competitor on one of its cores (OpenBLAS under numpy measured 1.3-1.9 tok/s beside a
busy engine, against ~50 alone). Each backend's engine runs in its own process (the default
LLM setup), prefix caching off. Prints a Markdown table of medians with the runs, and
whether every run of a backend gave the same greedy tokens: its thread count follows the
load (`threads.LoadFollower`), which must change no token. Exits 1 if they differ.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time

from vllm_actors import LLM, SamplingParams
from vllm_actors.sampling_params import RequestOutputKind

PROMPT = [504, 3575, 282, 4649, 314] * 8


def _spin() -> None:
    while True:
        pass


async def _decode_rate(llm: LLM, tokens: int) -> tuple[float, list[int]]:
    """Tokens per second from the first streamed token to the last (prefill excluded by
    timing inside one request, so a slow prefill under load cannot skew it), and the
    tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    first = last = 0.0
    after_first = 0
    ids: list[int] = []
    async for out in llm.engine.generate({"prompt_token_ids": PROMPT}, params):
        now = time.perf_counter()
        ids += out.outputs[0].token_ids
        n = len(out.outputs[0].token_ids)
        if not first:
            first, after_first = now, n - 1
        else:
            after_first += n
        last = now
    return after_first / (last - first), ids


def decode_rate(llm: LLM, tokens: int) -> tuple[float, list[int]]:
    return llm._run(_decode_rate(llm, tokens))


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
    tokens: dict[str, set[tuple[int, ...]]] = {}
    for _ in range(args.runs):
        for busy in (False, True):
            spinners = [multiprocessing.Process(target=_spin, daemon=True)
                        for _ in range(args.competitors if busy else 0)]
            for p in spinners:
                p.start()
            try:
                for device, llm in engines.items():
                    decode_rate(llm, 8)   # warm
                    rate, ids = decode_rate(llm, args.decode_tokens)
                    results.setdefault((device, busy), []).append(rate)
                    tokens.setdefault(device, set()).add(tuple(ids))
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
    for device, seen in tokens.items():
        print(f"- {device}: the greedy tokens of all {2 * args.runs} runs (alone and busy) "
              + ("identical" if len(seen) == 1 else f"DIFFER: {len(seen)} distinct sequences"))
    if any(len(seen) != 1 for seen in tokens.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
