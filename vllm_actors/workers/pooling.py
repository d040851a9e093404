"""The model runner's pooling side: which runner a model gets, and each pooling request's
output from the step's hidden states.

`--runner auto` gives encoders (BERT) and sentence-transformers directories the pooling
runner, everything else the generate runner; `--runner pooling` (or `--convert embed`) on a
decoder pools its final-normed hidden states (LAST by default, for Qwen3-Embedding-style
models). A pooling request's whole prompt is in one step (the scheduler never chunks it), so
its output is computed from that step's rows alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_actors.errors import ValidationError
from vllm_actors.models.pooler import (PoolerConfig, is_sentence_transformers, pool_request,
                                       resolve_pooler_config)
from vllm_actors.pooling_params import PoolingParams
from vllm_actors.protocol.engine import PooledOutput


@dataclass
class Pooling:
    """A pooling model's runner state: its pooler settings, the tasks it serves, and the
    PoolingParams of the requests it holds."""

    config: PoolerConfig
    tasks: list[str]
    params: dict[str, PoolingParams]

    def pool(self, model: Any, hidden: np.ndarray, req_ids: list[str],
             bounds: np.ndarray, done: np.ndarray) -> dict[str, PooledOutput]:
        """The outputs of the requests `done` (indices into req_ids) from host hidden
        states [T, D], each request's rows bounds[i]:bounds[i + 1]."""
        out = {}
        for i in done.tolist():
            req_id = req_ids[i]
            value = pool_request(hidden[bounds[i]:bounds[i + 1]], self.params[req_id],
                                 self.config, model)
            out[req_id] = PooledOutput(list(value.shape),
                                       np.ascontiguousarray(value, np.float32).tobytes())
        return out


def resolve_runner(runner: str, model: Any, model_dir: Path | None) -> str:
    """"generate" or "pooling". Raises ValidationError for an encoder asked to generate."""
    encoder = getattr(model, "encoder_only", False)
    if runner == "auto":
        st = model_dir is not None and is_sentence_transformers(model_dir)
        return "pooling" if encoder or st else "generate"
    if runner == "generate" and encoder:
        raise ValidationError(f"{model.args.architecture} is an encoder: it cannot generate "
                              "text; serve it with --runner pooling", "runner")
    return runner


def make_pooling(model: Any, model_dir: Path | None, user_config: str | None) -> Pooling:
    """The pooling state of a model the pooling runner serves. Raises ValidationError for
    a bad --pooler-config."""
    default = getattr(model.args, "pooling_type", "LAST")
    config = resolve_pooler_config(model_dir, default, user_config)
    tasks = ["embed", "encode"]
    if getattr(model.args, "id2label", ()):
        tasks += ["classify", "score"]
    return Pooling(config, tasks, {})


def sentence_max_length(model_dir: Path | None) -> int | None:
    """sentence-transformers' `max_seq_length` (its sentence_bert_config.json), which bounds
    the model's length as vLLM reads it."""
    if model_dir is None or not model_dir.is_dir():
        return None
    try:
        found = json.loads((model_dir / "sentence_bert_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    value = found.get("max_seq_length") if isinstance(found, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None
