"""Time to open a GGUF file (`loaders.gguf.GGUFFile`: header, metadata and tensor infos, the
data mapped, not read). Median, minimum and maximum of --runs opens, each a fresh parse.

    python bench/gguf_header.py [--runs 20] [--model PATH]

Moved here from a unit test that only printed its time (speed is measured by bench/, never
asserted by tests: docs/BENCHMARKS.md, "Test suite").
"""

from __future__ import annotations

import argparse
import statistics
import time

from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.model_files import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    opts = parser.parse_args()
    path = opts.model or default_model_path()
    if path is None:
        parser.error("no --model and the default model is not installed")
    times = []
    for _ in range(max(1, opts.runs)):
        start = time.perf_counter()
        gguf = GGUFFile(path)
        times.append(time.perf_counter() - start)
        tensors = len(gguf.tensors)
    print(f"{path}: {tensors} tensors, {len(gguf.metadata)} metadata keys")
    print("| runs | median ms | min ms | max ms |\n|---|---|---|---|")
    print(f"| {len(times)} | {1000 * statistics.median(times):.1f} | {1000 * min(times):.1f} | "
          f"{1000 * max(times):.1f} |")


if __name__ == "__main__":
    main()
