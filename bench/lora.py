"""LoRA serving cost, side by side in one run: decode throughput of batch 16 with no adapter
against batch 16 spread over 4 rank-16 adapters (4 requests each), and single-stream decode
with and without an adapter, ours (compiled CPU backend, --enable-lora --max-loras 4) and
llama.cpp's (llama-cpp-python, the same GGUF adapter applied to its whole context).

    python bench/lora.py [--runs 3] [--tokens 64] [--rank 16] [--semantics quantized]
                         [--dtype F32|F16]
    python bench/lora.py --kernel [--rank 16] [--dtype F32|F16]
    python bench/lora.py --step [--rounds 25] [--rank 16] [--dtype F32|F16] [--model GGUF]

--kernel times only the deltas of one single-stream decode step on SmolLM2's shapes (its 30
layers' fused qkv, o, gate+up and down linears, one row) in the compiled backend's kernel,
after streaming 96 MB as the base model's weights do between them, median of 40 steps.

--step times whole single-row decode steps of SmolLM2 (or --model) in process (`profile_step.decode_step`,
context 160), alternating three cases step by step: no adapter, one rank-16 adapter with its
deltas as separate calls after each GEMV (`lora_ops.lora_add_ggml`), and with each delta
inside its GEMV (`CpuBackend.linear_lora`, the engine's path); medians of --rounds x 5 steps
each, and each adapted case's speed as a ratio of the base's.

The adapters are GGUF LoRA files (F32, or F16 as `convert_lora_to_gguf.py --outtype f16`
writes them) written with gguf-py (`tests/tiny_lora.write_gguf_adapter`)
on SmolLM2. One engine serves every case; the rounds alternate the cases (the machine is
shared and noisy; medians are reported, with every run). Greedy decoding with ignore_eos, so
every request generates --tokens tokens; throughput = generated tokens / wall time.
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

from tiny_lora import SMOLLM2_SHAPES, write_gguf_adapter  # noqa: E402

from vllm_actors import LLM, LoRARequest, SamplingParams  # noqa: E402
from vllm_actors.loaders.model_files import default_model_path  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def ours(llm: LLM, batch: int, loras: list, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    lora = [loras[i % len(loras)] for i in range(batch)] if loras else None
    start = time.perf_counter()
    outs = llm.generate([PROMPT] * batch, params, lora_request=lora, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def llamacpp(model: str, adapter: str | None, tokens: int) -> float:
    from llama_cpp import Llama
    kw = {"lora_path": adapter} if adapter else {}
    llm = Llama(model, n_ctx=512, n_threads=2, verbose=False, **kw)
    no_eos = {llm.token_eos(): -1e9}                         # every run generates `tokens`
    llm.create_completion(PROMPT, max_tokens=4, temperature=0.0)          # warm
    start = time.perf_counter()
    out = llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0, logit_bias=no_eos)
    elapsed = time.perf_counter() - start
    return out["usage"]["completion_tokens"] / elapsed


def kernel_step(rank: int, half: bool, steps: int = 40) -> float:
    """ms of one decode step's LoRA deltas at SmolLM2's shapes, caches flushed first."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_actors.kernels.ggml_matmul_f32 import pack
    from vllm_actors.kernels.lora_ops import lora_add_ggml
    rng = np.random.default_rng(0)

    def linear(k: int, widths: list[int]) -> SimpleNamespace:
        cols = np.cumsum([0] + widths)
        meta = np.array([(p * rank, rank, cols[p], n, cols[p]) for p, n in enumerate(widths)],
                        np.int64)
        a, b_t, meta = pack(rng.standard_normal((rank * len(widths), k), np.float32),
                            rng.standard_normal((rank, sum(widths)), np.float32), meta, half)
        return SimpleNamespace(a=a, b_t=b_t, meta=meta, work=rank * (len(widths) * k + cols[-1]),
                               scales=np.ones(len(widths), np.float32))

    shapes = [(576, [576, 192, 192]), (576, [576]), (576, [1536, 1536]), (1536, [576])]
    # x and y hot in cache, as a step's activations are; the adapters' weights streamed
    layers = [[(np.ones((1, k), np.float32), np.zeros((1, sum(w)), np.float32))
               for k, w in shapes]] * 30
    layers = [[(x, y, linear(k, w)) for (x, y), (k, w) in zip(row, shapes)] for row in layers]
    flush, rows, alone = np.ones(96 << 18, np.float32), np.zeros(1, np.int64), np.ones(1, bool)
    times = []
    for _ in range(steps + 3):
        flush.sum()
        start = time.perf_counter()
        for layer in layers:
            for x, y, lora in layer:
                lora_add_ggml(y, x, rows, lora, alone, half)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[3:])


def step_ratios(rank: int, dtype: str, rounds: int, model_path: str | None = None
                ) -> dict[str, float]:
    """Median ms of a single-row decode step: base, deltas apart, deltas inside the GEMV."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from profile_step import attach_lora, decode_step

    from vllm_actors.kernels import get_backend
    from vllm_actors.loaders.model_files import ModelSource
    from vllm_actors.models.registry import load_model
    backend = get_backend("cpu")
    model = load_model(ModelSource("gguf", model_path or default_model_path()), backend,
                       gguf_activations="quantized")
    step, lora = decode_step(model, 1, 160, 1, True), attach_lora(model, rank, dtype)
    fused = backend.linear_lora
    cases = {"base": None, "separate": lora, "inside the GEMV": lora}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(rounds + 1):
        for name, batch in cases.items():
            backend.linear_lora = fused if name != "separate" else (lambda *a, **k: None)
            for _ in range(5):
                start = time.perf_counter()
                step(batch)
                if i:                                      # the first round warms up
                    times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--semantics", default="quantized", choices=("quantized", "float32"))
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--kernel", action="store_true")
    parser.add_argument("--dtype", default="F32", choices=("F32", "F16"))
    parser.add_argument("--step", action="store_true")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--model", default=None, help="GGUF file for --step (default SmolLM2)")
    args = parser.parse_args()
    if args.step:
        ms = step_ratios(args.rank, args.dtype, args.rounds, args.model)
        for name, value in ms.items():
            print(f"{name}: {value:.2f} ms a step, {ms['base'] / value:.3f} of the base speed")
        return
    if args.kernel:
        print(f"one decode step's deltas (rank {args.rank}, {args.dtype}, SmolLM2 shapes): "
              f"{kernel_step(args.rank, args.dtype == 'F16'):.3f} ms")
        return
    model = str(default_model_path())
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_gguf_adapter(Path(tmp) / f"a{i}.gguf", SMOLLM2_SHAPES, rank=args.rank,
                                    alpha=float(args.rank), seed=i, dtype=args.dtype)
                 for i in range(1, 5)]
        loras = [LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(paths, 1)]
        cases = {"batch16 base": (16, []), "batch16 4 adapters": (16, loras),
                 "single base": (1, []), "single adapter": (1, loras[:1])}
        with LLM(model, device="cpu", enable_lora=True, max_loras=4, max_lora_rank=64,
                 max_model_len=1024, gguf_activations=args.semantics) as llm:
            for lora in loras:
                llm.add_lora(lora)
            ours(llm, 16, loras, 8)                                            # warm
            for run in range(args.runs):
                order = list(cases) if run % 2 == 0 else list(reversed(cases))
                for name in order:
                    batch, use = cases[name]
                    results.setdefault(name, []).append(ours(llm, batch, use, args.tokens))
        if not args.no_llamacpp:
            for run in range(args.runs):
                results.setdefault("llama.cpp single base", []).append(
                    llamacpp(model, None, args.tokens))
                results.setdefault("llama.cpp single adapter", []).append(
                    llamacpp(model, str(paths[0]), args.tokens))
    medians = {k: statistics.median(v) for k, v in results.items()}
    for name, runs in results.items():
        print(f"{name:28s} {medians[name]:8.1f} tok/s   runs {[round(r, 1) for r in runs]}")
    print(f"batch 16, 4 adapters / base: {medians['batch16 4 adapters'] / medians['batch16 base']:.2f}")
    print(f"single stream, adapter / base: {medians['single adapter'] / medians['single base']:.2f}")
    if "llama.cpp single adapter" in medians:
        print(f"single stream with an adapter, ours / llama.cpp: "
              f"{medians['single adapter'] / medians['llama.cpp single adapter']:.2f}")
    print(json.dumps({"medians": medians, "runs": results}))


if __name__ == "__main__":
    main()
