"""Single-stream numbers for the default model: load time, time to first token, decode tok/s.

    python bench/single_stream.py [--model PATH] [--runs 5]

Medians over --runs repetitions (these machines are shared and noisy). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from vllm_actors import LLM, SamplingParams  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=128)
    args = parser.parse_args()

    load_s = [timed(lambda: LLM(args.model)) for _ in range(args.runs)]
    llm = LLM(args.model)
    from oracle.prompts import LONG_ESSAY
    short = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)
    long = llm.get_tokenizer().encode(LONG_ESSAY)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    ttft_short = [timed(lambda: llm.generate({"prompt_token_ids": short}, one))
                  for _ in range(args.runs)]
    ttft_long = [timed(lambda: llm.generate({"prompt_token_ids": long}, one))
                 for _ in range(args.runs)]
    n = args.decode_tokens
    many = SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True)
    decode = []
    for _ in range(args.runs):
        total = timed(lambda: llm.generate({"prompt_token_ids": short}, many))
        decode.append(n / (total - statistics.median(ttft_short)))

    med = statistics.median
    print(f"| metric | median of {args.runs} | runs |")
    print("|---|---|---|")
    print(f"| model load (LLM construction) | {med(load_s):.2f} s | "
          f"{', '.join(f'{x:.2f}' for x in load_s)} |")
    print(f"| TTFT, {len(short)}-token chat prompt | {med(ttft_short) * 1000:.0f} ms | "
          f"{', '.join(f'{x * 1000:.0f}' for x in ttft_short)} |")
    print(f"| TTFT, {len(long)}-token prompt | {med(ttft_long) * 1000:.0f} ms "
          f"({len(long) / med(ttft_long):.0f} prompt tok/s) | "
          f"{', '.join(f'{x * 1000:.0f}' for x in ttft_long)} |")
    print(f"| decode, 1 stream, {n} tokens | {med(decode):.1f} tok/s | "
          f"{', '.join(f'{x:.1f}' for x in decode)} |")


if __name__ == "__main__":
    main()
