"""Speculative decoding side by side with plain decoding on one machine: single-stream decode
tok/s of each method on three workloads (a summary that quotes its input, a code edit that
rewrites a given function, free chat), mean accepted length and acceptance by draft position,
and batch-32 throughput with speculation on and off.

    python bench/spec_decode.py [--model PATH] [--runs 3] [--methods ngram,suffix,draft_model]

Every engine is started once and the runs alternate between them (the machine is shared and
noisy; medians are reported). Greedy decoding, so every method must give the plain engine's
tokens: the script checks it. The draft model is the target without 8 of its layers
(`bench/draft_gguf.py`); no smaller model with SmolLM2's vocabulary ships on PyPI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import draft_gguf  # noqa: E402

from vllm_actors import LLM, SamplingParams  # noqa: E402

DRAFT_SKIP = [4, 7, 10, 13, 16, 19, 22, 25]
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def workloads() -> dict[str, list[dict]]:
    from oracle.prompts import LONG_CODE, LONG_ESSAY
    function = LONG_CODE[LONG_CODE.index("    def run("):LONG_CODE.index("    def pending")]
    return {
        "quote": [{"role": "user", "content": "Summarize the text below. Quote its two most "
                   "important sentences word for word.\n\n" + LONG_ESSAY[:1600]}],
        "code_edit": [{"role": "user", "content": "Rewrite this method so that the variable "
                       "`count` is called `done`. Output the whole method.\n\n```python\n"
                       + function + "```"}],
        "chat": [{"role": "user", "content": "Write a short story about a dragon who learns "
                  "to bake bread."}],
    }


def configs(methods: list[str], k: int, draft_path: str | None,
            disable_by_batch_size: int | None) -> dict[str, dict | None]:
    extra = {} if disable_by_batch_size is None else \
        {"disable_by_batch_size": disable_by_batch_size}
    known = {"ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 5, **extra},
             "suffix": {"method": "suffix", "num_speculative_tokens": 2 * k, **extra},
             "draft_model": {"method": "draft_model", "model": draft_path,
                             "num_speculative_tokens": 3, **extra}}
    return {"none": None, **{m: known[m] for m in methods}}


def decode_rate(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(decode tok/s after the first token, the tokens): one run of max_tokens and one of 1."""
    first = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, first, use_tqdm=False)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    total = time.perf_counter() - start
    tokens = out[0].outputs[0].token_ids
    return (len(tokens) - 1) / max(total - ttft, 1e-9), tokens


def batch_rate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def spec_counts(llm: LLM) -> dict[str, float]:
    metrics = llm.get_metrics()
    return {name: metrics.get(name, 0) for name in SPEC_COUNTERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--methods", default="ngram,suffix,draft_model")
    parser.add_argument("--k", type=int, default=8, help="drafts per step (suffix: 2k; "
                                                         "draft_model: 3)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    from vllm_actors.loaders.model_files import default_model_path
    model = args.model or str(default_model_path())
    tmp = tempfile.mkdtemp(prefix="spec-bench-")
    methods = args.methods.split(",") if args.methods else []
    draft = str(draft_gguf.write_draft(model, Path(tmp) / "draft.gguf", DRAFT_SKIP)) \
        if "draft_model" in methods else None
    engines = {name: LLM(model, speculative_config=config, kv_cache_memory=1 << 30)
               for name, config in configs(methods, args.k, draft,
                                           args.disable_by_batch_size).items()}
    tok = engines["none"].get_tokenizer()
    prompts = {name: tok.apply_chat_template(msgs, add_generation_prompt=True)
               for name, msgs in workloads().items()}
    batch = [prompts[name] for name in list(prompts) * args.batch][:args.batch]
    rates: dict = {e: {w: [] for w in [*prompts, "batch"]} for e in engines}
    accept: dict = {e: {w: [] for w in prompts} for e in engines}
    tokens: dict = {}
    warm = SamplingParams(temperature=0.0, max_tokens=24)
    for llm in engines.values():   # untimed: kernels of every step shape compiled or loaded
        llm.generate([{"prompt_token_ids": p} for p in [*prompts.values(), *batch[:8]]], warm,
                     use_tqdm=False)
    for _ in range(args.runs):
        for workload, prompt in prompts.items():
            for name, llm in engines.items():
                before = spec_counts(llm)
                rate, out = decode_rate(llm, prompt, args.max_tokens)
                after = spec_counts(llm)
                rates[name][workload].append(rate)
                accept[name][workload].append({k: after[k] - before[k] for k in after})
                tokens.setdefault((name, workload), out)
        for name, llm in engines.items():
            rate, out = batch_rate(llm, batch, args.batch_max_tokens)
            rates[name]["batch"].append(rate)
            tokens.setdefault((name, "batch"), out)
    results = report(engines, prompts, rates, accept, tokens)
    for llm in engines.values():
        llm.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def report(engines: dict, prompts: dict, rates: dict, accept: dict, tokens: dict) -> list:
    rows = []
    print("| method | workload | decode tok/s (median) | vs none | mean accepted length | "
          "acceptance | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for workload in [*prompts, "batch"]:
        base = statistics.median(rates["none"][workload])
        for name in engines:
            median = statistics.median(rates[name][workload])
            same = tokens[(name, workload)] == tokens[("none", workload)]
            counts = accept[name].get(workload, [])
            drafts = sum(c["vllm:spec_decode_num_drafts"] for c in counts)
            drafted = sum(c["vllm:spec_decode_num_draft_tokens"] for c in counts)
            taken = sum(c["vllm:spec_decode_num_accepted_tokens"] for c in counts)
            length = f"{1 + taken / drafts:.2f}" if drafts else "-"
            rate = f"{taken / drafted:.2f}" if drafted else "-"
            print(f"| {name} | {workload} | {median:.1f} | {median / base:.2f}x | {length} | "
                  f"{rate} | {same} |")
            rows.append({"method": name, "workload": workload, "tok_s": rates[name][workload],
                         "ratio": median / base, "mean_accepted_length": length,
                         "acceptance": rate, "same_tokens": same})
    return rows


if __name__ == "__main__":
    main()
