"""Random LoRA adapters (tests and tests/oracle/make_lora_golden.py build them): PEFT
directories with non-zero B (PEFT's `init_lora_weights=False`), from splitmix64 hashing as
the tiny models are, so they are identical on every machine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tiny_models import det_uniform, write_safetensors

ATTN_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_shapes(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int
                 ) -> dict[str, tuple[int, int]]:
    """The HF names and shapes of a llama checkpoint's linears (SmolLM2's, from its GGUF)."""
    dh = hidden // heads
    shapes = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * dh, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * dh, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * dh, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * dh),
                       p + "mlp.gate_proj.weight": (ffn, hidden),
                       p + "mlp.up_proj.weight": (ffn, hidden),
                       p + "mlp.down_proj.weight": (hidden, ffn)})
    return shapes


SMOLLM2_SHAPES = llama_shapes(30, 576, 9, 3, 1536)


def peft_tensors(base: dict[str, object], targets: tuple[str, ...], rank: int, seed: int
                 ) -> dict[str, np.ndarray]:
    """lora_A [r, in] / lora_B [out, r] for every base linear whose last name is a target
    (`base`: HF names to weights or to shapes)."""
    tensors = {}
    for name, weight in sorted(base.items()):
        module = name.removesuffix(".weight")
        shape = tuple(getattr(weight, "shape", weight))
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets \
                or len(shape) != 2:
            continue
        out, inp = shape
        seed += 2
        a = det_uniform((rank, inp), seed) * np.float32(1.0 / math.sqrt(inp))
        b = det_uniform((out, rank), seed + 1) * np.float32(1.0 / math.sqrt(rank))
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    return tensors


def write_peft_adapter(path: Path, base: dict[str, object], targets: tuple[str, ...] = ATTN_MLP,
                       rank: int = 8, alpha: float = 16.0, rslora: bool = False, seed: int = 1,
                       **config: object) -> Path:
    """A PEFT LoRA directory over the HF-named weights (or shapes) `base`; extra `config` keys (e.g.
    use_dora) are written into adapter_config.json as they are."""
    path.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
                "target_modules": list(targets), "use_rslora": rslora, "lora_dropout": 0.0,
                "bias": "none", "fan_in_fan_out": False, "use_dora": False,
                "modules_to_save": None, "init_lora_weights": False, **config}
    (path / "adapter_config.json").write_text(json.dumps(settings, indent=1))
    write_safetensors(path / "adapter_model.safetensors",
                      peft_tensors(base, targets, rank, seed * 1000))
    return path
