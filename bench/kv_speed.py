"""Decode speed and KV memory per KV cache dtype on the compiled CPU backend, side by side.

    python bench/kv_speed.py [--model PATH] [--context 4096] [--batches 1,32] [--runs 3]
                             [--dtypes float32,float16,bfloat16,fp8_e4m3,turboquant_3.5]

One model is loaded once. For each batch size, each round walks the dtypes in turn (rounds
alternate their order; the machine is shared and noisy, medians over rounds are reported):
allocate that dtype's cache for `batch` requests of `context` tokens, write synthetic K/V
rows (unit-normal keys and values, through the backend's own cache write, so the bytes are
real) into every context position, then time decode steps (one new token per request, each
request reading its whole context through its own blocks) with the model's real weights.
The context is synthetic because prefilling 32 x 4k tokens per dtype would take minutes and
decode speed does not depend on what the keys say; attention reads exactly as many bytes.

Printed: KV bytes per token, the largest number of `context`-token requests 8 GiB of KV
holds, and decode tokens/s (requests x steps / time) per dtype, with the ratio to float32.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import numpy as np

from vllm_actors.kernels.cpu.backend import CpuBackend
from vllm_actors.kernels.kv_quant import kv_format
from vllm_actors.kernels.ops import AttentionMetadata
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.registry import load_model

DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "turboquant_2.5",
          "turboquant_3.5", "turboquant_4")
BLOCK = 16
QUOTE_BYTES = 8 << 30


def kv_bytes_per_token(args, name: str) -> int:
    return 2 * args.num_layers * args.num_kv_heads * kv_format(name).row_bytes(args.head_dim)


def _meta(batch: int, lens: np.ndarray, q_len: int, tables: np.ndarray) -> AttentionMetadata:
    """`q_len` new tokens per request at positions lens - q_len .. lens - 1."""
    pos = (lens[:, None] - q_len + np.arange(q_len)[None, :]).reshape(-1)
    rows = np.repeat(np.arange(batch), q_len)
    slots = tables[rows, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
    return AttentionMetadata(query_start_loc=np.arange(batch + 1, dtype=np.int32) * q_len,
                             seq_lens=lens.astype(np.int32), block_tables=tables,
                             slot_mapping=slots, block_size=BLOCK)


def fill(backend: CpuBackend, model, caches: list, batch: int, context: int,
         tables: np.ndarray) -> None:
    """Synthetic K/V in every layer at positions 0..context-1 of every request."""
    a = model.args
    rng = np.random.default_rng(0)
    chunk = 1024
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        meta = _meta(batch, np.full(batch, start + n), n, tables)
        attn = backend.prepare_attention(meta)
        k = rng.standard_normal((batch * n, a.num_kv_heads, a.head_dim)).astype(np.float32)
        v = rng.standard_normal((batch * n, a.num_kv_heads, a.head_dim)).astype(np.float32)
        for cache in caches:
            backend.reshape_and_cache(k, v, cache, attn)


def time_decode(backend: CpuBackend, model, name: str, batch: int, context: int,
                steps: int) -> float:
    """Decode tokens/s of `batch` requests at `context` tokens in a `name` cache."""
    a = model.args
    per_req = -(-(context + steps + 1) // BLOCK)
    tables = (np.arange(batch * per_req, dtype=np.int32) + 1).reshape(batch, per_req)
    caches = backend.allocate_kv_cache(a.num_layers, batch * per_req + 1, BLOCK,
                                       a.num_kv_heads, a.head_dim, kv_format(name))
    fill(backend, model, caches, batch, context, tables)
    ids = np.full(batch, 42, np.int64)
    times = []
    for i in range(steps + 1):          # the first step is a warm-up (compiles on first use)
        lens = np.full(batch, context + i + 1)
        meta = _meta(batch, lens, 1, tables)
        start = time.perf_counter()
        hidden = model.forward(ids, lens - 1, meta, caches)
        model.compute_logits(hidden, np.arange(batch))
        times.append(time.perf_counter() - start)
    del caches
    gc.collect()
    return batch / statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    dtypes = opts.dtypes.split(",")
    backend = CpuBackend()
    model = load_model(resolve_model(opts.model), backend)
    a = model.args
    print(f"model {resolve_model(opts.model).path.name}: {a.num_layers} layers, "
          f"{a.num_kv_heads} KV heads of {a.head_dim}; context {opts.context}")
    rates: dict[tuple[int, str], list[float]] = {}
    for batch in (int(b) for b in opts.batches.split(",")):
        for run in range(opts.runs):
            for name in (dtypes if run % 2 == 0 else dtypes[::-1]):
                rate = time_decode(backend, model, name, batch, opts.context, opts.steps)
                rates.setdefault((batch, name), []).append(rate)
                print(f"  batch {batch} run {run} {name}: {rate:.1f} tok/s", flush=True)
    base_bytes = kv_bytes_per_token(a, "float32")
    batches = sorted({b for b, _ in rates})
    head = " | ".join(f"batch {b} tok/s (x float32)" for b in batches)
    print(f"\n| dtype | KV bytes/token | x smaller | {opts.context}-token requests in 8 GiB | "
          f"{head} |")
    print("|---|---|---|---|" + "---|" * len(batches))
    results = []
    for name in dtypes:
        per_token = kv_bytes_per_token(a, name)
        fits = QUOTE_BYTES // (per_token * opts.context)
        cells = []
        row = {"dtype": name, "kv_bytes_per_token": per_token, "requests_in_8gib": fits}
        for b in batches:
            med = statistics.median(rates[(b, name)])
            base = statistics.median(rates[(b, "float32")]) if (b, "float32") in rates else med
            cells.append(f"{med:.1f} ({med / base:.2f}x)")
            row[f"batch_{b}_tok_s"] = med
        print(f"| {name} | {per_token} | {base_bytes / per_token:.2f} | {fits} | "
              f"{' | '.join(cells)} |")
        results.append(row)
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump({"context": opts.context, "runs": opts.runs, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
