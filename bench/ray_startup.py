"""What Ray costs at start-up: a local Ray instance, and an engine placed through Ray against
the same engine started as local processes.

    python bench/ray_startup.py [--runs 3]

Rows (each started fresh, one after the other; medians of --runs, seconds until the engine
answers a 1-token request): `ray.init()` of a local instance alone; one engine core as
processes (`--data-parallel-backend mp`); the same core as a Ray actor
(`--data-parallel-backend ray`, Ray already running); the core's single worker as a Ray actor
(`--distributed-executor-backend ray`, Ray already running). Kernels are compiled before the
first row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray

from vllm_actors import LLM, SamplingParams

ONE = SamplingParams(max_tokens=1)


def engine_seconds(**kwargs) -> float:
    start = time.perf_counter()
    with LLM(None, **kwargs) as llm:
        llm.generate("Hi", ONE, use_tqdm=False)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    engine_seconds()                                            # compile / load caches
    rows: dict[str, list[float]] = {}
    for _ in range(args.runs):
        start = time.perf_counter()
        ray.init(include_dashboard=False, log_to_driver=False)
        rows.setdefault("ray.init() of a local instance", []).append(
            time.perf_counter() - start)
        rows.setdefault("engine core as a local process (mp)", []).append(engine_seconds())
        rows.setdefault("engine core as a Ray actor (--data-parallel-backend ray)", []).append(
            engine_seconds(data_parallel_backend="ray"))
        rows.setdefault("worker as a Ray actor (--distributed-executor-backend ray)",
                        []).append(engine_seconds(distributed_executor_backend="ray"))
        ray.shutdown()
    print(f"| start-up | seconds (median of {args.runs}) | runs |")
    print("|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.2f} | "
              f"{', '.join(f'{v:.2f}' for v in values)} |")


if __name__ == "__main__":
    main()
