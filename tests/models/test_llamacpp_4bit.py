"""The 4-bit types llama.cpp repacks on x86 (Q4_0, IQ4_NL) against llama.cpp itself
(tests/golden/llamacpp_granite_4bit.npz from tests/oracle/make_llamacpp_4bit_golden.py): the
tiny granite with every matrix in one type, under the default semantics.

- Matmuls: layer 0's output and down projections fed llama.cpp's own inputs give its outputs
  bit for bit, at the 17-row prefill and at a one-token step, in the order of its 8-row
  interleaved kernels (it repacks these weights on hosts with AVX2, as here; the down
  projection's 96 columns are an odd count of blocks).
- IQ4_NL end to end: a prefill and 8 single-token steps give llama.cpp's logits bit for bit
  (its float16 KV cache); the numpy reference is within float order, and the float32
  semantics is not (so the check tells the semantics apart).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from family_gguf import write_family_gguf
from gguf import GGMLQuantizationType as QT
from golden_files import GOLDEN
from model_driver import prompt_logits
from tiny_lora import LORA_PROMPT

from vllm_actors.kernels import get_backend
from vllm_actors.kernels.cpu import isa
from vllm_actors.kernels.cpu.backend import Linear
from vllm_actors.kernels.kv_quant import kv_format
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.registry import load_model

GOLDENS = np.load(GOLDEN / "llamacpp_granite_4bit.npz")
PREFILL, STEPS = 17, 8
REPACKS = "avx2" in isa.available()      # llama.cpp repacks these weights only with AVX2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("granite4")
    out = {}
    for qtype in ("Q4_0", "IQ4_NL"):
        path = root / f"granite-{qtype}.gguf"
        write_family_gguf(path, "granite", qtype=QT[qtype])
        out[qtype] = path
    return out


@pytest.mark.skipif(not REPACKS, reason="llama.cpp repacks Q4_0 / IQ4_NL only with AVX2")
@pytest.mark.parametrize("qtype", ["Q4_0", "IQ4_NL"])
def test_matmuls_give_llamacpp_floats(models, qtype):
    backend = get_backend("cpu")
    layer = load_model(resolve_model(str(models[qtype])), backend,
                       gguf_activations="quantized").layers[0]
    key = qtype.lower()
    for when, rows in (("prefill", PREFILL), ("step", 1)):
        for x, y, weight in (("kqv_out-0", "attn_out-0", layer.attn_out),
                             ("ffn_swiglu-0", "ffn_out-0", layer.mlp.down)):
            inputs, want = GOLDENS[f"{key}/{when}/{x}"], GOLDENS[f"{key}/{when}/{y}"]
            assert inputs.shape[0] == rows
            assert weight.parts[0].ggml_repacked
            assert np.array_equal(backend.linear(inputs, weight), want), (when, y)
            # the same weights as stored (the backend keeps them interleaved): the same
            # floats in the same order, and others in vec_dot's, which must part from it
            stored = tuple(_as_stored(p) for p in weight.parts)
            assert np.array_equal(backend.linear(inputs, Linear(stored, weight.formats)), want)
            plain = Linear(tuple(replace(p, ggml_repacked=False) for p in stored),
                           weight.formats)
            if when == "step":        # the order matters: vec_dot's parts from it
                assert not np.array_equal(backend.linear(inputs, plain), want), (when, y)


def _as_stored(m):  # type: ignore[no-untyped-def]
    """A matrix `qmatmul.interleave` stored 16 rows interleaved, with its rows as stored
    again: each plane's 4-byte words (or 2-byte values) moved back row by row."""
    if not m.interleaved:
        return m
    nb = m.cols // 32

    def back(plane):  # type: ignore[no-untyped-def]
        n = plane.shape[0]
        units = plane if plane.dtype == np.uint16 else plane.view(np.uint32)
        per_block = units.shape[1] // nb
        rows = units.reshape(n // 16, nb, per_block, 16).transpose(0, 3, 1, 2)
        return np.ascontiguousarray(rows).reshape(units.shape).view(plane.dtype)
    return replace(m, planes=tuple(back(p) for p in m.planes), interleaved=False)


def test_iq4_nl_gives_llamacpp_logits(models):
    want = GOLDENS["iq4_nl/repacked" if REPACKS else "iq4_nl/logits"]
    prompt, rows = LORA_PROMPT[:PREFILL + STEPS], slice(PREFILL - 1, PREFILL + STEPS)
    got = {}
    for device, semantics in (("cpu", "quantized"), ("numpy", "quantized"),
                              ("cpu", "float32")):
        backend = get_backend(device)
        model = load_model(resolve_model(str(models["IQ4_NL"])), backend,
                           gguf_activations=semantics)
        cache = kv_format("float16", ggml_products=semantics == "quantized")
        got[device, semantics] = prompt_logits(model, backend, prompt, [PREFILL] + [1] * STEPS,
                                               kv_format=cache)[rows]
    assert np.array_equal(got["cpu", "quantized"], want)
    assert np.abs(got["numpy", "quantized"] - want).max() < 1e-5
    assert np.abs(got["cpu", "float32"] - want).max() > 1e-3
