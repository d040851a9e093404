"""LoRA goldens from PEFT on transformers (fp32, CPU): every LORA_CASES adapter on its tiny
model, and a rank-16 adapter on SmolLM2 (its GGUF, dequantized by transformers). Run by hand:

    pip install -e ".[oracle]"
    python tests/oracle/make_lora_golden.py

Writes tests/golden/lora.npz: per case the logits of every LORA_PROMPT position, and the
greedy tokens (with their top-2 margins) after its first LORA_GREEDY_PROMPT_LEN tokens;
smollm2/* the same over SMOLLM2_LORA_PROMPT (logits of its last position).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tiny_lora import (LORA_CASES, LORA_GREEDY_PROMPT_LEN, LORA_GREEDY_STEPS,  # noqa: E402
                       LORA_PROMPT, SMOLLM2_LORA, SMOLLM2_LORA_PROMPT, SMOLLM2_SHAPES,
                       write_case, write_peft_adapter)

from vllm_actors.loaders.model_files import default_model_path  # noqa: E402
from vllm_actors.loaders.tokenizer import get_tokenizer  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "lora.npz"


def greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    tokens, margins = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            top2 = torch.topk(out.logits[0, -1].float(), 2)
            margins.append(float(top2.values[0] - top2.values[1]))
            tokens.append(int(top2.indices[0]))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens, margins


def with_adapter(model_dir: Path, adapter: Path, **load: object) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager", **load)
    return PeftModel.from_pretrained(base, str(adapter)).eval()


def store(arrays: dict, name: str, logits: np.ndarray, tokens: list[int],
          margins: list[float]) -> None:
    arrays[f"{name}/logits"] = logits.astype(np.float32)
    arrays[f"{name}/greedy"] = np.array(tokens, np.int64)
    arrays[f"{name}/margins"] = np.array(margins, np.float32)
    print(f"{name}: greedy {tokens[:8]}..., min margin {min(margins):.3g}")


def main() -> None:
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in LORA_CASES:
            model_dir, adapter = write_case(Path(tmp), name)
            model = with_adapter(model_dir, adapter)
            with torch.no_grad():
                logits = model(torch.tensor([LORA_PROMPT])).logits[0].numpy()
            store(arrays, name, logits, *greedy(model, LORA_PROMPT[:LORA_GREEDY_PROMPT_LEN],
                                               LORA_GREEDY_STEPS))
        gguf = default_model_path()
        adapter = write_peft_adapter(Path(tmp) / "smollm2-adapter", SMOLLM2_SHAPES,
                                     **SMOLLM2_LORA)
        model = with_adapter(gguf.parent, adapter, gguf_file=gguf.name)
        prompt = get_tokenizer(gguf).encode(SMOLLM2_LORA_PROMPT)
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1:].numpy()
        arrays["smollm2/prompt"] = np.array(prompt, np.int64)
        store(arrays, "smollm2", logits, *greedy(model, prompt, LORA_GREEDY_STEPS))
    np.savez_compressed(GOLDEN, **arrays)
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
