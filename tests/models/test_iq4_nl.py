"""IQ4_NL weights against llama.cpp (tests/golden/llamacpp_granite_iq4_nl.npz from
tests/oracle/make_llamacpp_iq4_nl_golden.py): the tiny granite with every matrix in IQ4_NL,
a prefill of 17 tokens and 8 single-token steps, under the default semantics with llama.cpp's
float16 KV cache. The compiled backend keeps IQ4_NL in its exact Q8_0 form and follows
llama.cpp's float order for one-row and multi-row requests (weights not repacked): its
logits are llama.cpp's bit for bit. The numpy reference is within float order; the float32
semantics is not, so the check tells the semantics apart."""

from __future__ import annotations

import numpy as np
from family_gguf import write_family_gguf
from gguf import GGMLQuantizationType as QT
from golden_files import GOLDEN
from model_driver import prompt_logits
from tiny_lora import LORA_PROMPT

from vllm_actors.kernels import get_backend
from vllm_actors.kernels.kv_quant import kv_format
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.registry import load_model

PREFILL, STEPS = 17, 8


def test_iq4_nl_gives_llamacpp_logits(tmp_path):
    path = tmp_path / "granite-iq4_nl.gguf"
    write_family_gguf(path, "granite", qtype=QT.IQ4_NL)
    golden = np.load(GOLDEN / "llamacpp_granite_iq4_nl.npz")
    want, repacked = golden["logits"], golden["repacked"]
    prompt, rows = LORA_PROMPT[:PREFILL + STEPS], slice(PREFILL - 1, PREFILL + STEPS)
    got = {}
    for device, semantics in (("cpu", "quantized"), ("numpy", "quantized"),
                              ("cpu", "float32")):
        backend = get_backend(device)
        model = load_model(resolve_model(str(path)), backend, gguf_activations=semantics)
        cache = kv_format("float16", ggml_products=semantics == "quantized")
        got[device, semantics] = prompt_logits(model, backend, prompt, [PREFILL] + [1] * STEPS,
                                               kv_format=cache)[rows]
    assert np.array_equal(got["cpu", "quantized"], want)
    assert np.abs(got["cpu", "quantized"] - repacked).max() < 1e-6    # llama.cpp's default
    assert np.abs(got["numpy", "quantized"] - want).max() < 1e-5
    assert np.abs(got["cpu", "float32"] - want).max() > 1e-3
