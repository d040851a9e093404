"""Big model: llama.cpp and our engine on a Llama-3-8B-shaped Q4_K_M file, and the decode
speed that memory bandwidth allows.

    pip install -e ".[bench]"        # llama-cpp-python, psutil
    python bench/big_model.py [--model PATH] [--device cpu] [--gguf-activations quantized]
        [--runs 3] [--streams 1,4,16] [--threads N]
        [--prompt-tokens 16] [--decode-tokens 32] [--no-repack] [--llama-only | --ours-only]
        [--quick] [--json OUT]

The model defaults to bench/synth_gguf.py's synthetic 8B (random weights, SmolLM2
vocabulary; written into its cache directory on first use, ~4.5 GB). Rows:
  - single-stream greedy decode tok/s: a fixed prompt of --prompt-tokens ids, then
    --decode-tokens tokens with EOS ignored, timed from the first token to the last; one
    warm-up run, then --runs runs (median and the runs);
  - load time, and resident memory after load and after the runs: RSS, and its anonymous
    part (RSS minus file-backed pages, i.e. without the mmap'd GGUF), and the peak (VmHWM).
llama.cpp runs first, in a child process of its own (so its RSS is its alone and its memory
is gone before ours loads), with n_threads = usable CPUs, through compare_llamacpp's
LlamaCpp (the low-level batch API). By default llama.cpp repacks Q4_K weights into
interleaved anonymous-memory copies for its AVX2/AVX-512 kernels (its RSS then counts those
plus the mmap'd file pages it read them from); --no-repack keeps them in the mmap only.
Ours runs as users run it: AsyncLLM (what `LLM(...)` drives) with the engine core in its own
process (the process measured), prefix caching off, max_model_len 512, on --device (default
cpu: the compiled CPU backend). The numpy reference backend dequantizes to float32 (28 GiB
for this 8B), so the script refuses it when that would not fit in RAM: use it with --quick.
The bound: bytes of weights one decoded token reads (every tensor but token_embd, plus one
embedding row) / streaming read bandwidth (numpy OR-reductions over a 1 GiB array, split over
--threads threads, median of 5; about what memcpy gets per byte read), as tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import synth_gguf  # noqa: E402
from compare_llamacpp import LlamaCpp, Ours  # noqa: E402

from vllm_actors import AsyncLLM  # noqa: E402
from vllm_actors.config import EngineArgs  # noqa: E402
from vllm_actors.kernels.cpu.threads import usable_cpus  # noqa: E402
from vllm_actors.loaders.gguf import GGUFFile  # noqa: E402

GiB = 1 << 30


def memory(pid: int | None = None) -> dict[str, float]:
    """RSS, its anonymous part and the peak RSS of a process, in GiB."""
    proc = psutil.Process(pid)
    info = proc.memory_info()
    peak = 0.0
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        peak = next(int(line.split()[1]) * 1024 for line in status.splitlines()
                    if line.startswith("VmHWM:")) / GiB
    except (OSError, StopIteration):
        pass
    return {"rss": info.rss / GiB, "anon": (info.rss - getattr(info, "shared", 0)) / GiB,
            "peak": peak}


def _read(part: np.ndarray) -> None:
    np.bitwise_or.reduce(part)   # the cheapest reduction per byte: memory-bound on one core


def read_bandwidth(threads: int, size: int = GiB, reps: int = 5) -> float:
    """Streaming read bandwidth in bytes/s: `threads` threads each OR-reducing a slice of a
    `size`-byte array (numpy releases the GIL in the loop); median of `reps` after a warm-up."""
    data = np.ones(size // 8, dtype=np.uint64)   # written, so the pages are real
    parts = np.array_split(data, threads)
    rates = []
    for _ in range(reps + 1):
        workers = [threading.Thread(target=_read, args=(p,)) for p in parts[1:]]
        start = time.perf_counter()
        for w in workers:
            w.start()
        _read(parts[0])
        for w in workers:
            w.join()
        rates.append(data.nbytes / (time.perf_counter() - start))
    del data, parts
    return statistics.median(rates[1:])


def bytes_per_token(path: str) -> int:
    f = GGUFFile(path)
    try:
        total = sum(t.nbytes for n, t in f.tensors.items() if n != "token_embd.weight")
        embd = f.tensors["token_embd.weight"]
        return total + embd.nbytes // embd.shape[0]
    finally:
        f.close()


def float32_bytes(path: str) -> int:
    f = GGUFFile(path)
    try:
        return 4 * sum(int(np.prod(t.shape)) for t in f.tensors.values())
    finally:
        f.close()


def prompt_ids(count: int, vocab: int = 49152) -> list[int]:
    """Fixed ordinary-token ids (SmolLM2's specials are the first few)."""
    return [200 + (i * 7919) % (vocab - 200) for i in range(count)]


def stream_prompts(prompt: list[int], streams: int) -> list[list[int]]:
    """`streams` distinct prompts of the same length (the first is `prompt`)."""
    return [[t + 13 * i for t in prompt] for i in range(streams)]


def _llama_worker(path: str, threads: int, repack: bool, prompt: list[int], decode_tokens: int,
                  runs: int, streams: list[int], out: Any) -> None:
    try:
        start = time.perf_counter()
        theirs = LlamaCpp(path, threads, use_extra_bufts=repack)
        result: dict[str, Any] = {"load_s": time.perf_counter() - start}
        result["mem_load"] = memory()
        theirs.decode([prompt], decode_tokens)            # warm-up
        result["decode"] = {n: [theirs.decode(stream_prompts(prompt, n), decode_tokens)
                                for _ in range(runs)] for n in streams}
        result["mem_end"] = memory()
        out.put(result)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put({"error": repr(e)})


def run_llama(args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_llama_worker, args=(args.model, args.threads, not args.no_repack,
                                                   prompt, args.decode_tokens, args.runs,
                                                   args.streams, out))
    proc.start()
    result = out.get()
    proc.join()
    if "error" in result:
        raise RuntimeError(f"llama.cpp run failed: {result['error']}")
    return result


def engine_core_pid() -> int:
    """The child process with the most resident memory: the engine core."""
    children = psutil.Process().children(recursive=True)
    if not children:
        return os.getpid()   # --no-multiprocessing style: the core runs in this process
    return max(children, key=lambda c: c.memory_info().rss).pid


def check_fits(args: argparse.Namespace) -> None:
    backend = EngineArgs(device=args.device).create_engine_config().device.backend
    need = float32_bytes(args.model)
    available = psutil.virtual_memory().available
    if backend == "numpy" and need > 0.7 * available:
        raise SystemExit(f"--device {args.device} runs the numpy backend, which dequantizes "
                         f"to float32: {need / GiB:.1f} GiB, more than this machine can spare "
                         f"({available / GiB:.1f} GiB available); use --quick or --llama-only")


async def run_ours(args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    max_len = 512
    start = time.perf_counter()
    ours = Ours.__new__(Ours)
    ours.counter = 0
    ours.engine = AsyncLLM(args.model, device=args.device, max_model_len=max_len,
                           enable_prefix_caching=False, gguf_activations=args.gguf_activations,
                           max_num_seqs=max(args.streams),
                           num_gpu_blocks_override=max(args.streams) * (max_len // 16) + 2)
    try:
        result: dict[str, Any] = {"load_s": time.perf_counter() - start}
        pid = engine_core_pid()
        result["mem_load"] = memory(pid)
        await ours.decode([prompt], args.decode_tokens)  # warm-up
        result["decode"] = {n: [await ours.decode(stream_prompts(prompt, n), args.decode_tokens)
                                for _ in range(args.runs)] for n in args.streams}
        result["mem_end"] = memory(pid)
    finally:
        ours.engine.shutdown()
    return result


def _cell(side: dict[str, Any] | None, fmt: Any) -> str:
    return "-" if side is None else fmt(side)


def report(args: argparse.Namespace, llama: dict[str, Any] | None, ours: dict[str, Any] | None,
           bound: float, facts: dict[str, Any]) -> None:
    med = statistics.median

    def rate(n: int) -> Any:
        return lambda s: (f"{med(s['decode'][n]):.2f} "
                          f"({', '.join(f'{x:.2f}' for x in s['decode'][n])})")

    def mem(key: str) -> Any:
        return lambda s: (f"{s[key]['rss']:.2f} (anon {s[key]['anon']:.2f}, "
                          f"peak {s[key]['peak']:.2f})")

    rows = [(f"{n}-stream decode tok/s (all streams), {args.decode_tokens} tokens after "
             f"{args.prompt_tokens}: median (runs)", rate(n), f"{bound * n:.2f}")
            for n in args.streams]
    rows += [("load, s", lambda s: f"{s['load_s']:.1f}", ""),
            ("RSS after load, GiB", mem("mem_load"), ""),
            ("RSS after the runs, GiB", mem("mem_end"), "")]
    repack = "no repack" if args.no_repack else "repack"
    print(f"| row | llama.cpp ({args.threads} threads, {repack}) | ours (--device {args.device}, "
          f"{args.gguf_activations}) | bandwidth bound |")
    print("|---|---|---|---|")
    for name, fmt, limit in rows:
        print(f"| {name} | {_cell(llama, fmt)} | {_cell(ours, fmt)} | {limit} |")
    print()
    for key, value in facts.items():
        print(f"- {key}: {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="GGUF file (default: the synthetic 8B, written if missing)")
    parser.add_argument("--device", default="cpu", help="our engine's --device (default cpu)")
    parser.add_argument("--gguf-activations", choices=("float32", "quantized"),
                        default="quantized",
                        help="our semantics (the engine's default, quantized, is llama.cpp's)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", type=lambda t: [int(v) for v in t.split(",")],
                        default=[1], help="comma-separated stream counts (default 1)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=usable_cpus(),
                        help="llama.cpp threads and bandwidth threads (default: usable CPUs)")
    parser.add_argument("--no-repack", action="store_true",
                        help="llama.cpp without its CPU repacked weight copies "
                             "(use_extra_bufts=False): weights stay in the mmap only")
    side = parser.add_mutually_exclusive_group()
    side.add_argument("--llama-only", action="store_true", help="skip our engine")
    side.add_argument("--ours-only", action="store_true", help="skip llama.cpp")
    parser.add_argument("--bandwidth-mib", type=int, default=1024)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny synthetic model, one run: checks the harness")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.decode_tokens, args.bandwidth_mib = 1, 8, 128
        args.model = args.model or str(synth_gguf.ensure_synthetic(synth_gguf.QUICK))
    args.model = str(args.model or synth_gguf.ensure_synthetic_8b())
    if not args.llama_only:
        check_fits(args)
    size = Path(args.model).stat().st_size
    per_token = bytes_per_token(args.model)
    bandwidth = read_bandwidth(args.threads, args.bandwidth_mib << 20)
    facts: dict[str, Any] = {
        "model": f"{args.model} ({size / 1e9:.2f} GB)",
        "weights read per token": f"{per_token / 1e9:.3f} GB",
        "read bandwidth": f"{bandwidth / 1e9:.1f} GB/s ({args.threads} threads, "
                          f"{args.bandwidth_mib} MiB, median of 5)",
        "decode bound": f"{bandwidth / per_token:.2f} tok/s (read bandwidth / weights read "
                        f"per token)",
        "cpus": f"{usable_cpus()} usable of {os.cpu_count()}; load average "
                f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}",
    }
    prompt = prompt_ids(args.prompt_tokens)
    llama = None if args.ours_only else run_llama(args, prompt)
    if llama:
        print(f"  llama.cpp: {statistics.median(llama['decode'][args.streams[0]]):.2f} tok/s",
              file=sys.stderr)
    ours = None if args.llama_only else asyncio.run(run_ours(args, prompt))
    report(args, llama, ours, bandwidth / per_token, facts)
    if args.json:
        args.json.write_text(json.dumps({"llama_cpp": llama, "ours": ours, "facts": facts,
                                         "bound_tok_s": bandwidth / per_token},
                                        indent=1))


if __name__ == "__main__":
    main()
