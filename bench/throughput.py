"""Offline throughput of `LLM.generate` on many prompts at once against a loop that submits
them one at a time, same engine, same run.

    python bench/throughput.py [--num-prompts 64] [--max-tokens 32] [--runs 3]

Prompts are chat questions (about 40-60 tokens); generation ignores EOS so every request
produces exactly --max-tokens tokens. Medians over --runs; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

from vllm_actors import LLM, SamplingParams

TOPICS = ["the moon", "volcanoes", "bread", "rivers", "chess", "bees", "glass", "trains",
          "clouds", "copper", "owls", "tides", "paper", "salt", "maps", "bridges"]


def prompts(llm: LLM, n: int) -> list[dict]:
    tok = llm.get_tokenizer()
    out = []
    for i in range(n):
        question = f"Tell me three facts about {TOPICS[i % len(TOPICS)]}, number {i}."
        ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                      add_generation_prompt=True)
        out.append({"prompt_token_ids": ids})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, enable_prefix_caching=False)
    batch = prompts(llm, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    total_tokens = args.num_prompts * args.max_tokens
    batched, single = [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        batched.append(total_tokens / (time.perf_counter() - start))
        start = time.perf_counter()
        for p in batch:
            llm.generate(p, params, use_tqdm=False)
        single.append(total_tokens / (time.perf_counter() - start))
    b, s = statistics.median(batched), statistics.median(single)
    print(f"| mode | output tok/s (median of {args.runs}) | runs |")
    print("|---|---|---|")
    print(f"| {args.num_prompts} prompts in one generate() | {b:.1f} | "
          f"{', '.join(f'{x:.1f}' for x in batched)} |")
    print(f"| one prompt at a time | {s:.1f} | {', '.join(f'{x:.1f}' for x in single)} |")
    print(f"| ratio | {b / s:.2f}x | |")


if __name__ == "__main__":
    main()
