"""The BERT family: an encoder, run as a pooling model (embeddings, classification, reranking).

Per layer: fused QKV with biases -> bidirectional attention over the request's own tokens
(no KV cache: a request runs in one pass) -> output projection -> post-LayerNorm of the
residual sum; then an ungated GELU (erf) MLP with biases -> post-LayerNorm. The input is the
sum of word, absolute position and token-type embeddings, LayerNormed.

`BertForSequenceClassification` checkpoints (cross-encoders) add the pooler (dense + tanh on
the [CLS] token) and a classifier; they load as GGUF's `cls` and `cls.output`, as llama.cpp
names them, and `classify` applies both on the host.

Loads from safetensors (`BertModel`, with or without the `bert.` prefix) and from llama.cpp's
BERT GGUFs (`general.architecture = bert`). One rank, one stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import gguf as gguf_py
import numpy as np

from vllm_actors.errors import ModelFormatError, ValidationError
from vllm_actors.kernels.ops import AttentionMetadata, Backend
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.weights import WeightSet
from vllm_actors.models.base import ModelArgs, ParallelGroup, PipelineStage
from vllm_actors.models.decoder import Norm
from vllm_actors.models.family import Family
from vllm_actors.models.hparams import gguf_common, hf_common

# llama.cpp's `pooling_type` metadata values
_GGUF_POOLING = {1: "MEAN", 2: "CLS", 3: "LAST"}
_HF_POOLER = "hf_pooler"   # the HF pooler's name between loading and `sanitize`
_MAX_LAYERS = 256   # layers the name map covers for `bert.`-prefixed checkpoints
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class BertArgs(ModelArgs):
    """ModelArgs plus what an encoder adds: token types, its default pooling, its labels."""

    type_vocab_size: int = 2
    pooling_type: str = "CLS"
    id2label: tuple[str, ...] = ()     # classifier labels (empty: no classifier)
    is_matryoshka: bool = False        # embeddings may be cut to fewer dimensions


def _labels(config: dict[str, Any]) -> tuple[str, ...]:
    archs = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        return ()
    id2label = config.get("id2label") or {}
    num = int(config.get("num_labels") or len(id2label) or 2)
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num))


def args_from_hf(config: dict[str, Any]) -> BertArgs:
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValidationError(f"BERT position_embedding_type "
                              f"{config['position_embedding_type']!r} is not supported "
                              "(absolute only)", "model")
    common = hf_common(config, "bert")
    common["rms_norm_eps"] = float(config.get("layer_norm_eps", 1e-12))
    common["attention_bias"] = True
    act = config.get("hidden_act", "gelu")
    return BertArgs(**common, hidden_act=_ACTIVATIONS.get(act, act), gated_mlp=False,
                    mlp_bias=True, attn_out_bias=True, norm_type="layer",
                    norm_bias=True, norm_placement="post",
                    type_vocab_size=int(config.get("type_vocab_size", 2)),
                    id2label=_labels(config),
                    is_matryoshka=bool(config.get("is_matryoshka")
                                       or config.get("matryoshka_dimensions")))


def args_from_gguf(gguf: GGUFFile) -> BertArgs:
    common = gguf_common(gguf)
    common["rms_norm_eps"] = float(gguf.arch_get("attention.layer_norm_epsilon", 1e-12))
    types = gguf.tensors.get("token_types.weight")
    labels = gguf.arch_get("classifier.output_labels") or []
    if not labels and "cls.output.weight" in gguf.tensors:
        labels = [f"LABEL_{i}" for i in range(gguf.tensors["cls.output.weight"].shape[0])]
    return BertArgs(**common, hidden_act="gelu", gated_mlp=False, mlp_bias=True,
                    attn_out_bias=True, norm_type="layer", norm_bias=True,
                    norm_placement="post", type_vocab_size=types.shape[0] if types else 0,
                    pooling_type=_GGUF_POOLING.get(int(gguf.arch_get("pooling_type", 2)), "CLS"),
                    id2label=tuple(str(x) for x in labels))


def hf_name(name: str) -> str | None:
    """Names gguf-py's BERT map lacks: the `bert.` prefix of task checkpoints, and the
    pooler, under a name of its own until `sanitize` (the map already takes `classifier`
    to `cls`, llama.cpp's name of the pooler)."""
    if name.startswith("bert."):
        name = name[len("bert."):]
    if name.startswith("pooler.dense."):
        return _HF_POOLER + name[len("pooler.dense"):]
    return _name_map().get_name(name, try_suffixes=(".weight", ".bias"))


def sanitize(weights: WeightSet, args: ModelArgs, kind: str) -> WeightSet:
    """A safetensors classifier and pooler under llama.cpp's names: the pooler as `cls`,
    the classifier as `cls.output`."""
    if kind != "safetensors":
        return weights
    tensors = dict(weights.tensors)
    for part in ("weight", "bias"):
        classifier = tensors.pop(f"cls.{part}", None)
        pooler = tensors.pop(f"{_HF_POOLER}.{part}", None)
        if classifier is not None:
            tensors[f"cls.output.{part}"] = classifier
        if pooler is not None:
            tensors[f"cls.{part}"] = pooler
    return WeightSet(tensors, weights.path, weights.activations)


@functools.cache
def _name_map() -> Any:
    return gguf_py.get_tensor_name_map(gguf_py.MODEL_ARCH.BERT, _MAX_LAYERS)


@dataclass
class EncoderLayer:
    qkv: Any
    qkv_bias: Any
    attn_out: Any
    attn_out_bias: Any
    attn_norm: Norm
    up: Any
    up_bias: Any
    down: Any
    down_bias: Any
    out_norm: Norm


class BertModel:
    """An encoder on any backend: `forward` returns the last layer's hidden states [T, D]
    of every token; each request of the step attends to its own tokens only.

    Raises:
        ValidationError: tensor or pipeline parallelism (an encoder runs on one rank).
        ModelFormatError: a tensor is missing or shaped unlike the config.
    """

    encoder_only = True

    def __init__(self, args: BertArgs, weights: WeightSet, backend: Backend,
                 tp: ParallelGroup | None = None, stage: PipelineStage | None = None) -> None:
        if (tp is not None and tp.world_size > 1) or (stage is not None and stage.size > 1):
            raise ValidationError("an encoder model runs on one rank: use "
                                  "--tensor-parallel-size 1 --pipeline-parallel-size 1",
                                  "tensor_parallel_size")
        self.args, self.backend = args, backend
        self.layer_ids = range(args.num_layers)
        self.scale = 1.0 / float(np.sqrt(args.head_dim))
        b = backend
        self.word = b.upload_table(weights.require("token_embd.weight"))
        self.position = b.upload_table(weights.require("position_embd.weight"))
        types = weights.get("token_types.weight")
        self.types = b.upload_table(types) if types is not None else None
        self.embed_norm = self._norm(weights, "token_embd_norm")
        self.layers = [self._load_layer(weights, i) for i in self.layer_ids]
        self.classifier = self._load_classifier(weights) if args.id2label else None

    def _norm(self, weights: WeightSet, name: str) -> Norm:
        b = self.backend
        return Norm(b.upload_vector(weights.require(name + ".weight")),
                    b.upload_vector(weights.require(name + ".bias")))

    def _vector(self, weights: WeightSet, name: str) -> Any:
        return self.backend.upload_array(weights.require(name).to_float32())

    def _load_layer(self, weights: WeightSet, i: int) -> EncoderLayer:
        b, p, a = self.backend, f"blk.{i}.", self.args
        qkv = [weights.require(p + n + ".weight") for n in ("attn_q", "attn_k", "attn_v")]
        if any(t.shape != (a.hidden_size, a.hidden_size) for t in qkv):
            raise ModelFormatError(weights.path, f"{p}attn_q/k/v shapes "
                                   f"{[t.shape for t in qkv]} do not match hidden_size "
                                   f"{a.hidden_size}")
        qkv_bias = np.concatenate([weights.require(p + n + ".bias").to_float32()
                                   for n in ("attn_q", "attn_k", "attn_v")])
        return EncoderLayer(
            qkv=b.upload_linear(qkv), qkv_bias=b.upload_array(qkv_bias),
            attn_out=b.upload_linear([weights.require(p + "attn_output.weight")]),
            attn_out_bias=self._vector(weights, p + "attn_output.bias"),
            attn_norm=self._norm(weights, p + "attn_output_norm"),
            up=b.upload_linear([weights.require(p + "ffn_up.weight")]),
            up_bias=self._vector(weights, p + "ffn_up.bias"),
            down=b.upload_linear([weights.require(p + "ffn_down.weight")]),
            down_bias=self._vector(weights, p + "ffn_down.bias"),
            out_norm=self._norm(weights, p + "layer_output_norm"))

    def _load_classifier(self, weights: WeightSet) -> tuple[np.ndarray, ...]:
        """(pooler weight, bias, classifier weight, bias) as host float32."""
        names = ("cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias")
        found = [weights.require(n).to_float32() for n in names]
        if found[2].shape[0] != len(self.args.id2label):
            raise ModelFormatError(weights.path, f"the classifier has {found[2].shape[0]} "
                                   f"labels, the config {len(self.args.id2label)}")
        return tuple(found)

    # -- compute -------------------------------------------------------------------------
    def forward(self, token_ids: np.ndarray, positions: np.ndarray,
                meta: AttentionMetadata, kv_caches: list[Any],
                token_type_ids: np.ndarray | None = None, **_: Any) -> Any:
        """Hidden states [T, D]; `meta.query_start_loc` bounds each request's tokens (every
        request is whole in the step), `kv_caches` is unused."""
        b, a = self.backend, self.args
        if isinstance(meta, (list, tuple)):
            meta = meta[0]
        if positions.size and int(positions.max()) >= a.max_position_embeddings:
            raise ValidationError(f"position {int(positions.max())} is beyond the model's "
                                  f"{a.max_position_embeddings} positions", "prompt")
        h = b.add(b.embedding(self.word, token_ids), b.embedding(self.position, positions))
        if self.types is not None:
            types = np.zeros(len(token_ids), np.int64) if token_type_ids is None \
                else token_type_ids
            h = b.add(h, b.embedding(self.types, types))
        h = b.layer_norm(h, self.embed_norm.weight, self.embed_norm.bias, a.rms_norm_eps)
        bounds = meta.query_start_loc
        for layer in self.layers:
            h = self._layer(layer, h, bounds)
        return h

    def _layer(self, layer: EncoderLayer, h: Any, bounds: np.ndarray) -> Any:
        b, a, eps = self.backend, self.args, self.args.rms_norm_eps
        qkv = b.linear(h, layer.qkv, layer.qkv_bias)
        q, k, v = b.split_qkv(qkv, a.num_heads, a.num_heads, a.head_dim)
        attn = b.encoder_attention(q, k, v, bounds, self.scale)
        o = b.linear(attn, layer.attn_out, layer.attn_out_bias)
        h = b.layer_norm(b.add(o, h), layer.attn_norm.weight, layer.attn_norm.bias, eps)
        up = b.gelu(b.linear(h, layer.up, layer.up_bias), a.hidden_act == "gelu_tanh")
        down = b.linear(up, layer.down, layer.down_bias)
        return b.layer_norm(b.add(down, h), layer.out_norm.weight, layer.out_norm.bias, eps)

    def classify(self, cls_hidden: np.ndarray) -> np.ndarray:
        """[B, D] [CLS] hidden states -> [B, L] logits: tanh(pooler) then the classifier."""
        if self.classifier is None:
            raise ValidationError("this model has no classifier head (a "
                                  "*ForSequenceClassification checkpoint has one)", "task")
        w, bias, out_w, out_b = self.classifier
        pooled = np.tanh(cls_hidden.astype(np.float32) @ w.T + bias)
        return (pooled @ out_w.T + out_b).astype(np.float32)

    def compute_logits(self, hidden: Any, rows: np.ndarray, on_device: bool = False) -> Any:
        raise ValidationError("an encoder model does not generate text: it serves pooling "
                              "requests (--runner pooling)", "runner")


FAMILY = Family(
    name="bert", hf_architectures=("BertModel", "BertForSequenceClassification",
                                   "BertForMaskedLM"),
    gguf_architectures=("bert",), args_from_hf=args_from_hf, args_from_gguf=args_from_gguf,
    model_class=BertModel, sanitize=sanitize, hf_name=hf_name,
)
