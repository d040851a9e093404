"""Pooling: how a pooling model turns a prompt's final hidden states into its output.

`PoolerConfig` says how tokens are pooled (LAST, MEAN, CLS or ALL) and what follows (L2
normalization of embeddings, softmax/sigmoid of class logits), read from `--pooler-config`,
else from a sentence-transformers directory (`modules.json`, the Pooling module's
`config.json`), else the architecture's default (CLS for encoders, LAST for decoders), as
vLLM resolves it. `pool_request` computes one request's output on host float32 arrays.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from vllm_actors.errors import ValidationError
from vllm_actors.pooling_params import PoolingParams

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
# sentence-transformers' pooling modes, in the order its Pooling module checks them
_ST_MODES = (("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_lasttoken", "LAST"))


@dataclass(frozen=True)
class PoolerConfig:
    """pooling_type: one of POOLING_TYPES; normalize: L2-normalize embeddings unless a
    request says otherwise; softmax: class logits through softmax (sigmoid for one label)
    unless a request says otherwise."""

    pooling_type: str = "CLS"
    normalize: bool = True
    softmax: bool = True


def parse_pooler_config(text: str | dict | None) -> dict[str, Any]:
    """`--pooler-config` JSON -> the settings it names. Raises ValidationError."""
    if text is None or text == "":
        return {}
    try:
        found = json.loads(text) if isinstance(text, str) else dict(text)
    except ValueError as e:
        raise ValidationError(f"--pooler-config is not valid JSON ({e})",
                              "pooler_config") from None
    if not isinstance(found, dict):
        raise ValidationError("--pooler-config must be a JSON object", "pooler_config")
    unknown = sorted(set(found) - {"pooling_type", "normalize", "softmax", "activation"})
    if unknown:
        raise ValidationError(f"--pooler-config has unknown keys {unknown}; known: "
                              "pooling_type, normalize, softmax", "pooler_config")
    kind = found.get("pooling_type")
    if kind is not None and str(kind).upper() not in POOLING_TYPES:
        raise ValidationError(f"--pooler-config pooling_type {kind!r} is not one of "
                              f"{', '.join(POOLING_TYPES)}", "pooler_config")
    settings: dict[str, Any] = {}
    if kind is not None:
        settings["pooling_type"] = str(kind).upper()
    for key in ("normalize", "softmax"):
        if found.get(key) is not None:
            settings[key] = bool(found[key])
    if found.get("activation") is not None:
        settings["softmax"] = bool(found["activation"])
    return settings


def sentence_transformers_pooling(model_dir: Path) -> str | None:
    """The pooling type of a sentence-transformers directory's Pooling module (None: not
    such a directory, or a mode we do not serve)."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            config = _read_json(model_dir / str(module.get("path", "")) / "config.json") or {}
            for key, kind in _ST_MODES:
                if config.get(key):
                    return kind
    return None


def is_sentence_transformers(model_dir: Path) -> bool:
    return model_dir.is_dir() and (model_dir / "modules.json").is_file()


def resolve_pooler_config(model_dir: Path | None, default_type: str,
                          user: str | dict | None = None) -> PoolerConfig:
    """`--pooler-config` over the sentence-transformers directory over the default."""
    config = PoolerConfig(pooling_type=default_type)
    if model_dir is not None and model_dir.is_dir():
        kind = sentence_transformers_pooling(model_dir)
        if kind is not None:
            config = replace(config, pooling_type=kind)
    return replace(config, **parse_pooler_config(user))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# -- the math, on host float32 ---------------------------------------------------------
def pool_tokens(hidden: np.ndarray, pooling_type: str) -> np.ndarray:
    """One request's hidden states [n, D] -> [D] (CLS: the first token, LAST: the last,
    MEAN: their mean) or [n, D] (ALL)."""
    if pooling_type == "CLS":
        return hidden[0].copy()
    if pooling_type == "LAST":
        return hidden[-1].copy()
    if pooling_type == "MEAN":
        return hidden.sum(axis=0, dtype=np.float32) / np.float32(len(hidden))
    return hidden.copy()


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """x / max(||x||, 1e-12) along the last axis (torch's F.normalize)."""
    norm = np.sqrt(np.einsum("...i,...i->...", x, x, dtype=np.float32))
    return (x / np.maximum(norm, np.float32(1e-12))[..., None]).astype(np.float32)


def activation(logits: np.ndarray) -> np.ndarray:
    """Softmax over the labels, or the sigmoid of a single label's logit."""
    if logits.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
    return (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)


def pool_request(hidden: np.ndarray, params: PoolingParams, config: PoolerConfig,
                 model: Any) -> np.ndarray:
    """One request's output: an embedding [D'] (embed), per-token vectors [n, D]
    (encode), or label scores [L] (classify, score: through the model's classifier)."""
    if params.task in ("classify", "score"):
        logits = model.classify(pool_tokens(hidden, "CLS")[None, :])[0]
        use = config.softmax if params.activation is None else params.activation
        return activation(logits) if use else logits
    kind = "ALL" if params.task == "encode" else config.pooling_type
    if kind == "ALL" and params.task == "embed":
        kind = "MEAN"
    out = pool_tokens(hidden, kind)
    if params.dimensions is not None:
        out = out[..., :params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    return l2_normalize(out) if normalize else out.astype(np.float32)
