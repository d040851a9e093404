"""Random LoRA adapters (tests and tests/oracle/make_lora_golden.py build them): PEFT
directories with non-zero B (PEFT's `init_lora_weights=False`), from splitmix64 hashing as
the tiny models are, so they are identical on every machine."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from tiny_models import det_uniform, write_safetensors

ATTN_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_shapes(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
                 head_dim: int | None = None) -> dict[str, tuple[int, int]]:
    """The HF names and shapes of a llama checkpoint's linears (SmolLM2's, from its GGUF;
    `head_dim` where it is not hidden / heads, as Gemma 3's)."""
    dh = head_dim or hidden // heads
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
                or len(shape) != 2 or _EXPERT.match(name):
            continue
        out, inp = shape
        seed += 2
        a = det_uniform((rank, inp), seed) * np.float32(1.0 / math.sqrt(inp))
        b = det_uniform((out, rank), seed + 1) * np.float32(1.0 / math.sqrt(rank))
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    return tensors


_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|"
                     r"down_proj|w1|w3|w2)\.weight$")
STACKED_EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def expert_tensors(base: dict[str, object], rank: int, seed: int, form: str
                   ) -> dict[str, np.ndarray]:
    """Random adapters on every routed expert of `base` (per-expert HF names, as MoE
    checkpoints hold them). form "stacked": PEFT's `target_parameters` on transformers 5's
    stacked experts (per layer, gate_up_proj wrapped innermost (`.base_layer`): A [E r, in]
    with expert e's rows at e r, B [out, r E] with its columns at e, e + E, ...); "per_expert":
    the same numbers as older PEFT writes them, one module per expert and projection, gate
    and up each holding the expert's A."""
    blocks: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, weight in base.items():
        match = _EXPERT.match(name)
        if match and match["e"] == "0":
            blocks.setdefault(match["block"], {})[match["proj"]] = \
                tuple(getattr(weight, "shape", weight))
    tensors = {}
    for block, shapes in sorted(blocks.items()):
        gate, up, down = ("w1", "w3", "w2") if "w1" in shapes else ("gate_proj", "up_proj",
                                                                    "down_proj")
        f, d = shapes[gate]
        num = sum(1 for n in base if n.startswith(block + ".") and n.endswith(f".{gate}.weight"))
        seed += 4
        pairs = {}
        for name, out, inp, s in (("gate_up", 2 * f, d, seed), ("down", d, f, seed + 2)):
            pairs[name] = (det_uniform((num * rank, inp), s) * np.float32(1.0 / math.sqrt(inp)),
                           det_uniform((out, rank * num), s + 1) * np.float32(1 / math.sqrt(rank)))
        if form == "stacked":
            stacked = "base_model.model." + block.replace("block_sparse_moe.", "mlp.")
            for wrapper, (a, b) in ((".base_layer", pairs["gate_up"]), ("", pairs["down"])):
                tensors[f"{stacked}{wrapper}.lora_A.weight"] = a
                tensors[f"{stacked}{wrapper}.lora_B.weight"] = b
            continue
        for e in range(num):
            for proj, (a, b), lo, hi in ((gate, pairs["gate_up"], 0, f),
                                         (up, pairs["gate_up"], f, 2 * f),
                                         (down, pairs["down"], 0, d)):
                module = f"base_model.model.{block}.{e}.{proj}"
                tensors[module + ".lora_A.weight"] = np.ascontiguousarray(
                    a[e * rank:(e + 1) * rank])
                tensors[module + ".lora_B.weight"] = np.ascontiguousarray(b[lo:hi, e::num])
    return tensors


def write_peft_adapter(path: Path, base: dict[str, object], targets: tuple[str, ...] = ATTN_MLP,
                       rank: int = 8, alpha: float = 16.0, rslora: bool = False, seed: int = 1,
                       experts: str | None = None, **config: object) -> Path:
    """A PEFT LoRA directory over the HF-named weights (or shapes) `base`; `experts`: also
    on every routed expert, in `expert_tensors`' form; extra `config` keys (e.g. use_dora)
    are written into adapter_config.json as they are."""
    path.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
                "target_modules": list(targets), "use_rslora": rslora, "lora_dropout": 0.0,
                "bias": "none", "fan_in_fan_out": False, "use_dora": False,
                "modules_to_save": None, "init_lora_weights": False, **config}
    tensors = peft_tensors(base, targets, rank, seed * 1000)
    if experts:
        tensors.update(expert_tensors(base, rank, seed * 1000 + 500, experts))
    if experts == "stacked":
        settings["target_parameters"] = STACKED_EXPERTS
    (path / "adapter_config.json").write_text(json.dumps(settings, indent=1))
    write_safetensors(path / "adapter_model.safetensors", tensors)
    return path


# name -> (model source: "tiny" (TINY_CONFIGS) or "family" (FAMILY_CONFIGS), its name,
# adapter settings); the goldens are PEFT's on transformers (tests/oracle/make_lora_golden.py)
LORA_CASES: dict[str, tuple[str, str, dict]] = {
    "llama": ("tiny", "llama", {"rank": 8, "alpha": 16.0}),
    "qwen2_rslora_r64": ("tiny", "qwen2", {"rank": 64, "alpha": 32.0, "rslora": True}),
    "gemma3": ("family", "gemma3", {"rank": 8, "alpha": 16.0}),
    "phi3": ("family", "phi3", {"rank": 8, "alpha": 16.0,
                                "targets": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}),
    "qwen3_moe": ("family", "qwen3_moe", {"rank": 16, "alpha": 16.0, "experts": "stacked",
                                          "targets": ("q_proj", "k_proj", "v_proj", "o_proj")}),
    # gate/up/down_proj reach only the shared expert: transformers 5 stacks the routed ones
    "qwen2_moe": ("family", "qwen2_moe", {"rank": 8, "alpha": 16.0, "experts": "stacked"}),
    "mixtral": ("family", "mixtral", {"rank": 4, "alpha": 8.0, "experts": "stacked",
                                      "targets": ("q_proj", "v_proj")}),
}
LORA_PROMPT = [(i * 53 + 7) % 251 + 3 for i in range(48)]
LORA_GREEDY_PROMPT_LEN = 17
LORA_GREEDY_STEPS = 32
# SmolLM2 (its GGUF, dequantized by transformers) with a rank-16 adapter on every linear
SMOLLM2_LORA = {"rank": 16, "alpha": 8.0, "seed": 7}
SMOLLM2_LORA_PROMPT = "The three most important things to know about the ocean are"


def write_case(workdir: Path, name: str) -> tuple[Path, Path]:
    """The model directory and the adapter of LORA_CASES[name], written under workdir."""
    from family_models import write_family_dir
    from tiny_models import write_hf_dir

    source, model, settings = LORA_CASES[name]
    write = write_hf_dir if source == "tiny" else write_family_dir
    weights = write(workdir / f"{name}-model", model)
    adapter = write_peft_adapter(workdir / f"{name}-adapter", weights, **settings)
    return workdir / f"{name}-model", adapter


def attach(model, adapter: Path, name: str = "a", max_rank: int = 64):
    """`model` (a loaded DecoderLM) running every row with the adapter at `adapter`, as the
    runner does for a step whose requests all use it."""
    from vllm_actors.loaders.lora import load_adapter
    from vllm_actors.models.lora import LoRABatch, build_model_lora

    args = model.args
    lora = build_model_lora(model, load_adapter(name, str(adapter), args, max_rank,
                                                extra_names=model.extra_names))
    forward = model.forward
    model.forward = lambda *a, **kw: forward(*a, lora=LoRABatch(((lora, None),)), **kw)
    return model


def gguf_expert_tensors(base: dict[str, object], rank: int, seed: int
                        ) -> dict[str, np.ndarray]:
    """`expert_tensors`' numbers as llama.cpp's converter stacks them: per layer and
    projection `blk.N.ffn_gate_exps.weight.lora_a` [E, r, in] and `.lora_b` [E, out, r]."""
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, t in expert_tensors(base, rank, seed, "per_expert").items():
        match = re.match(r"base_model\.model\..*layers\.(\d+)\..*experts\.(\d+)\.(\w+)\."
                         r"lora_([AB])\.weight$", name)
        proj = {"gate_proj": "ffn_gate", "w1": "ffn_gate", "up_proj": "ffn_up", "w3": "ffn_up",
                "down_proj": "ffn_down", "w2": "ffn_down"}[match[3]]
        key = f"blk.{match[1]}.{proj}_exps.weight.lora_{match[4].lower()}"
        stacks.setdefault(key, {})[int(match[2])] = t
    return {k: np.stack([v[e] for e in sorted(v)]) for k, v in stacks.items()}


def write_gguf_adapter(path: Path, hf_shapes: dict[str, object], arch: str = "llama",
                       num_layers: int = 30, rank: int = 8, alpha: float = 16.0,
                       seed: int = 1, targets: tuple[str, ...] = ATTN_MLP,
                       dtype: str = "F32", experts: bool = False) -> Path:
    """A llama.cpp LoRA adapter (general.type = adapter, `blk.N.<name>.weight.lora_a` /
    `lora_b`, F32 or F16, `convert_lora_to_gguf.py --outtype f32|f16`) over the linears of
    `hf_shapes` (HF names to shapes or weights), written with gguf-py; random values, so
    their rows are simply in the GGUF base's order. `experts`: also on every routed expert,
    the numbers of `write_peft_adapter(..., experts=...)` with the same seed."""
    import gguf

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for hf_name, tensors in peft_tensors(hf_shapes, targets, rank, seed * 1000).items():
        module, ab = hf_name.removeprefix("base_model.model.").rsplit(".lora_", 1)
        base = name_map.get_name(module + ".weight", try_suffixes=(".weight",))
        writer.add_tensor(f"{base}.lora_{ab[0].lower()}",
                          tensors.astype(np.float16) if dtype == "F16" else tensors)
    stacked = gguf_expert_tensors(hf_shapes, rank, seed * 1000 + 500) if experts else {}
    for name, tensors in stacked.items():
        writer.add_tensor(name, tensors.astype(np.float16) if dtype == "F16" else tensors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SMOLLM2_GGUF_LORA = {"rank": 16, "alpha": 8.0, "seed": 11}


def write_gguf_moe_case(workdir: Path, no_vocab: bool = False) -> tuple[Path, Path]:
    """The tiny qwen3_moe as a GGUF and a GGUF adapter holding LORA_CASES["qwen3_moe"]'s
    numbers (attention and stacked experts); `no_vocab` as `write_family_gguf`'s."""
    from family_gguf import write_family_gguf
    from family_models import FAMILY_CONFIGS, family_weights

    _, model, settings = LORA_CASES["qwen3_moe"]
    config = FAMILY_CONFIGS[model]
    write_family_gguf(workdir / "qwen3_moe.gguf", model, no_vocab=no_vocab)
    adapter = write_gguf_adapter(workdir / "qwen3_moe-lora.gguf", family_weights(config),
                                 arch="qwen3moe", num_layers=config["num_hidden_layers"],
                                 rank=settings["rank"], alpha=settings["alpha"],
                                 targets=settings["targets"], experts=True)
    return workdir / "qwen3_moe.gguf", adapter
