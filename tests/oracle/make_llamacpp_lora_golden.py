"""llama.cpp's greedy tokens for SmolLM2 with a GGUF LoRA adapter (written by
tests/tiny_lora.py's `write_gguf_adapter` with gguf-py, SMOLLM2_GGUF_LORA), loaded through
llama-cpp-python's adapter API at scale 1. Run by hand:

    pip install -e ".[oracle]"
    python tests/oracle/make_llamacpp_lora_golden.py [--dtype F32|F16]
    python tests/oracle/make_llamacpp_lora_golden.py --moe

Writes tests/golden/llamacpp_smollm2_lora.json (F32 adapter weights) or
llamacpp_smollm2_lora_f16.json (F16, `convert_lora_to_gguf.py`'s default): per case of the
llama.cpp SmolLM2 goldens in CASES, 32 greedy tokens and their top-2 margins, with llama.cpp's
default settings (those of make_llamacpp_golden.py).

`--moe` writes llamacpp_qwen3_moe_lora.npz instead: the logits of every LORA_PROMPT position
on the tiny qwen3_moe as a GGUF (tests/family_gguf.py) with a GGUF adapter on its attention
and its stacked experts (`blk.N.ffn_gate_exps.weight.lora_a` [E, r, in]), the numbers of the
PEFT golden's qwen3_moe case, through llama-cpp-python with a float32 KV cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp as L
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "oracle")]

from make_llamacpp_golden import (DEFAULT, decode, last_logits, load_model,  # noqa: E402
                                  model_path, new_context, oracle_string, top2_margin)
from tiny_lora import (LORA_PROMPT, SMOLLM2_GGUF_LORA, SMOLLM2_SHAPES,  # noqa: E402
                       write_gguf_adapter, write_gguf_moe_case)

MOE_GOLDEN = ROOT / "tests" / "golden" / "llamacpp_qwen3_moe_lora.npz"

GOLDEN = {"F32": ROOT / "tests" / "golden" / "llamacpp_smollm2_lora.json",
          "F16": ROOT / "tests" / "golden" / "llamacpp_smollm2_lora_f16.json"}
CASES = ("chat_capital", "chat_german", "plain_primes", "plain_arith", "plain_japanese",
         "plain_emoji")
STEPS = 32


def greedy(model, adapter, prompt: list[int], n_vocab: int) -> tuple[list[int], list[float]]:
    ctx = new_context(model, DEFAULT)
    try:
        if L.llama_set_adapter_lora(ctx, adapter, 1.0) != 0:
            sys.exit("llama.cpp refused the adapter")
        decode(ctx, prompt)
        tokens, margins = [], []
        for _ in range(STEPS):
            token, margin = top2_margin(last_logits(ctx, n_vocab))
            tokens.append(token)
            margins.append(margin)
            decode(ctx, [token])
    finally:
        L.llama_free(ctx)
    return tokens, margins


def moe_main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model, adapter = write_gguf_moe_case(Path(tmp), no_vocab=True)
        llm = L.Llama(str(model), n_ctx=128, n_threads=2, logits_all=True, verbose=False,
                      type_k=0, type_v=0, lora_path=str(adapter))
        llm.eval(LORA_PROMPT)
        logits = np.array(llm.scores[:len(LORA_PROMPT)], np.float32)
    np.savez_compressed(MOE_GOLDEN, logits=logits, oracle=np.array(oracle_string()))
    print(f"wrote {MOE_GOLDEN}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="F32", choices=sorted(GOLDEN))
    parser.add_argument("--moe", action="store_true", help="the qwen3_moe expert adapter")
    options = parser.parse_args()
    if options.moe:
        return moe_main()
    dtype = options.dtype
    L.llama_backend_init()
    cases = {c["name"]: c for c in json.loads(
        (GOLDEN["F32"].parent / "llamacpp_smollm2_greedy.json").read_text())["cases"]}
    model = load_model(model_path("smollm2"))
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf_adapter(Path(tmp) / "adapter.gguf", SMOLLM2_SHAPES,
                                  **SMOLLM2_GGUF_LORA, dtype=dtype)
        adapter = L.llama_adapter_lora_init(model, str(path).encode())
        if not adapter:
            sys.exit("llama.cpp could not load the adapter")
        for name in CASES:
            prompt = cases[name]["prompt_token_ids"]
            tokens, margins = greedy(model, adapter, prompt, n_vocab)
            out.append({"name": name, "prompt_token_ids": prompt, "tokens": tokens,
                        "top2_margins": margins})
            print(f"{name}: {tokens[:8]}..., min margin {min(margins):.3g}")
    info = SMOLLM2_GGUF_LORA if dtype == "F32" else {**SMOLLM2_GGUF_LORA, "dtype": dtype}
    GOLDEN[dtype].write_text(json.dumps({"oracle": oracle_string(), "adapter": info,
                                         "cases": out}, indent=1))
    print(f"wrote {GOLDEN[dtype]}")


if __name__ == "__main__":
    main()
