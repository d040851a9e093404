"""Load generator for any OpenAI-compatible server: streaming /v1/completions at fixed input and
output lengths, swept over concurrency levels.

    python bench/serving.py --base-url http://127.0.0.1:8000 [--concurrency 1,2,4,8,16,32]
        [--input-len 128] [--output-len 64] [--prompts-per-level 4x] [--model NAME]

Works against `vllm-actors serve` and against `python -m llama_cpp.server` alike: prompts are
text (built from the default model's tokenizer so they are `--input-len` tokens long there) and
every request asks for exactly `--output-len` tokens (`min_tokens` = `max_tokens`, which both
servers accept). Each prompt starts at a different offset of one long text, so no prompt is a
prefix of another. Per level: request throughput, output tok/s (of completed requests), TTFT
and inter-token latency (ITL, gaps between streamed chunks) median and p99, and how many
requests failed. Prints a Markdown table.

llama-cpp-python's server serves one request at a time and by default interrupts a running
stream when the next request arrives; compare against it with `--interrupt_requests False`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


@dataclass
class Result:
    ttft: float
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    usage_tokens: int | None = None   # completion_tokens of the final usage chunk
    latency: float = 0.0
    error: str | None = None


def build_prompts(count: int, input_len: int, tokenizer_model: str | None) -> list[str]:
    from oracle.prompts import LONG_ESSAY
    from vllm_actors.loaders.tokenizer import get_tokenizer
    tok = get_tokenizer(tokenizer_model)
    ids = tok.encode(LONG_ESSAY, add_special_tokens=False)
    ids = ids * (-(-(input_len + 13 * count) // len(ids)))
    return [tok.decode(ids[13 * i:13 * i + input_len]) for i in range(count)]


async def one_request(client: httpx.AsyncClient, model: str | None, prompt: str,
                      output_len: int) -> Result:
    body = {"prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    last = None
    result = Result(ttft=float("nan"))
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                result.usage_tokens = chunk["usage"].get("completion_tokens")
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            result.chunks += 1
    result.latency = time.perf_counter() - start
    return result


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def run_level(base_url: str, api_key: str | None, model: str | None, prompts: list[str],
                    concurrency: int, output_len: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=concurrency + 4)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits,
                                 headers=headers) as client:
        async def limited(prompt: str) -> Result:
            async with sem:
                try:
                    return await one_request(client, model, prompt, output_len)
                except (httpx.HTTPError, RuntimeError) as e:
                    return Result(ttft=float("nan"), error=f"{type(e).__name__}: {e}")
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        elapsed = time.perf_counter() - start
    failed = [r for r in results if r.error]
    for r in failed[:3]:
        print(f"  failed request: {r.error}", file=sys.stderr)
    results = [r for r in results if not r.error]
    if not results:
        raise SystemExit(f"every request at concurrency {concurrency} failed")
    itl = [gap for r in results for gap in r.itl]
    ttft = [r.ttft for r in results]
    # Servers may send several tokens in one chunk (ours merges them when the client lags):
    # count tokens by the usage the server reports, else by what was asked for.
    counted = [r.usage_tokens for r in results]
    reported = all(c is not None for c in counted)
    tokens = sum(counted) if reported else len(results) * output_len
    return {"concurrency": concurrency, "requests": len(results), "failed": len(failed),
            "elapsed_s": elapsed,
            "req_per_s": len(results) / elapsed, "output_tok_per_s": tokens / elapsed,
            "chunks_per_request": statistics.mean(r.chunks for r in results),
            # None when the server sent no usage (then throughput assumes --output-len each)
            "tokens_per_request": tokens / len(results) if reported else None,
            "ttft_median_ms": 1000 * statistics.median(ttft), "ttft_p99_ms": 1000 * pct(ttft, .99),
            "itl_median_ms": 1000 * statistics.median(itl) if itl else float("nan"),
            "itl_p99_ms": 1000 * pct(itl, .99)}


async def main_async(args: argparse.Namespace) -> list[dict[str, float]]:
    rows = []
    for c in args.concurrency:
        count = max(args.min_prompts, args.prompts_per_level * c)
        prompts = build_prompts(count, args.input_len, args.tokenizer_model)
        row = await run_level(args.base_url, args.api_key, args.model, prompts, c,
                              args.output_len)
        print(f"  concurrency {c}: {row['output_tok_per_s']:.1f} output tok/s", file=sys.stderr,
              flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="model name to send (default: none)")
    parser.add_argument("--tokenizer-model", default=None,
                        help="GGUF whose tokenizer sizes the prompts (default: SmolLM2)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-per-level", type=int, default=2,
                        help="requests per level = this x concurrency (at least --min-prompts)")
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    print(f"{args.base_url}: input {args.input_len} tokens, output {args.output_len} tokens")
    print()
    print("| concurrency | requests (failed) | req/s | output tok/s | TTFT median / p99 ms | "
          "ITL median / p99 ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} ({r['failed']}) | {r['req_per_s']:.2f} | "
              f"{r['output_tok_per_s']:.1f} | {r['ttft_median_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
              f"{r['itl_median_ms']:.1f} / {r['itl_p99_ms']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
