"""SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers fp32 on the same file: greedy tokens
identical for 64 steps on every golden prompt (a difference only at a near-tie), alone and in a
batch of 32 with chunked prefill, on the default (compiled CPU) backend; logits at the stored
steps within 1e-3 on the numpy and the compiled CPU backends."""

import numpy as np
import pytest
from golden_files import GOLDEN, load_golden

from vllm_actors import SamplingParams

GREEDY = load_golden("smollm2_greedy.json")
LOGITS = np.load(GOLDEN / "smollm2_logits.npz")
NEAR_TIE = 1e-4
LOGIT_TOLERANCE = 1e-3


def first_difference(ours: list[int], golden: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, golden)) if a != b), None)


@pytest.fixture(scope="module")
def greedy_outputs(smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY["num_generated"], ignore_eos=True)
    prompts = [{"prompt_token_ids": case["prompt_token_ids"]} for case in GREEDY["cases"]]
    return {case["name"]: out.outputs[0].token_ids
            for case, out in zip(GREEDY["cases"], smollm2_llm.generate(prompts, params))}


def test_golden_set_is_broad():
    cases = GREEDY["cases"]
    assert len(cases) >= 12
    assert {c["kind"] for c in cases} == {"chat", "plain"}
    assert sum(len(c["prompt_token_ids"]) >= 400 for c in cases) >= 2


@pytest.mark.parametrize("case", GREEDY["cases"], ids=lambda c: c["name"])
def test_greedy_tokens_match_transformers(greedy_outputs, case):
    ours, golden = greedy_outputs[case["name"]], case["tokens"]
    assert len(ours) == len(golden)
    diff = first_difference(ours, golden)
    if diff is not None:
        margin = case["top2_margins"][diff]
        print(f"{case['name']}: first difference at step {diff}, golden top-2 margin {margin:.2e}")
        assert margin < NEAR_TIE, f"tokens differ at step {diff} with a clear margin {margin}"


@pytest.mark.parametrize("case", GREEDY["cases"], ids=lambda c: c["name"])
def test_logits_match_transformers(smollm2_model, case):
    """Logits of the stored steps, recomputed by running prompt + golden tokens as a prompt."""
    from model_driver import golden_step_logit_error
    model, backend = smollm2_model
    worst = golden_step_logit_error(model, backend, case, GREEDY["logit_steps"], LOGITS)
    print(f"{case['name']}: max |logits - transformers| = {worst:.2e}")
    assert worst <= LOGIT_TOLERANCE


@pytest.fixture(scope="module")
def cpu_model(smollm2_path):
    """The model on the compiled CPU backend, in this process."""
    from vllm_actors.kernels.cpu.backend import CpuBackend
    from vllm_actors.loaders.model_files import resolve_model
    from vllm_actors.models.registry import load_model
    backend = CpuBackend()
    return load_model(resolve_model(smollm2_path), backend), backend


@pytest.mark.parametrize("case", GREEDY["cases"], ids=lambda c: c["name"])
def test_cpu_backend_logits_match_transformers(cpu_model, case):
    test_logits_match_transformers(cpu_model, case)


@pytest.fixture(scope="module")
def batched_chunked_outputs(smollm2_path, mixed_prompts):
    """The golden prompts among fillers, 32 requests at once, prompts cut into 64-token chunks
    (the default device: the compiled CPU backend)."""
    from vllm_actors import LLM
    cases = GREEDY["cases"]
    fillers = sorted(mixed_prompts, key=lambda p: len(p["prompt_token_ids"]))[:32 - len(cases)]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY["num_generated"], ignore_eos=True)
    with LLM(str(smollm2_path), gguf_activations="float32",
             max_num_seqs=32, max_num_batched_tokens=64,
             enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in cases]
                            + fillers, params)
    return {case["name"]: out.outputs[0].token_ids for case, out in zip(cases, outs)}


@pytest.mark.parametrize("case", GREEDY["cases"], ids=lambda c: c["name"])
def test_greedy_tokens_in_a_chunked_batch_of_32(batched_chunked_outputs, case):
    test_greedy_tokens_match_transformers(batched_chunked_outputs, case)
