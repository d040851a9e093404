"""Greedy-decoding goldens from llama.cpp (through llama-cpp-python's C API), and its spread.

The transformers goldens (make_golden.py) say what the model computes in float32; these say what
llama.cpp computes from the same GGUF file with its quantized CPU kernels, which is what our
quantized kernels imitate. Prompts are the stored prompt_token_ids of the transformers goldens
(same case names), so the two oracles compare token for token. Run by hand, never in CI:

    pip install -e ".[oracle]"                  # llama-cpp-python built from source
    python -m vllm_actors pull smollm2 gemma3-270m
    python tests/oracle/make_llamacpp_golden.py             # goldens of both models
    python tests/oracle/make_llamacpp_golden.py --spread    # llama.cpp against itself
    # a llama.cpp built without AVX-512 (its 8-lane orders), from a build installed apart:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF \
        -DGGML_AMX_INT8=OFF" pip install --no-cache-dir --no-deps --no-binary \
        llama-cpp-python llama-cpp-python==0.3.36 --target /tmp/llama_avx2
    PYTHONPATH=/tmp/llama_avx2 python tests/oracle/make_llamacpp_golden.py --suffix _avx2

Goldens: tests/golden/llamacpp_{stem}_greedy.json (keys as make_golden.py's plus the llama.cpp
settings) and llamacpp_{stem}_logits.npz ({case}/{step}/ids|logits|logprobs for the top-64 and
64 spread ids at LOGIT_STEPS). Settings: what `llama_cpp.Llama(model_path)` runs (F16 KV cache,
flash attention off, weight repacking on), with n_ctx 1024, n_threads=2 and n_batch=512.

--spread reruns every prompt under another thread count, another batch size and with flash
attention on (llama.cpp's own CLI default, "auto"), and reports where the
greedy tokens leave the default run's, with the default run's top-2 logit margin at that step:
the size of near-ties that llama.cpp itself does not resolve reproducibly. Written to
tests/golden/llamacpp_spread.json.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

from vllm_actors.loaders.model_files import default_model_path, resolve_model  # noqa: E402

GOLDEN = ROOT / "tests" / "golden"
NUM_GENERATED = 64
LOGIT_STEPS = (0, 32)
NUM_TOP_LOGITS = 64
NUM_SPREAD_LOGITS = 64
N_CTX = 1024
MODELS = {"smollm2": "smollm2", "gemma3_270m": "gemma3-270m"}   # golden stem -> model name


@dataclass(frozen=True)
class Config:
    n_threads: int
    n_batch: int
    flash_attn: bool = False     # llama-cpp-python's default

    @property
    def label(self) -> str:
        fa = ",flash_attn" if self.flash_attn else ""
        return f"threads={self.n_threads},batch={self.n_batch}{fa}"


DEFAULT = Config(n_threads=2, n_batch=512)
SPREAD_CONFIGS = (Config(1, 512), Config(2, 7), Config(2, 512, flash_attn=True))

_LOG_LINES: list[str] = []


LOG_LEVEL_DEBUG = 1     # enum ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT
LOG_NOTE_KEYS = ("flash attention", "repack model buffer", "kv_cache: size",
                 "cannot be used with preferred buffer type")


@L.llama_log_callback
def _collect_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Keep llama.cpp's log for the meta notes instead of printing it (of its debug lines only
    the ones naming repacked tensors)."""
    line = text.decode("utf-8", "replace")
    if level != LOG_LEVEL_DEBUG or line.startswith("repack: repack tensor"):
        _LOG_LINES.append(line)


def model_path(stem: str) -> Path:
    path = default_model_path() if stem == "smollm2" else resolve_model(MODELS[stem]).path
    if path is None or not Path(path).exists():
        sys.exit(f"model for {stem} is not installed: python -m vllm_actors pull {MODELS[stem]}")
    return Path(path)


def load_model(path: Path) -> L.llama_model_p:
    params = L.llama_model_default_params()     # use_extra_bufts (repacking) on by default
    model = L.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        sys.exit(f"llama.cpp could not load {path}")
    return model


def new_context(model: L.llama_model_p, config: Config) -> L.llama_context_p:
    params = L.llama_context_default_params()
    params.n_ctx = N_CTX
    params.n_batch = config.n_batch
    params.n_ubatch = min(config.n_batch, params.n_ubatch)
    params.n_threads = params.n_threads_batch = config.n_threads
    params.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn
                              else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        sys.exit("llama.cpp could not create a context")
    return ctx


def decode(ctx: L.llama_context_p, tokens: list[int]) -> None:
    """One llama_decode of `tokens` at the next positions; logits of the last one only."""
    arr = (L.llama_token * len(tokens))(*tokens)
    rc = L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens)))
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")


def last_logits(ctx: L.llama_context_p, n_vocab: int) -> np.ndarray:
    ptr = L.llama_get_logits_ith(ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32, copy=True)


def logit_row(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-64 ids plus 64 evenly spread ids, with their logits and log-probabilities."""
    spread = np.linspace(0, logits.size - 1, NUM_SPREAD_LOGITS).astype(np.int64)
    top = np.argpartition(logits, -NUM_TOP_LOGITS)[-NUM_TOP_LOGITS:]
    ids = np.unique(np.concatenate([top.astype(np.int64), spread]))
    wide = logits.astype(np.float64)
    logprobs = wide - (wide.max() + np.log(np.exp(wide - wide.max()).sum()))
    return ids, logits[ids], logprobs[ids].astype(np.float32)


def top2_margin(logits: np.ndarray) -> tuple[int, float]:
    """Greedy token (lowest id among equal maxima) and top-1 minus top-2 logit (float32)."""
    best = int(np.argmax(logits))
    rest = logits.copy()
    rest[best] = -np.inf
    return best, float(logits[best] - rest.max())


def greedy(model: L.llama_model_p, config: Config, prompt: list[int], n_vocab: int) -> dict:
    """Greedy decoding from a fresh context: the prompt in n_batch chunks, then one token per
    step; EOS does not stop it."""
    ctx = new_context(model, config)
    try:
        for i in range(0, len(prompt), config.n_batch):
            decode(ctx, prompt[i:i + config.n_batch])
        tokens, margins, rows = [], [], []
        for step in range(NUM_GENERATED):
            logits = last_logits(ctx, n_vocab)
            token, margin = top2_margin(logits)
            tokens.append(token)
            margins.append(margin)
            if step in LOGIT_STEPS:
                rows.append((step, *logit_row(logits)))
            decode(ctx, [token])
    finally:
        L.llama_free(ctx)
    return {"tokens": tokens, "margins": margins, "rows": rows}


def transformers_cases(stem: str) -> list[dict]:
    """Case names, kinds and prompt ids of the transformers golden of the same model."""
    return json.loads((GOLDEN / f"{stem}_greedy.json").read_text())["cases"]


def oracle_string() -> str:
    version = importlib.metadata.version("llama_cpp_python")
    return f"llama.cpp via llama-cpp-python {version} (CPU)"


def settings_meta() -> dict:
    model_params, ctx_params = L.llama_model_default_params(), L.llama_context_default_params()
    fa = "enabled" if DEFAULT.flash_attn else "disabled"
    notes = {ln.strip() for ln in _LOG_LINES if any(k in ln.lower() for k in LOG_NOTE_KEYS)}
    repacked = {ln.strip() for ln in _LOG_LINES if ln.startswith("repack: repack tensor")}
    notes.add(f"{len(repacked)} weight tensors repacked")
    return {"n_threads": DEFAULT.n_threads, "n_batch": DEFAULT.n_batch, "n_ctx": N_CTX,
            "repack": bool(model_params.use_extra_bufts), "flash_attn_type": fa,
            "type_k": int(ctx_params.type_k), "type_v": int(ctx_params.type_v),
            "system_info": L.llama_print_system_info().decode().strip(),
            "log_notes": sorted(notes)}


def make_goldens(stem: str, suffix: str = "") -> None:
    """The golden files of `stem`; `suffix` ("_avx2") names those of a llama.cpp built for
    another instruction set (its system info is in the file)."""
    path = model_path(stem)
    _LOG_LINES.clear()
    model = load_model(path)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cases, arrays = [], {}
    for case in transformers_cases(stem):
        ids = case["prompt_token_ids"]
        result = greedy(model, DEFAULT, ids, n_vocab)
        cases.append({"name": case["name"], "kind": case["kind"], "prompt_token_ids": ids,
                      "tokens": result["tokens"], "top2_margins": result["margins"]})
        for step, ids_row, values, logprobs in result["rows"]:
            arrays[f"{case['name']}/{step}/ids"] = ids_row
            arrays[f"{case['name']}/{step}/logits"] = values
            arrays[f"{case['name']}/{step}/logprobs"] = logprobs
        print(f"{stem} {case['name']}: {len(ids)} prompt tokens -> {result['tokens'][:8]}...")
    meta = {"model": path.name, "oracle": oracle_string(), **settings_meta(),
            "num_generated": NUM_GENERATED, "logit_steps": list(LOGIT_STEPS), "cases": cases}
    L.llama_model_free(model)
    (GOLDEN / f"llamacpp_{stem}{suffix}_greedy.json").write_text(
        json.dumps(meta, ensure_ascii=False, indent=1))
    np.savez_compressed(GOLDEN / f"llamacpp_{stem}{suffix}_logits.npz", **arrays)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def spread_of_model(stem: str) -> dict:
    """Per prompt and config: identical to the default run?, first divergent step, and the
    default run's (and that run's) top-2 margin at it."""
    model = load_model(model_path(stem))
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    out = {}
    for case in transformers_cases(stem):
        ids = case["prompt_token_ids"]
        base = greedy(model, DEFAULT, ids, n_vocab)
        out[case["name"]] = {}
        for config in SPREAD_CONFIGS:
            run = greedy(model, config, ids, n_vocab)
            step = first_divergence(base["tokens"], run["tokens"])
            out[case["name"]][config.label] = {
                "identical": step is None, "first_divergence": step,
                "margin_at_divergence": None if step is None else base["margins"][step],
                "config_margin_at_divergence": None if step is None else run["margins"][step]}
        print_spread_row(stem, case["name"], out[case["name"]])
    L.llama_model_free(model)
    return out


def print_spread_row(stem: str, name: str, row: dict) -> None:
    cells = []
    for label, r in row.items():
        cell = "same" if r["identical"] else (f"step {r['first_divergence']} "
                                              f"margin {r['margin_at_divergence']:.4g}")
        cells.append(f"{label}: {cell}")
    print(f"{stem:12s} {name:18s} " + " | ".join(cells), flush=True)


def summarize(spread: dict) -> None:
    for stem, cases in spread.items():
        for config in SPREAD_CONFIGS:
            rows = [c[config.label] for c in cases.values()]
            diverged = [r for r in rows if not r["identical"]]
            worst = max((r["margin_at_divergence"] for r in diverged), default=None)
            print(f"{stem:12s} {config.label:20s} identical {len(rows) - len(diverged)}"
                  f"/{len(rows)}, largest margin at divergence {worst}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spread", action="store_true",
                        help="measure llama.cpp against itself instead of writing goldens")
    parser.add_argument("--only", choices=tuple(MODELS), action="append",
                        help="only these models (default: all)")
    parser.add_argument("--suffix", default="",
                        help="after the stem in the goldens' names: _avx2 for a llama.cpp "
                             "built without AVX-512 (its 8-lane orders)")
    args = parser.parse_args()
    stems = args.only or list(MODELS)
    L.llama_log_set(_collect_log, ctypes.c_void_p(0))
    L.llama_backend_init()
    GOLDEN.mkdir(parents=True, exist_ok=True)
    if not args.spread:
        for stem in stems:
            make_goldens(stem, args.suffix)
        return
    spread = {stem: spread_of_model(stem) for stem in stems}
    summarize(spread)
    out_path = GOLDEN / "llamacpp_spread.json"
    models = json.loads(out_path.read_text())["models"] if out_path.exists() else {}
    meta = {"oracle": oracle_string(), "default": DEFAULT.label,
            "configs": [c.label for c in SPREAD_CONFIGS], "num_generated": NUM_GENERATED,
            "models": {**models, **spread}}    # --only keeps the other models' results
    out_path.write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
