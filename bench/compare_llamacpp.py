"""Side by side with llama.cpp: the same GGUF and the same prompt token ids through our engine
and through llama.cpp (llama-cpp-python's low-level batch API), alternating runs.

    pip install -e ".[bench]"        # llama-cpp-python, threadpoolctl
    python bench/compare_llamacpp.py [--model PATH] [--runs 3] [--device cpu] [--quick]

Rows: prefill tok/s at 128 / 512 / 2048 prompt tokens (submit to first token), single-stream
decode tok/s over 128 tokens, and batched decode aggregate tok/s with 1 / 4 / 16 / 32
sequences (from the moment every sequence has its first token to the last token). Both sides
decode greedily and ignore EOS, so they do the same work. Ours runs as users run it: AsyncLLM,
engine core in its own process, prefix caching off so repeated prompts are recomputed.
Each measurement alternates ours, theirs, ours, ...; the table shows medians and the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from vllm_actors import AsyncLLM, SamplingParams  # noqa: E402
from vllm_actors.loaders.model_files import default_model_path  # noqa: E402
from vllm_actors.sampling_params import RequestOutputKind  # noqa: E402

BATCH_PROMPT_TOKENS = 32


class LlamaCpp:
    """llama.cpp through its C API: one context per shape of work, greedy sampling on host."""

    def __init__(self, path: str, threads: int, **model_params: Any) -> None:
        """model_params: llama_model_params fields to set, e.g. use_extra_bufts=False."""
        import llama_cpp as lc
        self.lc = lc
        self._quiet = lc.llama_log_callback(lambda level, text, data: None)  # keep a ref
        lc.llama_log_set(self._quiet, ctypes.c_void_p(0))
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        for key, value in model_params.items():
            setattr(params, key, value)
        self.model = lc.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.threads = threads
        self.contexts: dict[tuple[int, int], Any] = {}
        self.batches: dict[int, Any] = {}

    def _context(self, n_seq: int, n_ctx: int) -> Any:
        key = (n_seq, n_ctx)
        if key not in self.contexts:
            params = self.lc.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, 2048, 512
            params.n_seq_max, params.n_threads, params.n_threads_batch = \
                n_seq, self.threads, self.threads
            params.no_perf = True
            self.contexts[key] = self.lc.llama_init_from_model(self.model, params)
        ctx = self.contexts[key]
        self.lc.llama_memory_clear(self.lc.llama_get_memory(ctx), True)
        return ctx

    def _decode(self, ctx: Any, rows: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """rows: (token, position, sequence, wants logits) -> greedy ids of the logit rows."""
        size = max(2048, len(rows))
        if size not in self.batches:
            self.batches[size] = self.lc.llama_batch_init(size, 0, 1)
        batch = self.batches[size]
        batch.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if self.lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        n_out = sum(1 for row in rows if row[3])
        logits = np.ctypeslib.as_array(self.lc.llama_get_logits(ctx),
                                       shape=(n_out * self.n_vocab,))
        return logits.reshape(n_out, self.n_vocab).argmax(axis=1)

    def prefill(self, tokens: list[int]) -> float:
        ctx = self._context(1, len(tokens) + 16)
        start = time.perf_counter()
        for lo in range(0, len(tokens), 2048):
            chunk = tokens[lo:lo + 2048]
            self._decode(ctx, [(t, lo + i, 0, lo + i == len(tokens) - 1)
                               for i, t in enumerate(chunk)])
        return time.perf_counter() - start

    def decode(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Aggregate decode tok/s after every sequence has its first token."""
        per_seq = max(len(p) for p in prompts) + new_tokens + 16
        ctx = self._context(len(prompts), per_seq * len(prompts))
        rows = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        last = self._decode(ctx, rows)
        start = time.perf_counter()
        for step in range(new_tokens - 1):
            last = self._decode(ctx, [(int(last[s]), len(p) + step, s, True)
                                      for s, p in enumerate(prompts)])
        return len(prompts) * (new_tokens - 1) / (time.perf_counter() - start)


class Ours:
    def __init__(self, model: str, max_len: int, device: str,
                 gguf_activations: str = "float32") -> None:
        self.engine = AsyncLLM(model, enable_prefix_caching=False, max_model_len=max_len,
                               device=device, gguf_activations=gguf_activations)
        self.counter = 0

    async def _run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, float]:
        """(start, time every request had its first token, time the last token arrived)."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        first: list[float] = []
        end: list[float] = []

        async def one(tokens: list[int]) -> None:
            self.counter += 1
            got_first = False
            async for out in self.engine.generate({"prompt_token_ids": tokens}, params,
                                                  request_id=f"bench-{self.counter}"):
                now = time.perf_counter()
                if not got_first and out.outputs[0].token_ids:
                    first.append(now)
                    got_first = True
            end.append(time.perf_counter())

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return start, max(first), max(end)

    async def prefill(self, tokens: list[int]) -> float:
        start, first, _ = await self._run([tokens], 1)
        return first - start

    async def decode(self, prompts: list[list[int]], new_tokens: int) -> float:
        _, first, end = await self._run(prompts, new_tokens)
        return len(prompts) * (new_tokens - 1) / (end - first)


def machine_facts(theirs: LlamaCpp) -> dict[str, Any]:
    facts: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__,
                             "cpus": os.cpu_count()}
    try:
        info = Path("/proc/cpuinfo").read_text()
        facts["cpu"] = next(line.split(":", 1)[1].strip() for line in info.splitlines()
                            if line.startswith("model name"))
        flags = next(line for line in info.splitlines() if line.startswith("flags"))
        facts["avx512f"] = " avx512f " in flags + " "
    except (OSError, StopIteration):
        pass
    try:
        import threadpoolctl
        facts["blas"] = [{k: pool.get(k) for k in ("internal_api", "version", "num_threads",
                                                   "architecture")}
                         for pool in threadpoolctl.threadpool_info()]
    except ImportError:
        facts["blas"] = "threadpoolctl not installed"
    import llama_cpp
    facts["llama_cpp_python"] = llama_cpp.__version__
    facts["llama_cpp_system"] = theirs.lc.llama_print_system_info().decode().strip()
    facts["llama_cpp_threads"] = theirs.threads
    return facts


def prompt_tokens(tokenizer: Any, count: int, offset: int = 0) -> list[int]:
    from oracle.prompts import LONG_ESSAY
    ids = tokenizer.encode(LONG_ESSAY)
    reps = -(-(count + offset) // len(ids))
    return (ids * reps)[offset:offset + count]


async def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ours = Ours(args.model, max(args.prefill) + args.decode_tokens + 64, args.device,
                args.gguf_activations)
    theirs = LlamaCpp(args.model, args.threads)
    tok = ours.engine.get_tokenizer()
    rows: list[dict[str, Any]] = []

    async def compare(name: str, unit: str, ours_fn: Any, theirs_fn: Any) -> None:
        await ours_fn()   # warm-up both (allocation, first-call costs)
        theirs_fn()
        a, b = [], []
        for _ in range(args.runs):
            a.append(await ours_fn())
            b.append(theirs_fn())
        rows.append({"row": name, "unit": unit, "ours": a, "llama_cpp": b})
        print(f"  {name}: ours {statistics.median(a):.1f}, llama.cpp "
              f"{statistics.median(b):.1f} {unit}", file=sys.stderr, flush=True)

    for n in args.prefill:
        tokens = prompt_tokens(tok, n)
        await compare(f"prefill, {n}-token prompt", "tok/s",
                      lambda t=tokens: _rate(len(t), ours.prefill(t)),
                      lambda t=tokens: len(t) / theirs.prefill(t))
    for b in args.batch:
        prompts = [prompt_tokens(tok, BATCH_PROMPT_TOKENS, 7 * s) for s in range(b)]
        label = ("single-stream decode" if b == 1 else f"batched decode, {b} sequences")
        await compare(f"{label}, {args.decode_tokens} tokens", "tok/s",
                      lambda p=prompts: ours.decode(p, args.decode_tokens),
                      lambda p=prompts: theirs.decode(p, args.decode_tokens))
    facts = machine_facts(theirs)
    ours.engine.shutdown()
    return rows, facts


async def _rate(count: int, seconds: Any) -> float:
    return count / await seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2 Q4_1)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu",
                        help="our backend: cpu (compiled, the default), numpy, opencl, cuda")
    parser.add_argument("--prefill", type=lambda s: [int(x) for x in s.split(",")],
                        default=[128, 512, 2048])
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4, 16, 32])
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--gguf-activations", choices=("float32", "quantized"),
                        default="quantized",
                        help="our semantics (the engine's default, quantized, is llama.cpp's)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path, help="also write rows and machine facts here")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one run: checks the harness, measures nothing")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.prefill, args.batch, args.decode_tokens = 1, [16], [1, 2], 4
    args.model = str(args.model or default_model_path())
    rows, facts = asyncio.run(measure(args))
    med = statistics.median
    print("| row | ours | llama.cpp | ratio | runs ours / llama.cpp |")
    print("|---|---|---|---|---|")
    for r in rows:
        ours, theirs = med(r["ours"]), med(r["llama_cpp"])
        runs = (", ".join(f"{x:.0f}" for x in r["ours"]) + " / "
                + ", ".join(f"{x:.0f}" for x in r["llama_cpp"]))
        print(f"| {r['row']} | {ours:.1f} {r['unit']} | {theirs:.1f} {r['unit']} | "
              f"{ours / theirs:.2f}x | {runs} |")
    print()
    for key, value in facts.items():
        print(f"- {key}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "machine": facts}, indent=1))


if __name__ == "__main__":
    main()
