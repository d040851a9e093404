"""The default `--gguf-activations quantized` gives llama.cpp's own greedy tokens on the
compiled CPU backend: SmolLM2 Q4_1 and Gemma 3 270M Q4_K_M, 12 of the golden prompts (one of
436-452 tokens) in one batch, against tests/golden/llamacpp_{model}_greedy.json
(tests/oracle/make_llamacpp_golden.py: llama.cpp 0.3.36 built with AVX-512, flash attention
off, F16 cache). Every op computes in ggml's float order (bench/llamacpp_tensors.py checks
each on llama.cpp's inputs), each request's rows in the kernels llama.cpp would choose for it
alone (Gemma's repacked Q4_K GEMM and GEMV, the tiled Q6_K matmul, Q scaled before
attention), so the tokens are equal, not near: no near-tie allowance; with ngram speculation
too, at tensor parallel sizes 2 and 3, in a batch of 32 whose prompts are chunked and
whose requests are preempted and recomputed, and again from the prefix cache (a prompt's last rows computed without the rest; its last row
alone in a step, `_last_row_alone`). The 16-lane orders of that build are emulated on any
host (`VLLM_ACTORS_GGML_WIDTH=16`). A llama.cpp built without AVX-512 gives other tokens
(tests/golden/llamacpp_{model}_avx2_greedy.json; 6 and 7 of 14 prompts as the AVX-512
build's): both models on the avx2 path with attention in its 8 lanes give those.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
STEPS = 32
LONG = "chat_long_essay"


# ngram speculation: each verification row runs as a one-row request (llama.cpp decoding
# alone computes those tokens one at a time), so the tokens stay llama.cpp's
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "disable_by_batch_size": None}


# tensor parallelism: o_proj and down split by output rows over all-gathered inputs
# (`ShardPlan.gathered`), so each output is one dot over the whole input, as llama.cpp's; 3
# ranks (SmolLM2's 9 heads), and 2 with Gemma's one KV head on both.
# A batch of 32 (the cases cycled) whose prompts the step budget chunks: each prompt row takes
# the kernels llama.cpp picks for its call of the whole prompt (`qmatmul.RowPlaces`; Gemma's
# repacked Q4_K splits GEMM and GEMV rows by the call's size); 200 KV blocks for them, so
# requests are preempted, and each recomputes its generated tokens as one-row requests
# (llama.cpp computed them one at a time; as prompt rows 2 of 32 had parted)
CHUNKED = {"max_num_batched_tokens": 128, "max_num_seqs": 32, "max_model_len": 512,
           "num_gpu_blocks_override": 200}


# a llama.cpp built without AVX-512 (tests/golden/llamacpp_{model}_avx2_greedy.json): every
# kernel on the avx2 path and attention in its 8 lanes (`ggml_attention8`), as on such a host
BUILDS = {"avx512": ("", {"VLLM_ACTORS_GGML_WIDTH": "16"}),
          "avx2": ("_avx2", {"VLLM_ACTORS_GGML_WIDTH": "8", "VLLM_ACTORS_CPU_ISA": "avx2"})}


@pytest.mark.parametrize(("model", "spec", "engine", "build"), [
    ("smollm2", None, {}, "avx512"), ("gemma3_270m", None, {}, "avx512"),
    ("smollm2", NGRAM, {}, "avx512"), ("smollm2", None, {"tensor_parallel_size": 3}, "avx512"),
    ("gemma3_270m", None, {"tensor_parallel_size": 2}, "avx512"),
    ("gemma3_270m", None, CHUNKED, "avx512"), ("gemma3_270m", None, {}, "avx2"),
    ("smollm2", None, {}, "avx2")],
    ids=["smollm2", "gemma3_270m", "smollm2-ngram", "smollm2-tp3", "gemma3_270m-tp2",
         "gemma3_270m-chunked32", "gemma3_270m-avx2", "smollm2-avx2"])
def test_greedy_tokens_equal_llama_cpp(model, spec, engine, build, smollm2_path, monkeypatch):
    from vllm_actors import LLM, SamplingParams
    from vllm_actors.loaders.pypi_models import model_path
    suffix, env = BUILDS[build]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    golden = json.loads((GOLDEN / f"llamacpp_{model}{suffix}_greedy.json").read_text())
    assert golden["flash_attn_type"] == "disabled"
    assert ("AVX512 = 1" in golden["system_info"]) == (build == "avx512")
    cases = [c for c in golden["cases"] if len(c["prompt_token_ids"]) < 100 or c["name"] == LONG]
    assert len(cases) == 12
    if engine is CHUNKED:
        cases = [cases[i % len(cases)] for i in range(32)]
    path = smollm2_path if model == "smollm2" else model_path("gemma3-270m")
    assert path is not None, "run `python -m vllm_actors pull gemma3-270m`"
    again = not engine and spec is None and build == "avx512"   # again, from the prefix cache
    llm = LLM(str(path), device="cpu", enable_prefix_caching=again,
              speculative_config=spec, **{"max_model_len": 1024, **engine})
    try:
        prompts = [{"prompt_token_ids": c["prompt_token_ids"]} for c in cases]
        greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
        outs = llm.generate(prompts, greedy)
        if again:       # the prompts again, the cache holding all but their last rows
            outs += llm.generate(prompts, greedy)
            cases = cases + cases
            _last_row_alone(llm, max((p["prompt_token_ids"] for p in prompts), key=len))
        if spec:
            assert llm.get_metrics()["vllm:spec_decode_num_accepted_tokens"] > 0
        if engine is CHUNKED:
            assert llm.get_metrics()["vllm:num_preemptions"] > 0
    finally:
        llm.shutdown()
    parted = [(c["name"], next(i for i, (a, b) in enumerate(zip(o.outputs[0].token_ids,
                                                                c["tokens"])) if a != b))
              for c, o in zip(cases, outs) if list(o.outputs[0].token_ids) != c["tokens"][:STEPS]]
    assert not parted, f"tokens part from llama.cpp's (case, step): {parted}"


def _last_row_alone(llm, prompt: list[int]) -> None:
    """33 tokens of `prompt` twice: the second time the prefix cache holds 32 (two blocks),
    and a step computes the last row alone. Its logprobs must be the first time's bit for
    bit (a row alone had killed the engine in the pair kernels of interleaved weights)."""
    from vllm_actors import SamplingParams
    assert len(prompt) >= 33
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=8)
    first, cached = (llm.generate({"prompt_token_ids": prompt[:33]}, params)[0].outputs[0]
                     for _ in range(2))
    assert {t: p.logprob for t, p in cached.logprobs[0].items()} == \
        {t: p.logprob for t, p in first.logprobs[0].items()}
