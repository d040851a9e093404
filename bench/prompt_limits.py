"""What a prompt far over the context costs the frontend: the time to refuse it when it is
counted in pieces (InputProcessor.encode) against tokenizing all of it, and the resident
memory a large request leaves behind with and without returning freed memory to the system
(preparation.release_free_memory, glibc's malloc_trim).

    python bench/prompt_limits.py [--runs 3]

Texts just under the character cap of the default model's 8192-token context: prose,
digits (one token per character) and spaces (many characters per token). Medians of
`--runs`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time

import msgspec

from vllm_actors import get_tokenizer
from vllm_actors.errors import ValidationError
from vllm_actors.frontend.input_processor import InputProcessor
from vllm_actors.frontend.preparation import release_free_memory
from vllm_actors.loaders.model_files import default_model_path
from vllm_actors.protocol.engine import EngineReady


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def median_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def refuse_times(processor: InputProcessor, runs: int) -> None:
    cap = processor.max_text_chars - 100
    texts = {"prose": ("The quick brown fox jumps over the lazy dog. " * 80_000)[:cap],
             "digits": ("1234567890" * 300_000)[:cap], "spaces": " " * cap}
    for name, text in texts.items():
        def pieces():
            try:
                processor.prompt_token_ids(text)
            except ValidationError:
                pass
        whole = median_seconds(lambda: processor.tokenizer.encode(text), runs)
        counted = median_seconds(pieces, runs)
        print(f"| {name} | {len(text):,} | {whole:.2f} s | {counted:.3f} s |")


def memory_after_a_large_request(tokenizer, trim: bool) -> tuple[float, float, float]:
    """(before, peak, after) MiB around decoding, tokenizing and encoding a 10 MB body in a
    thread, as the preparation lane does."""
    before, peak = rss_mib(), [0.0]

    def work() -> None:
        body = msgspec.json.encode({"prompt": "hello world, 12345 " * 500_000})
        ids = tokenizer.encode(msgspec.json.decode(body)["prompt"])
        msgspec.json.encode({"tokens": ids})
        peak[0] = rss_mib()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    gc.collect()
    if trim:
        release_free_memory()
    return before, peak[0], rss_mib()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    tokenizer = get_tokenizer(default_model_path())
    processor = InputProcessor(tokenizer, EngineReady(64, 16, 8192, 49152))
    print("| text | characters | tokenize all | refused after pieces |\n|---|---|---|---|")
    refuse_times(processor, args.runs)
    print("\n| memory (MiB) | before | peak | after |\n|---|---|---|---|")
    for trim in (False, True):
        before, peak, after = memory_after_a_large_request(tokenizer, trim)
        label = "freed memory returned" if trim else "kept by the allocator"
        print(f"| {label} | {before:.0f} | {peak:.0f} | {after:.0f} |")


if __name__ == "__main__":
    main()
