"""Paged attention of the compiled CPU backend (kernels/cpu/attention) against the numpy
backend's, per layer call: prepare + KV write + attention, in ms, medians over --runs runs of
--iters calls each. Prints a Markdown table.

    python bench/cpu_attention.py [--runs 7] [--iters 5] [--layers 1] [--threads N]
                                  [--only SUBSTRING]

`--layers N` gives each call the next of N caches in turn, as a model's layers do: with N large
enough that N caches exceed the last-level cache, decode reads K/V from memory, as it does in a
real model (one layer's cache alone may stay cache-resident across repeated calls).

Shapes: SmolLM2-135M (H=9, Hk=3, Dh=64) and an 8B shape (H=32, Hk=8, Dh=128), block size 16.
The numpy backend has only a float32 cache, so its column is the same for both of our cache
dtypes. Ours uses every core (numba threads); numpy is timed with its BLAS on every core and
on one, and the better is shown ("(1T)" when one thread won: BLAS threads that busy-wait lose
badly on a machine shared with other processes). Our variants are timed in interleaved runs,
numpy in passes of its own; OMP_WAIT_POLICY defaults to PASSIVE (see below).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

# numba's OpenMP threads sleep when idle instead of spinning: on a machine shared with other
# processes a spinning waiter delays the very thread it waits for (10-100x slower calls).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
from threadpoolctl import threadpool_limits

from vllm_actors.kernels.cpu import attention as cpu
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.kernels.ops import AttentionMetadata

SMOL = {"heads": 9, "kv_heads": 3, "head_dim": 64}
BIG = {"heads": 32, "kv_heads": 8, "head_dim": 128}
BLOCK = 16

# name, shape, query tokens per request, cached tokens per request
CASES = [
    ("decode b1 ctx 128", SMOL, [1], [127]),
    ("decode b1 ctx 1024", SMOL, [1], [1023]),
    ("decode b1 ctx 4096", SMOL, [1], [4095]),
    ("decode b32 ctx 256", SMOL, [1] * 32, [255] * 32),
    ("decode b32 ctx 1024", SMOL, [1] * 32, [1023] * 32),
    ("prefill 512", SMOL, [512], [0]),
    ("prefill 512 after 1536", SMOL, [512], [1536]),
    ("8B decode b1 ctx 4096", BIG, [1], [4095]),
]


def metadata(q_lens: list[int], cached: list[int], rng: np.random.Generator
             ) -> tuple[AttentionMetadata, int]:
    """Shuffled block tables; returns the metadata and the number of blocks used (+ null)."""
    seq = np.array(cached) + np.array(q_lens)
    nblocks = -(-seq // BLOCK)
    ids = rng.permutation(np.arange(1, int(nblocks.sum()) + 1))
    tables = np.zeros((len(seq), int(nblocks.max())), np.int32)
    starts = np.cumsum(nblocks) - nblocks
    for b, (s, n) in enumerate(zip(starts, nblocks)):
        tables[b, :n] = ids[s:s + n]
    slots = np.concatenate([tables[b, pos // BLOCK] * BLOCK + pos % BLOCK
                            for b, pos in enumerate(np.arange(c, c + n)
                                                    for c, n in zip(cached, q_lens))])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return AttentionMetadata(qsl, seq.astype(np.int32), tables, slots.astype(np.int64),
                             BLOCK), int(nblocks.sum()) + 1


def timed(calls: dict[str, Callable[[], None]], runs: int, iters: int) -> dict[str, float]:
    """Median ms per call of each callable; runs interleave the callables so that a noisy
    neighbour slows all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(runs):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter() - t0) / iters)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def bench_case(shape: dict, q_lens: list[int], cached: list[int], runs: int, iters: int,
               layers: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    h, hk, dh = shape["heads"], shape["kv_heads"], shape["head_dim"]
    meta, num_blocks = metadata(q_lens, cached, rng)
    tokens = int(sum(q_lens))
    qkv = rng.standard_normal((tokens, (h + 2 * hk) * dh), dtype=np.float32)
    q = qkv[:, :h * dh].reshape(tokens, h, dh)
    k = qkv[:, h * dh:(h + hk) * dh].reshape(tokens, hk, dh)
    v = qkv[:, (h + hk) * dh:].reshape(tokens, hk, dh)
    scale = dh ** -0.5
    turn = iter(range(1 << 62))
    calls: dict[str, Callable[[], None]] = {}

    backend = NumpyBackend()
    np_caches = backend.allocate_kv_cache(layers, num_blocks, BLOCK, hk, dh)
    for np_cache in np_caches:
        for part in np_cache:
            part[...] = rng.standard_normal(part.shape, dtype=np.float32)

    def numpy_call() -> None:
        np_cache = np_caches[next(turn) % layers]
        attn = backend.prepare_attention(meta)
        backend.reshape_and_cache(k, v, np_cache, attn)
        backend.paged_attention(q, np_cache, attn, scale)

    for dtype in ("float32", "float16"):
        caches = cpu.allocate_kv_cache(layers, num_blocks, BLOCK, hk, dh, dtype)
        for cache, np_cache in zip(caches, np_caches):
            for part, ref in zip(cache, np_cache):
                part[...] = ref if dtype == "float32" else ref.astype(np.float16).view(np.uint16)
        out = np.empty((tokens, h, dh), np.float32)
        attn = cpu.prepare(meta)
        for cache in caches:
            cpu.write_kv(k, v, cache, attn)

        def ours_call(caches=caches, out=out) -> None:
            cache = caches[next(turn) % layers]
            step = cpu.prepare(meta)
            cpu.write_kv(k, v, cache, step)
            cpu.paged_attention(q, cache, step, scale, out)

        def attention_only(caches=caches, out=out, attn=attn) -> None:
            cpu.paged_attention(q, caches[next(turn) % layers], attn, scale, out)

        calls[dtype] = ours_call
        calls[dtype + " attn"] = attention_only
    # ours first, with BLAS held to one thread (no BLAS threads left spinning from numpy's
    # calls to compete with ours); then numpy alone, on one BLAS thread and on all
    with threadpool_limits(1, user_api="blas"):
        times = timed(calls, runs, iters)
        times["numpy 1 thread"] = timed({"numpy": numpy_call}, runs, iters)["numpy"]
    times["numpy"] = timed({"numpy": numpy_call}, runs, iters)["numpy"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--layers", type=int, default=1, help="caches cycled through")
    parser.add_argument("--threads", type=int, default=None, help="numba threads")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    if args.threads:
        import numba
        numba.set_num_threads(args.threads)
    print("| case | numpy (ms) | ours f32 (ms) | x | ours f16 (ms) | x "
          "| attention only f32 / f16 (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, shape, q_lens, cached in CASES:
        if args.only not in name:
            continue
        t = bench_case(shape, q_lens, cached, args.runs, args.iters, args.layers)
        ref = min(t["numpy"], t["numpy 1 thread"])
        which = "" if t["numpy"] <= t["numpy 1 thread"] else " (1T)"
        print(f"| {name} | {ref:.3f}{which} | {t['float32']:.3f} | "
              f"{ref / t['float32']:.1f} | {t['float16']:.3f} | "
              f"{ref / t['float16']:.1f} | "
              f"{t['float32 attn']:.3f} / {t['float16 attn']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
