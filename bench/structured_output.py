"""Structured-output cost per engine step on SmolLM2's 49152-token vocabulary: the token
bitmask computed in the engine core (llguidance) and its application to the logits in the
worker, at batch 1 and 32. Medians over --runs x --steps steps; prints a Markdown table.

    python bench/structured_output.py [--runs 5] [--steps 20]

Each request walks a JSON-schema grammar along a real output (its matcher consumes the
tokens of a valid object, one per step), so masks are computed in the states a decode meets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from vllm_actors.enginecore.request import Request
from vllm_actors.enginecore.structured_output import StructuredOutputManager
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.loaders.tokenizer import load_tokenizer
from vllm_actors.protocol.engine import EngineCoreRequest
from vllm_actors.sampling_params import SamplingParams, StructuredOutputsParams
from vllm_actors.workers.sampler import apply_token_bitmask

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
OUTPUT = json.dumps({"name": "Ada Lovelace of the Analytical Engine", "age": 36,
                     "tags": ["mathematics", "poetry", "notes", "engines", "Bernoulli"]},
                    separators=(",", ":"))


def _requests(manager: StructuredOutputManager, n: int) -> list[Request]:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    requests = [Request(EngineCoreRequest(f"r{i}", [1], params, [2], 0.0), 8192)
                for i in range(n)]
    for r in requests:
        manager.submit(r)
    while manager.has_pending():
        manager.wait(1.0)
        manager.take_ready()
    return requests


def measure(manager: StructuredOutputManager, tokens: list[int], batch: int, steps: int
            ) -> tuple[float, float]:
    """Median ms per step: (bitmask computation, application to [batch, V] logits)."""
    requests = _requests(manager, batch)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((batch, VOCAB)).astype(np.float32)
    rows = np.arange(batch)
    compute, apply = [], []
    for step in range(min(steps, len(tokens))):
        t0 = time.perf_counter()
        mask = np.frombuffer(manager.bitmask(requests), np.int32).reshape(batch, -1)
        t1 = time.perf_counter()
        apply_token_bitmask(logits, rows, mask)
        t2 = time.perf_counter()
        compute.append(t1 - t0)
        apply.append(t2 - t1)
        for r in requests:
            r.grammar.consume_token(tokens[step])
    return statistics.median(compute) * 1e3, statistics.median(apply) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    source = resolve_model(None)
    tokens = load_tokenizer(source).encode(OUTPUT, add_special_tokens=False)
    manager = StructuredOutputManager(None, VOCAB)
    _requests(manager, 1)   # load the tokenizer once, outside the timings
    print("| batch | bitmask (core) ms/step | apply (worker) ms/step |")
    print("|---|---|---|")
    for batch in (1, 32):
        runs = [measure(manager, tokens, batch, args.steps) for _ in range(args.runs)]
        print(f"| {batch} | {statistics.median(r[0] for r in runs):.3f} | "
              f"{statistics.median(r[1] for r in runs):.3f} |")


if __name__ == "__main__":
    main()
