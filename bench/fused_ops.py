"""A decode step with the backend's fused `rope_and_cache` against the same step with the ops
one by one (`ops.split_rope_cache`: split, q/k norms, RoPE on q and k, the KV write), in one
process on one model, alternating blocks of steps so that the host's drift falls on both.

    python bench/fused_ops.py [--model PATH] [--batch 1] [--context 64] [--rounds 25]
    python bench/fused_ops.py --context 512 --query 512 --rounds 8 --block 3   # a prefill

Prints the median and 10th percentile of each form's step time (the same floats either way:
`tests/kernels/test_cpu_backend.py`). On a model with per-head q/k norms (Gemma 3) the CPU
backend takes the ops one by one in both forms.
"""

from __future__ import annotations

import argparse
import statistics
import time

from profile_step import decode_step

from vllm_actors.kernels import get_backend
from vllm_actors.kernels.ops import split_rope_cache
from vllm_actors.loaders.model_files import ModelSource, default_model_path
from vllm_actors.models.registry import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2 Q4_1)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--query", type=int, default=1, help="query tokens a sequence")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--block", type=int, default=40, help="steps of a form in a round")
    args = parser.parse_args()
    backend = get_backend("cpu")
    model = load_model(ModelSource("gguf", args.model or default_model_path()), backend,
                       gguf_activations="quantized")
    step = decode_step(model, args.batch, args.context, args.query, True)
    forms = {"fused": backend.rope_and_cache,
             "one by one": lambda *a: split_rope_cache(backend, *a)}
    times: dict[str, list[float]] = {name: [] for name in forms}
    for r in range(args.rounds + 1):
        for name, fn in forms.items():
            backend.rope_and_cache = fn
            for _ in range(args.block):
                start = time.perf_counter()
                step(None)
                if r:                   # the first round warms both forms up
                    times[name].append(time.perf_counter() - start)
    print(f"batch {args.batch}, context {args.context}, query {args.query}: {args.rounds} "
          f"rounds of {args.block} steps each")
    for name, ts in times.items():
        print(f"- {name}: median {statistics.median(ts) * 1e3:.3f} ms a step, 10th "
              f"percentile {sorted(ts)[len(ts) // 10] * 1e3:.3f}")


if __name__ == "__main__":
    main()
