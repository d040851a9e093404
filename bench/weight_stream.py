"""How fast a one-row decode step streams a model's weights through the compiled CPU backend's
linears, against the machine's read bandwidth.

    python bench/weight_stream.py [--model PATH] [--gguf-activations quantized] [--runs 21]

Every layer's linears, in order, on one row of x (what a single-stream decode step computes,
without attention or norms), then the LM head, timed apart; the pair repeated --runs times,
medians. As in a step, the head runs after the layers' weights have passed through the
caches, so both read their weights from memory: GB/s = the weights' bytes / the time (a head
timed alone, over and over, would stay in a 32 MiB L3). The bound beside it is
`big_model.read_bandwidth` on the same threads (numpy OR-reductions over 1 GiB).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from big_model import read_bandwidth  # noqa: E402

from vllm_actors.kernels import get_backend  # noqa: E402
from vllm_actors.kernels.cpu import threads  # noqa: E402
from vllm_actors.loaders.model_files import ModelSource, default_model_path  # noqa: E402
from vllm_actors.models.registry import load_model  # noqa: E402


def _linears(layer) -> list:  # type: ignore[no-untyped-def]
    """A layer's linear weights (attention and dense MLP), in the order a step runs them."""
    found = [getattr(layer, name) for name in ("qkv", "attn_out")]
    mlp = getattr(layer, "mlp", None)
    found += [getattr(mlp, name) for name in ("gate_up", "down") if hasattr(mlp, name)]
    return [w for w in found if w is not None and hasattr(w, "parts")]


def _medians_s(fns, runs: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Median seconds of each of `fns`, run one after another as a step runs them (so each
    starts with the caches the one before it left)."""
    for _ in range(3):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(runs):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2 Q4_1)")
    parser.add_argument("--gguf-activations", default="quantized",
                        choices=("quantized", "float32"))
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()

    backend = get_backend("cpu")
    model = load_model(ModelSource("gguf", args.model or default_model_path()), backend,
                       gguf_activations=args.gguf_activations)
    weights = [w for layer in model.layers for w in _linears(layer)]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, w.parts[0].cols)).astype(np.float32) for w in weights]
    head_x = rng.standard_normal((1, model.head.parts[0].cols)).astype(np.float32)

    def layers() -> None:
        for w, x in zip(weights, inputs):
            backend.linear(x, w)

    spent = _medians_s([layers, lambda: backend.linear(head_x, model.head)], args.runs)
    rows = [("layers' linears", sum(p.nbytes for w in weights for p in w.parts), spent[0]),
            ("LM head", sum(p.nbytes for p in model.head.parts), spent[1])]
    bound = read_bandwidth(threads.configure())
    print(f"read bandwidth at {threads.configure()} threads: {bound / 1e9:.1f} GB/s")
    print("| weights | MB | ms | GB/s | of the bandwidth |")
    print("|---|---|---|---|---|")
    for name, nbytes, seconds in rows:
        print(f"| {name} | {nbytes / 1e6:.1f} | {seconds * 1e3:.2f} | "
              f"{nbytes / seconds / 1e9:.1f} | {nbytes / seconds / bound:.0%} |")


if __name__ == "__main__":
    main()
