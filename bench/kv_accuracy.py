"""Accuracy of the quantized KV cache formats (`--kv-cache-dtype`) against the float32 cache:
mean and max KL divergence of the next-token distributions, top-1 agreement and the change of
perplexity, per model and format, with the KV bytes per token.

    python bench/kv_accuracy.py [--models smollm2,gemma3-270m] [--dtypes float16,fp8,...]
        [--num-prompts 20] [--max-tokens 4000] [--device cpu] [--json PATH]

Every prompt is run as a chunked prefill (`--chunk` tokens a step, so later chunks read the
earlier chunks' KV back from the cache, and within a chunk KV is written before it is
attended: every position sees quantized KV) once per format, the formats in lockstep, and the
log-softmax of every position is compared with the float32 cache's (float64 arithmetic):
KL(p_float32 || p_dtype) per position (mean over all positions of all prompts, and max),
top-1 agreement (same argmax), and the perplexity of the prompts' own next tokens, reported as
the relative change against float32.

Prompts (fixed, no network): text that ships with Python 3.11, alternately English prose
(the reference manual's topics in `pydoc_data.topics`, sorted by name) and code (the larger
top-level modules of the standard library, sorted by file name), cut to token lengths spread
evenly from 500 to `--max-tokens` (at most 4,000). The same text for every model; the SHA-256
of the prompt texts is printed so runs can be matched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vllm_actors.kernels import get_backend
from vllm_actors.kernels.kv_quant import kv_format
from vllm_actors.kernels.ops import AttentionMetadata
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.loaders.tokenizer import load_tokenizer
from vllm_actors.models.registry import load_model

DEFAULT_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "turboquant_2",
                  "turboquant_2.5", "turboquant_3", "turboquant_3.5", "turboquant_4")
MIN_TOKENS, MAX_TOKENS = 500, 4000
CODE_MIN_BYTES = 20_000           # stdlib modules large enough to be mostly code


# -- prompts -------------------------------------------------------------------------------
def prose_texts() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics
    return [(f"pydoc_data.topics[{key!r}]", topics[key]) for key in sorted(topics)]


def code_texts() -> list[tuple[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py")
                   if p.stat().st_size >= CODE_MIN_BYTES and not p.name.startswith("_"))
    return [(f"Lib/{p.name}", p.read_text(encoding="utf-8")) for p in files]


def prompt_texts(count: int) -> list[tuple[str, str]]:
    """`count` (source, text) pairs, prose and code alternately. Prompt k of a kind starts at
    source round(k * n / count_of_kind) of that kind's sorted list and runs on into the next
    sources (so there is always enough text); 64,000 characters at most."""
    kinds = [prose_texts(), code_texts()]
    counts = [(count + 1) // 2, count // 2]
    out = []
    for i in range(count):
        sources, k = kinds[i % 2], i // 2
        first = round(k * len(sources) / counts[i % 2])
        parts, size, j = [], 0, first
        while size < 64_000 and j < first + len(sources):
            parts.append(sources[j % len(sources)][1])
            size += len(parts[-1]) + 2
            j += 1
        out.append((sources[first][0], "\n\n".join(parts)[:64_000]))
    return out


def target_lengths(count: int, max_tokens: int) -> list[int]:
    hi = min(MAX_TOKENS, max_tokens)
    lo = min(MIN_TOKENS, hi)
    return [round(float(x)) for x in np.linspace(lo, hi, count)]


def build_prompts(tokenizer, texts: list[tuple[str, str]], lengths: list[int]) -> list[dict]:
    prompts = []
    for (source, text), n in zip(texts, lengths):
        chars = 8 * n + 1000
        ids = tokenizer.encode(text[:chars])
        while len(ids) < n and chars < len(text):
            chars *= 2
            ids = tokenizer.encode(text[:chars])
        if len(ids) < n:
            raise SystemExit(f"prompt from {source}: only {len(ids)} tokens, wanted {n}")
        prompts.append({"source": source, "ids": ids[:n]})
    return prompts


# -- the driver ----------------------------------------------------------------------------
def log_softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


@dataclass
class Stats:
    """Sums over positions of one format (the reference: only `nll`)."""

    kl_sum: float = 0.0
    kl_max: float = 0.0
    agree: int = 0
    positions: int = 0
    nll: float = 0.0
    targets: int = 0
    prompt_kl: list = field(default_factory=list)   # mean KL per prompt

    def ppl(self) -> float:
        return math.exp(self.nll / max(self.targets, 1))


def run_prompt(model, backend, ids: list[int], formats: dict, stats: dict[str, Stats],
               ref: Stats, chunk: int, block_size: int) -> None:
    """One prompt through a float32 cache and one cache per format, chunk by chunk; the
    statistics of every position are added to `stats` (and the float32 NLL to `ref`)."""
    args = getattr(model, "local_args", model.args)
    n = len(ids)
    num_blocks = -(-n // block_size)
    shape = (args.num_layers, num_blocks + 1, block_size, args.num_kv_heads, args.head_dim)
    caches = {None: backend.allocate_kv_cache(*shape)}         # the backend's own float32
    for name, fmt in formats.items():
        caches[name] = backend.allocate_kv_cache(*shape, kv_format=fmt)
    # blocks handed out in a scrambled order, as the engine's block pool may
    table = (np.arange(num_blocks, dtype=np.int32)[::-1] + 1)[None, :]
    token_ids = np.asarray(ids, np.int64)
    before = {name: (s.kl_sum, s.positions) for name, s in stats.items()}
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        pos = np.arange(start, start + m)
        meta = AttentionMetadata(
            query_start_loc=np.array([0, m], np.int32),
            seq_lens=np.array([start + m], np.int32), block_tables=table,
            slot_mapping=(table[0][pos // block_size].astype(np.int64) * block_size
                          + pos % block_size),
            block_size=block_size)
        hidden = {name: model.forward(token_ids[start:start + m], pos, meta, kv)
                  for name, kv in caches.items()}
        rows_per = max(1, (1 << 22) // args.vocab_size)   # bounds the [rows, V] float64 arrays
        for r0 in range(0, m, rows_per):
            rows = np.arange(r0, min(r0 + rows_per, m))
            nxt = start + rows + 1
            has_target = nxt < n
            target = token_ids[nxt[has_target]]
            lp = log_softmax64(model.compute_logits(hidden[None], rows))
            p = np.exp(lp)
            top = lp.argmax(axis=1)
            ref.nll -= float(lp[has_target, :][np.arange(len(target)), target].sum())
            ref.targets += len(target)
            for name in formats:
                lq = log_softmax64(model.compute_logits(hidden[name], rows))
                kl = np.maximum((p * (lp - lq)).sum(axis=1), 0.0)
                s = stats[name]
                s.kl_sum += float(kl.sum())
                s.kl_max = max(s.kl_max, float(kl.max()))
                s.agree += int((lq.argmax(axis=1) == top).sum())
                s.positions += len(rows)
                s.nll -= float(lq[has_target, :][np.arange(len(target)), target].sum())
                s.targets += len(target)
    for name, s in stats.items():
        kl0, pos0 = before[name]
        s.prompt_kl.append((s.kl_sum - kl0) / max(s.positions - pos0, 1))


def bytes_per_token(fmt, args) -> int:
    return fmt.row_bytes(args.head_dim) * 2 * args.num_kv_heads * args.num_layers


def measure_model(model_name: str, dtypes: list[str], opts) -> dict:
    source = resolve_model(model_name)
    backend = get_backend(opts.device)
    model = load_model(source, backend)
    args = model.args
    tokenizer = load_tokenizer(source)
    lengths = target_lengths(opts.num_prompts, opts.max_tokens)
    texts = prompt_texts(opts.num_prompts)
    digest = hashlib.sha256("\0".join(t for _, t in texts).encode()).hexdigest()[:16]
    prompts = build_prompts(tokenizer, texts, lengths)
    print(f"\n{model_name} ({source.path.name}): {args.num_layers} layers, "
          f"{args.num_kv_heads} KV heads x {args.head_dim}, vocabulary {args.vocab_size}; "
          f"{len(prompts)} prompts (texts sha256 {digest}), tokens: "
          f"{', '.join(str(len(p['ids'])) for p in prompts)}", flush=True)
    formats = {name: kv_format(name) for name in dtypes if kv_format(name).name != "float32"}
    stats = {name: Stats() for name in formats}
    ref = Stats()
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        run_prompt(model, backend, prompt["ids"], formats, stats, ref, opts.chunk,
                   opts.block_size)
        print(f"  prompt {i + 1}/{len(prompts)} ({len(prompt['ids'])} tokens, "
              f"{prompt['source']}): {time.perf_counter() - t0:.1f} s", flush=True)
    seconds = time.perf_counter() - started
    f32_bytes = bytes_per_token(kv_format("float32"), args)
    rows = []
    for name in dtypes:
        fmt = kv_format(name)
        s = stats.get(name)
        size = bytes_per_token(fmt, args)
        row = {"dtype": name, "format": fmt.name, "bytes_per_token": size,
               "times_smaller": f32_bytes / size}
        if s is None:       # the float32 cache is the reference itself
            row.update(mean_kl=0.0, max_kl=0.0, top1_agreement=1.0, ppl=ref.ppl(),
                       ppl_change=0.0, prompt_mean_kl=[0.0] * len(prompts), positions=0)
        else:
            row.update(mean_kl=s.kl_sum / max(s.positions, 1), max_kl=s.kl_max,
                       top1_agreement=s.agree / max(s.positions, 1), ppl=s.ppl(),
                       ppl_change=s.ppl() / ref.ppl() - 1.0, prompt_mean_kl=s.prompt_kl,
                       positions=s.positions)
        rows.append(row)
    return {"model": model_name, "path": str(source.path), "num_layers": args.num_layers,
            "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
            "vocab_size": args.vocab_size, "texts_sha256": digest,
            "prompts": [{"source": p["source"], "tokens": len(p["ids"])} for p in prompts],
            "float32_ppl": ref.ppl(), "positions": sum(len(p["ids"]) for p in prompts),
            "seconds": seconds, "rows": rows}


def table(result: dict) -> str:
    lines = [(f"{result['model']}: {len(result['prompts'])} prompts, {result['positions']} "
              f"positions, float32 perplexity {result['float32_ppl']:.3f}"),
             "",
             "| dtype | bytes/token | x smaller | mean KL | max KL | top-1 agree | PPL change |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        reference = r["format"] == "float32"
        lines.append(
            f"| {r['dtype']} | {r['bytes_per_token']:,} | {r['times_smaller']:.2f}x | "
            + ("(reference) | | | |" if reference else
               f"{r['mean_kl']:.2e} | {r['max_kl']:.2e} | {100 * r['top1_agreement']:.2f} % | "
               f"{100 * r['ppl_change']:+.3f} % |"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3-270m",
                        help="comma-separated: pulled model names or GGUF paths")
    parser.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES),
                        help="comma-separated --kv-cache-dtype names")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                        help="longest prompt (lengths run evenly from 500, or this if less)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="backend: cpu or numpy")
    parser.add_argument("--json", default=None, help="write the results here")
    opts = parser.parse_args()
    dtypes = [d for d in opts.dtypes.split(",") if d]
    for name in dtypes:
        try:
            kv_format(name)
        except ValueError as e:
            parser.error(str(e))
    if opts.num_prompts < 1 or opts.max_tokens < 2 or opts.chunk < 1:
        parser.error("--num-prompts, --chunk >= 1 and --max-tokens >= 2")
    command = "python bench/kv_accuracy.py " + " ".join(sys.argv[1:])
    print(f"Command: `{command}` (device {opts.device}, chunks of {opts.chunk}, "
          f"Python {sys.version.split()[0]})", flush=True)
    results = []
    for name in [m for m in opts.models.split(",") if m]:
        results.append(measure_model(name, dtypes, opts))
        print(f"  {results[-1]['seconds']:.1f} s\n\n{table(results[-1])}", flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(
            {"command": command, "device": opts.device, "chunk": opts.chunk,
             "block_size": opts.block_size, "python": sys.version.split()[0],
             "results": results}, indent=1))


if __name__ == "__main__":
    main()
