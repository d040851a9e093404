"""Engine bookkeeping per step, without the model: scheduler (schedule + update) and model
runner (diffs, input layout, sampling) at N running requests, the model replaced by a stub.

    python bench/step_overhead.py [--running 32 256] [--steps 200] [--runs 5]

Steady-state decode: every request runs with a short prompt and never stops. Medians over
--runs runs; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from vllm_actors.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vllm_actors.enginecore.kv_cache_manager import KVCacheManager
from vllm_actors.enginecore.request import Request
from vllm_actors.enginecore.scheduler import Scheduler
from vllm_actors.models.base import ModelArgs
from vllm_actors.protocol.engine import EngineCoreRequest
from vllm_actors.sampling_params import SamplingParams
from vllm_actors.workers.model_runner import ModelRunner

VOCAB = 64


class StubModel:
    """Costs nothing: zero hidden states, logits that always pick token 5."""

    args = ModelArgs("stub", hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=8, intermediate_size=8, vocab_size=VOCAB, rms_norm_eps=1e-6,
                     rope_theta=1e4, max_position_embeddings=4096, rotary_dim=8)

    def forward(self, token_ids, positions, meta, kv_caches):
        return np.zeros((len(token_ids), 8), np.float32)

    def compute_logits(self, hidden, rows, on_device=False):
        logits = np.zeros((len(rows), VOCAB), np.float32)
        logits[:, 5] = 1.0
        return logits


def measure(num_running: int, num_steps: int) -> tuple[float, float]:
    """(scheduler µs/step, runner µs/step) over num_steps decode steps."""
    config = EngineConfig(model=ModelConfig(max_model_len=4096),
                          cache=CacheConfig(num_gpu_blocks_override=num_running * 64),
                          scheduler=SchedulerConfig(max_num_seqs=num_running,
                                                    max_num_batched_tokens=8192))
    runner = ModelRunner(config, StubModel())
    kv = KVCacheManager(runner.num_blocks, runner.block_size)
    scheduler = Scheduler(config.scheduler, kv, runner.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    for i in range(num_running):
        prompt = [(i * 7 + j) % VOCAB for j in range(32)]
        scheduler.add_request(Request(EngineCoreRequest(str(i), prompt, params, [2], 0.0),
                                      runner.max_model_len, runner.block_size))
    step = scheduler.schedule()
    output = runner.execute(step)                      # prefill everything once
    sched_s = run_s = 0.0
    for _ in range(num_steps):
        t0 = time.perf_counter()
        scheduler.update_from_output(step, output)
        step = scheduler.schedule()
        t1 = time.perf_counter()
        output = runner.execute(step)
        t2 = time.perf_counter()
        sched_s += t1 - t0
        run_s += t2 - t1
    assert len(step.num_scheduled_tokens) == num_running
    return sched_s / num_steps * 1e6, run_s / num_steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print("| running requests | scheduler µs/step | runner µs/step (stub model) | "
          "µs per request per step | runs (sched+runner) |")
    print("|---|---|---|---|---|")
    for n in args.running:
        results = [measure(n, args.steps) for _ in range(args.runs)]
        sched = statistics.median(r[0] for r in results)
        run = statistics.median(r[1] for r in results)
        runs = ", ".join(f"{a + b:.0f}" for a, b in results)
        print(f"| {n} | {sched:.0f} | {run:.0f} | {(sched + run) / n:.1f} | {runs} |")


if __name__ == "__main__":
    main()
