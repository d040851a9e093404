"""LoRA adapters from disk: PEFT directories and llama.cpp's GGUF adapters, as float32 A/B
pairs keyed by the GGUF name of the linear they adapt (`blk.3.attn_q`).

- PEFT: `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `alpha_pattern`,
  `target_modules`) and `adapter_model.safetensors` (`...q_proj.lora_A.weight` [r, in],
  `...lora_B.weight` [out, r]); module names mapped with gguf-py's map, as checkpoints are.
  Q/K rows are in the HF checkpoint's order (`LoRAAdapter.row_order` "hf").
  Routed experts come in either of PEFT's forms: one module per expert (`mlp.experts.E.
  gate_proj`, mixtral's `block_sparse_moe.experts.E.w1`), or transformers 5's stacked
  `experts.gate_up_proj` / `experts.down_proj` under `target_parameters` (A [E r, in] with
  expert e's rows at e r, B [out, r E] with expert e's columns at e, e + E, ...; gate and up
  share A). Both become one pair per expert and projection: `blk.N.ffn_gate.E`.
- GGUF (`general.type = adapter`, `adapter.type = lora`): `blk.N.<name>.weight.lora_a` /
  `.lora_b`, scaled by `adapter.lora.alpha / rank` as llama.cpp does; rows in the GGUF base's
  order ("gguf"). Stacked experts (`blk.N.ffn_gate_exps`: A [E, r, in], B [E, out, r], as
  llama.cpp's `convert_lora_to_gguf.py` writes them and its `build_lora_mm_id` reads them)
  become one pair per expert.
Everything else PEFT can express (DoRA, `modules_to_save`, bias training, embedding
adapters) is refused with a message naming it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType, get_tensor_name_map

from vllm_actors.errors import ValidationError
from vllm_actors.kernels import quant
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.safetensors import _open_file
from vllm_actors.loaders.weights import _model_arch

_PEFT_PREFIX = "base_model.model."
_PEFT_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_GGUF_TENSOR = re.compile(r"^(?P<module>.+)\.weight\.lora_(?P<ab>[ab])$")
_STACKED = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts"
                      r"(?:\.base_layer)*$")


class LoRAAdapterError(ValidationError):
    """An adapter that cannot be served (missing files, an unsupported feature, a rank above
    --max-lora-rank, modules the model lacks); HTTP 400."""

    def __init__(self, name: str, path: str, problem: str) -> None:
        super().__init__(f"LoRA adapter {name!r} ({path}): {problem}", "lora_request")


@dataclass
class LoRAAdapter:
    """modules: GGUF linear name -> (A [r, in], B [out, r], scale), float32.
    row_order: "hf" when Q/K rows follow the HF checkpoint (PEFT), "gguf" when they follow
    a GGUF base's permuted order (llama.cpp adapters). half: every weight is a float16 value
    (an F16 GGUF adapter, or --lora-dtype float16): kept as float16, and under llama.cpp's
    semantics multiplied with inputs rounded to float16, as ggml's F16 matmul does."""

    name: str
    path: str
    rank: int
    row_order: str
    modules: dict[str, tuple[np.ndarray, np.ndarray, float]] = field(default_factory=dict)
    half: bool = False


def load_adapter(name: str, path: str, args: Any, max_rank: int, dtype: str = "auto",
                 extra_names: Callable[[str], str | None] | None = None) -> LoRAAdapter:
    """Read the adapter at `path` (a PEFT directory or a .gguf file) for a model of
    ModelArgs `args` (its GGUF architecture, layers and experts); `extra_names`: its
    family's GGUF names for HF weights gguf-py's map lacks (`Family.hf_name`: per-expert
    linears). Raises LoRAAdapterError."""
    p = Path(path)
    if p.is_dir():
        adapter = _load_peft(name, p, args, extra_names)
    elif p.is_file() and p.suffix == ".gguf":
        adapter = _load_gguf(name, p)
    else:
        raise LoRAAdapterError(name, path, "no such PEFT directory or .gguf adapter file")
    if not adapter.modules:
        raise LoRAAdapterError(name, path, "holds no LoRA weights")
    if adapter.rank > max_rank:
        raise LoRAAdapterError(name, path, f"rank {adapter.rank} is above --max-lora-rank "
                                           f"{max_rank}")
    for module, (a, b, scale) in adapter.modules.items():
        adapter.modules[module] = (_rounded(a, dtype), _rounded(b, dtype), scale)
    adapter.half = dtype == "float16" or (dtype == "auto" and adapter.half)
    return adapter


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to --lora-dtype (bfloat16: round to nearest even)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32)
        bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)
        return bits.view(np.float32)
    return x


def _peft_config(name: str, path: Path) -> dict:
    config_path = path / "adapter_config.json"
    if not config_path.is_file():
        raise LoRAAdapterError(name, str(path), "no adapter_config.json (not a PEFT adapter)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise LoRAAdapterError(name, str(path), f"adapter_config.json is not JSON: {e}") \
            from None
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoRAAdapterError(name, str(path), f"peft_type {kind} is not LoRA")
    refused = [("use_dora", "DoRA (use_dora)"), ("modules_to_save", "modules_to_save"),
               ("fan_in_fan_out", "fan_in_fan_out"), ("trainable_token_indices",
                                                      "trainable_token_indices")]
    for key, what in refused:
        if config.get(key):
            raise LoRAAdapterError(name, str(path), f"{what} is not supported: only plain "
                                                    "LoRA on linear layers is served")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(name, str(path), f"bias={config['bias']!r} (trained biases) "
                                                "is not supported")
    return config


def _load_peft(name: str, path: Path, args: Any,
               extra_names: Callable[[str], str | None] | None) -> LoRAAdapter:
    config = _peft_config(name, path)
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        problem = ("adapter_model.bin is a pickle: convert it to adapter_model.safetensors"
                   if (path / "adapter_model.bin").is_file() else
                   "no adapter_model.safetensors")
        raise LoRAAdapterError(name, str(path), problem)
    name_map = get_tensor_name_map(_model_arch(args.architecture), args.num_layers)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    stacked: dict[str, dict[str, np.ndarray]] = {}
    for tensor_name, entry in _open_file(weights).items():
        if "lora_embedding" in tensor_name or "lora_magnitude" in tensor_name:
            raise LoRAAdapterError(name, str(path), f"tensor {tensor_name!r}: embedding and "
                                                    "DoRA adapters are not supported")
        match = _PEFT_TENSOR.match(tensor_name)
        if match is None:
            raise LoRAAdapterError(name, str(path), f"tensor {tensor_name!r} is not a LoRA "
                                                    "A/B weight")
        module = match["module"].removeprefix(_PEFT_PREFIX)
        data = entry.data
        values = (data.astype(np.uint32) << 16).view(np.float32) if entry.dtype == "BF16" \
            else data.astype(np.float32)
        if _STACKED.match(module):
            stacked.setdefault(module, {})[match["ab"]] = values
            continue
        target = name_map.get_name(module + ".weight", try_suffixes=(".weight",)) or \
            (extra_names and extra_names(module + ".weight"))
        if target is None:
            raise LoRAAdapterError(name, str(path), f"target module {module!r}: the model "
                                                    "has no such linear layer")
        pairs.setdefault(target.removesuffix(".weight"), {})[match["ab"]] = values
    alpha = float(config.get("lora_alpha", 8))
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    adapter = LoRAAdapter(name, str(path), 0, "hf")
    for module, ab in pairs.items():
        a, b = _pair(name, str(path), module, ab.get("A"), ab.get("B"))
        module_alpha = _pattern_value(alpha_pattern, module, alpha, name_map)
        _add(adapter, module, a, b, module_alpha, rslora)
    for module, ab in stacked.items():
        for expert_module, a, b in _split_stacked(adapter, module, ab, args):
            _add(adapter, expert_module, a, b, alpha, rslora)
    return adapter


def _add(adapter: LoRAAdapter, module: str, a: np.ndarray, b: np.ndarray, alpha: float,
         rslora: bool) -> None:
    r = a.shape[0]
    adapter.modules[module] = (a, b, alpha / math.sqrt(r) if rslora else alpha / r)
    adapter.rank = max(adapter.rank, r)


def _split_stacked(adapter: LoRAAdapter, module: str, ab: dict[str, np.ndarray], args: Any
                   ) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """One of transformers 5's stacked expert parameters under PEFT's `target_parameters`
    -> (module, A, B) per expert and projection. Which parameter a wrapper holds is told
    by its shapes (gate_up: [E r, D] / [2F, E r]; down: [E r, F] / [D, E r]), which never
    agree, as PEFT's nesting order (`.base_layer`) does not say."""
    a, b = _pair(adapter.name, adapter.path, module, ab.get("A"), ab.get("B"))
    num, d, f = args.num_experts, args.hidden_size, args.moe_intermediate_size
    layer = _STACKED.match(module)["layer"]
    if num and a.shape[0] % num == 0 and (a.shape[1], b.shape[0]) == (d, 2 * f):
        projections = (("ffn_gate", 0), ("ffn_up", f))
    elif num and a.shape[0] % num == 0 and (a.shape[1], b.shape[0]) == (f, d):
        projections = (("ffn_down", 0),)
    else:
        raise LoRAAdapterError(adapter.name, adapter.path, f"{module}: lora_A {a.shape} / "
                               f"lora_B {b.shape} fit neither stacked expert parameter of "
                               f"this model ({num} experts, hidden {d}, expert width {f})")
    r = a.shape[0] // num
    out = []
    for e in range(num):
        a_e, b_e = a[e * r:(e + 1) * r], b[:, e::num]
        for proj, lo in projections:
            rows = b_e.shape[0] // len(projections)
            out.append((f"blk.{layer}.{proj}.{e}", a_e, np.ascontiguousarray(b_e[lo:lo + rows])))
    return out


def _pattern_value(patterns: dict, module: str, default: float, name_map) -> float:
    """PEFT's alpha_pattern: a key matching the end of the module's HF name (as a regular
    expression) overrides lora_alpha. Matched against the GGUF name's HF forms."""
    if not patterns:
        return default
    hf_names = [k for k, v in name_map.mapping.items() if v[1] == module]
    for key, value in patterns.items():
        if any(re.match(rf"(.*\.)?({key})$", hf) for hf in hf_names):
            return float(value)
    return default


def _pair(name: str, path: str, module: str, a: np.ndarray | None, b: np.ndarray | None
          ) -> tuple[np.ndarray, np.ndarray]:
    if a is None or b is None:
        raise LoRAAdapterError(name, path, f"{module}: has lora_A without lora_B or the "
                                           "reverse")
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise LoRAAdapterError(name, path, f"{module}: lora_A {a.shape} and lora_B {b.shape} "
                                           "do not make a rank-r pair")
    return a, b


def _load_gguf(name: str, path: Path) -> LoRAAdapter:
    gguf = GGUFFile(path)
    try:
        if gguf.get("general.type") != "adapter" or gguf.get("adapter.type") != "lora":
            raise LoRAAdapterError(name, str(path), "is not a GGUF LoRA adapter "
                                                    "(general.type = adapter, adapter.type "
                                                    "= lora)")
        alpha = float(gguf.get("adapter.lora.alpha") or 0.0)
        pairs: dict[str, dict[str, np.ndarray]] = {}
        half = all(info.ggml_type == GGMLQuantizationType.F16 for info in gguf.tensors.values())
        for tensor_name, info in gguf.tensors.items():
            match = _GGUF_TENSOR.match(tensor_name)
            if match is None:
                raise LoRAAdapterError(name, str(path), f"tensor {tensor_name!r} is not a "
                                                        "LoRA A/B weight")
            values = quant.dequantize(gguf.raw(tensor_name), info.ggml_type, info.shape)
            pairs.setdefault(match["module"], {})[match["ab"].upper()] = \
                np.array(values, dtype=np.float32)
    finally:
        gguf.close()
    adapter = LoRAAdapter(name, str(path), 0, "gguf", half=half)
    for module, ab in _per_expert(pairs).items():
        a, b = _pair(name, str(path), module, ab.get("A"), ab.get("B"))
        r = a.shape[0]
        adapter.modules[module] = (a, b, alpha / r if alpha else 1.0)
        adapter.rank = max(adapter.rank, r)
    return adapter


def _per_expert(pairs: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """A GGUF adapter's stacked expert pairs (`blk.N.ffn_up_exps`, [E, ...] each) split into
    one per expert (`blk.N.ffn_up.E`); other modules as they are."""
    out = {}
    for module, ab in pairs.items():
        stacked = module.endswith("_exps") and all(v.ndim == 3 for v in ab.values())
        if not stacked or len({len(v) for v in ab.values()}) != 1:     # _pair refuses it
            out[module] = ab
            continue
        base = module.removesuffix("_exps")
        for e in range(len(next(iter(ab.values())))):
            out[f"{base}.{e}"] = {k: np.ascontiguousarray(v[e]) for k, v in ab.items()}
    return out
