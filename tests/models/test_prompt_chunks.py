"""Under the default `--gguf-activations quantized` a prompt's rows get the same floats however
the engine's steps split the prompt: whole, in chunks, or a row alone (a prefix-cache hit's
last row, a chunk of one row). llama.cpp computes the whole prompt in one call, and each op
takes the kernel that call would (`qmatmul.RowPlaces`; attention's order by
`ggml_attention.one_token`; a LoRA delta's by the same places), so a row alone must not take
a decode step's kernels: under these semantics a one-ulp difference moves a rounding of the
next linear's quantized input, and the logits then part by tenths. (A row alone on an
interleaved weight had raised in the pair kernels and killed the engine.)

SmolLM2 Q4_1 (interleaved 32-weight types) with and without a GGUF LoRA adapter; Gemma 3 270M
Q4_K_M (a repacked Q4_K split between llama.cpp's GEMM and GEMV rows, tiled Q6_K, q/k norms)."""

from __future__ import annotations

import numpy as np
import pytest
from model_driver import prompt_logits
from tiny_lora import SMOLLM2_GGUF_LORA, SMOLLM2_SHAPES, attach, write_gguf_adapter

# 33 tokens: llama.cpp's call holds them all; the splits leave rows 32, 16 and 30-31 alone
PROMPT = [(i * 911 + 7) % 30000 + 50 for i in range(33)]
SPLITS = ([32, 1], [16, 1, 16], [30, 1, 1, 1], [16, 17])


def _splits_equal_whole(model, backend) -> None:
    from vllm_actors.config import resolve_kv_dtype
    from vllm_actors.kernels.kv_quant import kv_format
    cache = kv_format(resolve_kv_dtype("auto", True), ggml_products=True)   # the engine's
    logits = [prompt_logits(model, backend, PROMPT, chunks, kv_format=cache, first_row=16,
                            one_prompt=True) for chunks in ([len(PROMPT)], *SPLITS)]
    for chunks, got in zip(SPLITS, logits[1:]):
        assert np.array_equal(got, logits[0]), (chunks, np.abs(got - logits[0]).max())


@pytest.mark.parametrize("case", ["smollm2", "smollm2-lora", "gemma3_270m"])
def test_a_prompt_split_any_way_gives_the_whole_prompts_logits(case, smollm2_path, tmp_path,
                                                               monkeypatch):
    from vllm_actors.kernels.cpu.backend import CpuBackend
    from vllm_actors.loaders.model_files import resolve_model
    from vllm_actors.loaders.pypi_models import model_path
    from vllm_actors.models.registry import load_model
    path = smollm2_path if case.startswith("smollm2") else model_path("gemma3-270m")
    assert path is not None, "run `python -m vllm_actors pull gemma3-270m`"
    monkeypatch.setenv("VLLM_ACTORS_GGML_WIDTH", "16")     # llama.cpp's attention on any host
    backend = CpuBackend()
    model = load_model(resolve_model(path), backend, gguf_activations="quantized")
    if case == "smollm2-lora":
        attach(model, write_gguf_adapter(tmp_path / "a.gguf", SMOLLM2_SHAPES,
                                         **SMOLLM2_GGUF_LORA, dtype="F32"))
    _splits_equal_whole(model, backend)
