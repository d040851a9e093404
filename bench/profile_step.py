"""Where one model step's time goes, per backend op: SmolLM2 on a backend (cpu by default),
B sequences each at context C running Q query tokens (Q=1: decode; B=1, Q=C: a prefill).

    python bench/profile_step.py --batch 32 --context 160            # 32-way decode step
    python bench/profile_step.py --batch 1 --context 2048 --query 2048   # 2048-token prefill
    python bench/profile_step.py --batch 1 --gguf-activations float32    # the exact semantics
    python bench/profile_step.py --batch 1 --lora 16 [--lora-dtype F16]  # every row on a LoRA

The KV cache is filled with random values (attention cost does not depend on them). Each
backend method is wrapped with a timer; "(other)" is model code between ops. Medians over
--steps steps after 2 warm-up steps. On a device backend (--device opencl / cuda) launches
are asynchronous, so only the step total (which ends by copying logits to the host) is
reported (the host backends, cpu and numpy, are timed per op). `--gguf-activations` picks
the GGUF semantics as the engine's flag does (default quantized, with its float16 cache).
`--lora R` runs every row with a random rank-R GGUF adapter on SmolLM2's attention and MLP
linears (`tests/tiny_lora.write_gguf_adapter`, F32 or F16), its deltas timed as `lora_add`.
To compare two versions, run this on both checkouts alternately
(`PYTHONPATH=<checkout> python bench/profile_step.py ...`): the host is noisy.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from vllm_actors.config import resolve_kv_dtype
from vllm_actors.kernels import get_backend
from vllm_actors.kernels.kv_quant import kv_format
from vllm_actors.kernels.ops import AttentionMetadata
from vllm_actors.loaders.model_files import ModelSource, default_model_path
from vllm_actors.models.registry import load_model

OPS = ("embedding", "linear", "rms_norm", "layer_norm", "add", "add_rms_norm", "scale",
       "silu_mul", "gelu_mul", "gelu", "prepare_rope", "rope", "rope_and_cache",
       "prepare_attention", "reshape_and_cache", "paged_attention", "lm_head", "lora_add",
       "linear_lora")


def attach_lora(model: Any, rank: int, dtype: str) -> Any:
    """A LoRABatch running every row with a random rank-`rank` GGUF adapter on every
    attention and MLP linear of `model` (shapes from its config)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_lora import llama_shapes, write_gguf_adapter

    from vllm_actors.loaders.lora import load_adapter
    from vllm_actors.models.lora import LoRABatch, build_model_lora
    a = model.args
    shapes = llama_shapes(a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads,
                          a.intermediate_size, a.head_dim)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf_adapter(Path(tmp) / "a.gguf", shapes, num_layers=a.num_layers,
                                  rank=rank, alpha=float(rank), dtype=dtype)
        adapter = load_adapter("a", str(path), a, rank)
    warm = getattr(model.backend, "warm_up_lora", None)
    if warm is not None:
        warm(adapter.half)
    return LoRABatch(((build_model_lora(model, adapter), None),))


def decode_step(model: Any, b: int, c: int, q: int, quantized: bool, fill: bool = True
                ) -> Callable[[Any], None]:
    """A step of B sequences each at context C running Q query tokens on `model`, as a
    function of the step's LoRA batch (or None): the KV cache allocated (filled with random
    values where `fill`: attention's cost does not depend on them), the rest fixed."""
    backend, a, bs = model.backend, model.args, 16
    fmt = kv_format(resolve_kv_dtype("auto", quantized), ggml_products=quantized)
    nb = -(-c // bs)
    rng = np.random.default_rng(0)
    kv = backend.allocate_kv_cache(a.num_layers, b * nb + 1, bs, a.num_kv_heads, a.head_dim,
                                   fmt)
    if fill:
        for k_cache, v_cache in kv:
            if k_cache.dtype in (np.float32, np.float16):
                k_cache[:] = rng.random(k_cache.shape, np.float32)
                v_cache[:] = rng.random(v_cache.shape, np.float32)
    tables = np.arange(b * nb, dtype=np.int32).reshape(b, nb) + 1
    pos = np.tile(np.arange(c - q, c), b)
    rows = np.repeat(np.arange(b), q)
    slots = tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
    meta = AttentionMetadata(np.arange(b + 1, dtype=np.int32) * q, np.full(b, c, np.int32),
                             tables, slots, bs)
    ids = rng.integers(0, 1000, b * q)
    last = np.arange(b) * q + q - 1
    return lambda lora: model.compute_logits(model.forward(ids, pos, meta, kv, lora=lora),
                                             last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2 Q4_1)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--query", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=("cpu", "numpy", "opencl", "cuda"))
    parser.add_argument("--gguf-activations", default="quantized",
                        choices=("quantized", "float32"))
    parser.add_argument("--lora", type=int, default=0, help="adapter rank (0: none)")
    parser.add_argument("--lora-dtype", default="F32", choices=("F32", "F16"))
    args = parser.parse_args()
    if not 1 <= args.query <= args.context:
        parser.error("need 1 <= --query <= --context")

    backend = get_backend(args.device)
    per_op_timing = args.device in ("cpu", "numpy")
    model = load_model(ModelSource("gguf", args.model or default_model_path()), backend,
                       gguf_activations=args.gguf_activations)
    step = decode_step(model, args.batch, args.context, args.query,
                       args.gguf_activations == "quantized", fill=per_op_timing)
    lora = attach_lora(model, args.lora, args.lora_dtype) if args.lora else None
    b = args.batch

    times: dict[str, float] = collections.defaultdict(float)
    for name in OPS if per_op_timing else ():
        fn = getattr(backend, name, None)
        if fn is None:
            continue

        def timed(*a_, _fn=fn, _name=name, **kw):
            start = time.perf_counter()
            out = _fn(*a_, **kw)
            times[_name] += time.perf_counter() - start
            return out
        setattr(backend, name, timed)

    per_step: list[float] = []
    per_op: dict[str, list[float]] = collections.defaultdict(list)
    for i in range(args.steps + 2):
        times.clear()
        start = time.perf_counter()
        step(lora)
        total = time.perf_counter() - start
        if i >= 2:
            per_step.append(total)
            for name in OPS:
                per_op[name].append(times.get(name, 0.0))
            per_op["(other)"].append(total - sum(times.values()))
    step_s = statistics.median(per_step)
    print(f"{args.device}, {args.gguf_activations}: batch {b}, context {args.context}, "
          f"query {args.query}: {step_s * 1e3:.1f} ms/step "
          f"({b * args.query / step_s:.0f} tok/s), median of {args.steps}"
          + (f", rank-{args.lora} {args.lora_dtype} adapter" if args.lora else ""))
    if not per_op_timing:
        return
    print("| op | ms/step |")
    print("|---|---|")
    for name, values in sorted(per_op.items(), key=lambda kv_: -statistics.median(kv_[1])):
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
