"""Regenerate every golden file in tests/golden/ from the oracles. Run by hand, never in CI:

    pip install -e ".[oracle]"       # torch==2.13.0 (CPU), transformers, accelerate, llama-cpp-python
    python -m vllm_actors pull smollm2 gemma3-270m
    python tests/oracle/make_golden.py

Oracles: Hugging Face transformers in float32 on the CPU (model outputs, chat templates) and
llama.cpp through llama-cpp-python (tokenization of GGUF vocabularies, the reference for how a
GGUF file tokenizes). Prompt token ids come from our tokenizer and are stored, so model goldens
do not depend on either tokenizer matching ours.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from family_models import (FAMILY_CONFIGS, FAMILY_PROMPT, GOLDEN_ROWS,  # noqa: E402
                           GREEDY_PROMPT_LEN, GREEDY_STEPS, write_family_dir)
from oracle.prompts import (CHAT_CONVERSATIONS, PROMPTS, TOKENIZER_STRINGS)  # noqa: E402
from tiny_models import (TINY_CONFIGS, TINY_PROMPT, write_hf_dir,  # noqa: E402
                         write_spm_vocab_gguf)

from vllm_actors.loaders.model_files import default_model_path, resolve_model  # noqa: E402
from vllm_actors.loaders.tokenizer import get_tokenizer  # noqa: E402

GOLDEN = ROOT / "tests" / "golden"
NUM_GENERATED = 64
LOGIT_STEPS = (0, 32)        # generation steps whose logits rows are stored
NUM_TOP_LOGITS = 64
NUM_SPREAD_LOGITS = 64

SPM_STRINGS = ["hello world", "the cat sat on the mat.", "  hello", "héllo wörld",
               "emoji 😀", "and, in the world", "x", "hello</s>the world", "<s>cat  sat\n"]


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int]) -> dict:
    """Greedy decoding with the KV cache; EOS does not stop it (ignore_eos on our side)."""
    tokens, margins, rows = [], [], []
    vocab = model.config.vocab_size
    spread = np.linspace(0, vocab - 1, NUM_SPREAD_LOGITS).astype(np.int64)
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for step in range(NUM_GENERATED):
            logits = out.logits[0, -1].float()
            top2 = torch.topk(logits, 2)
            margins.append(float(top2.values[0] - top2.values[1]))
            if step in LOGIT_STEPS:
                ids = np.unique(np.concatenate(
                    [torch.topk(logits, NUM_TOP_LOGITS).indices.numpy(), spread]))
                logprobs = torch.log_softmax(logits, dim=-1).numpy()
                rows.append((step, ids, logits.numpy()[ids], logprobs[ids]))
            token = int(top2.indices[0])
            tokens.append(token)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return {"tokens": tokens, "margins": margins, "rows": rows}


def make_smollm2_goldens(gguf_path: Path, stem: str = "smollm2") -> None:
    """Greedy goldens of a GGUF model on PROMPTS: `{stem}_greedy.json`, `{stem}_logits.npz`."""
    tokenizer = get_tokenizer(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    model.eval()
    cases, arrays = [], {}
    for name, kind, content in PROMPTS:
        if kind == "chat":
            ids = tokenizer.apply_chat_template(content, add_generation_prompt=True)
        else:
            ids = tokenizer.encode(content)
        result = hf_greedy(model, ids)
        cases.append({"name": name, "kind": kind, "prompt_token_ids": ids,
                      "tokens": result["tokens"], "top2_margins": result["margins"]})
        for step, ids_row, values, logprobs in result["rows"]:
            arrays[f"{name}/{step}/ids"] = ids_row
            arrays[f"{name}/{step}/logits"] = values.astype(np.float32)
            arrays[f"{name}/{step}/logprobs"] = logprobs.astype(np.float32)
        print(f"{name}: {len(ids)} prompt tokens -> {result['tokens'][:8]}...")
    meta = {"model": gguf_path.name, "oracle": f"transformers fp32 CPU, torch {torch.__version__}",
            "num_generated": NUM_GENERATED, "logit_steps": list(LOGIT_STEPS), "cases": cases}
    (GOLDEN / f"{stem}_greedy.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1))
    np.savez_compressed(GOLDEN / f"{stem}_logits.npz", **arrays)


def make_tokenizer_goldens(gguf_path: Path, workdir: Path) -> None:
    from llama_cpp import Llama

    vocab = Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    pinned = {s: vocab.tokenize(s.encode(), add_bos=False, special=True)
              for s in TOKENIZER_STRINGS}
    spm_path = workdir / "tiny_spm.gguf"
    write_spm_vocab_gguf(spm_path)
    spm = Llama(model_path=str(spm_path), vocab_only=True, verbose=False)
    spm_pinned = {s: spm.tokenize(s.encode(), add_bos=False, special=True)
                  for s in SPM_STRINGS}
    hf_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    templates = [{"messages": conv, "add_generation_prompt": agp,
                  "text": hf_tok.apply_chat_template(conv, tokenize=False,
                                                     add_generation_prompt=agp)}
                 for conv in CHAT_CONVERSATIONS for agp in (True, False)]
    gemma_path = resolve_model("gemma3-270m").path   # `vllm-actors pull gemma3-270m` first
    gemma = Llama(model_path=str(gemma_path), vocab_only=True, verbose=False)
    gemma_pinned = {s: gemma.tokenize(s.encode(), add_bos=False, special=True)
                    for s in TOKENIZER_STRINGS}
    out = {"oracle": "llama.cpp via llama-cpp-python (tokens); transformers (chat templates)",
           "smollm2": pinned, "tiny_spm": spm_pinned, "gemma3_270m": gemma_pinned,
           "smollm2_chat_templates": templates}
    (GOLDEN / "tokenizer.json").write_text(json.dumps(out, ensure_ascii=False, indent=1))


def make_tiny_model_goldens(workdir: Path) -> None:
    arrays = {}
    for name in TINY_CONFIGS:
        model_dir = workdir / name
        write_hf_dir(model_dir, name)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            arrays[name] = model(torch.tensor([TINY_PROMPT])).logits[0].numpy()
        print(f"tiny {name}: logits {arrays[name].shape}")
    np.savez_compressed(GOLDEN / "tiny_models.npz", **arrays)


def make_family_goldens(workdir: Path) -> None:
    """Per family: logits of GOLDEN_ROWS of the 300-token prompt, and greedy tokens (with
    their top-2 margins) after its first GREEDY_PROMPT_LEN tokens, through the KV cache."""
    arrays = {}
    for name in FAMILY_CONFIGS:
        model_dir = workdir / f"family-{name}"
        write_family_dir(model_dir, name)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="eager")
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([FAMILY_PROMPT])).logits[0].numpy()
            tokens, margins = [], []
            out = model(torch.tensor([FAMILY_PROMPT[:GREEDY_PROMPT_LEN]]), use_cache=True)
            for _ in range(GREEDY_STEPS):
                top2 = torch.topk(out.logits[0, -1].float(), 2)
                margins.append(float(top2.values[0] - top2.values[1]))
                tokens.append(int(top2.indices[0]))
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                            use_cache=True)
        arrays[f"{name}/logits"] = logits[GOLDEN_ROWS].astype(np.float32)
        arrays[f"{name}/greedy"] = np.array(tokens, np.int64)
        arrays[f"{name}/margins"] = np.array(margins, np.float32)
        print(f"family {name}: greedy {tokens[:8]}..., min margin {min(margins):.3g}")
    np.savez_compressed(GOLDEN / "family_models.npz", **arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("tiny", "family", "tokenizer", "smollm2", "gemma3"),
                        action="append",
                        help="regenerate only these golden sets (default: all)")
    parts = set(parser.parse_args().only or ("tiny", "family", "tokenizer", "smollm2",
                                             "gemma3"))
    gguf_path = default_model_path()
    if gguf_path is None:
        sys.exit("the default model is not installed: run `python -m vllm_actors pull`")
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if "tiny" in parts:
            make_tiny_model_goldens(Path(tmp))
        if "family" in parts:
            make_family_goldens(Path(tmp))
        if "tokenizer" in parts:
            make_tokenizer_goldens(gguf_path, Path(tmp))
    if "smollm2" in parts:
        make_smollm2_goldens(gguf_path)
    if "gemma3" in parts:   # `python -m vllm_actors pull gemma3-270m` first
        make_smollm2_goldens(resolve_model("gemma3-270m").path, "gemma3_270m")


if __name__ == "__main__":
    main()
