"""Gemma 3 270M (Q4_K_M GGUF from PyPI, `vllm-actors pull gemma3-270m`) against transformers
fp32 on the same file, under the exact semantics (`--gguf-activations float32`): greedy tokens
identical for 64 steps on every golden prompt (a difference only at a near-tie) on the
compiled backend, in one batch; the numpy reference backend's logits at the stored steps
within 1e-3 (the golden tokens run as a prompt: the whole sequence's logits); and a chat
through the server with Gemma's template. The compiled backend runs Gemma under the default
semantics against llama.cpp in test_llamacpp_parity.py."""

import os

import numpy as np
import pytest
from golden_files import GOLDEN, load_golden

from vllm_actors import SamplingParams

GREEDY = load_golden("gemma3_270m_greedy.json")
LOGITS = np.load(GOLDEN / "gemma3_270m_logits.npz")
NEAR_TIE = 1e-4
LOGIT_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def gemma3_path():
    from vllm_actors.loaders.pypi_models import model_path
    path = model_path("gemma3-270m")
    if path is None:
        message = "Gemma 3 270M is not installed: run `python -m vllm_actors pull gemma3-270m`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def test_golden_set_is_broad():
    cases = GREEDY["cases"]
    assert len(cases) >= 12 and GREEDY["num_generated"] == 64
    assert {c["kind"] for c in cases} == {"chat", "plain"}
    assert sum(len(c["prompt_token_ids"]) >= 400 for c in cases) >= 2


@pytest.fixture(scope="module", params=["cpu"])
def greedy_outputs(request, gemma3_path):
    from vllm_actors import LLM
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY["num_generated"], ignore_eos=True)
    prompts = [{"prompt_token_ids": case["prompt_token_ids"]} for case in GREEDY["cases"]]
    with LLM(str(gemma3_path), gguf_activations="float32",
             device=request.param, max_model_len=4096) as llm:
        outs = llm.generate(prompts, params)
    return {case["name"]: out.outputs[0].token_ids for case, out in zip(GREEDY["cases"], outs)}


@pytest.mark.parametrize("case", GREEDY["cases"], ids=lambda c: c["name"])
def test_greedy_tokens_match_transformers(greedy_outputs, case):
    ours, golden = greedy_outputs[case["name"]], case["tokens"]
    assert len(ours) == len(golden)
    diff = next((i for i, (a, b) in enumerate(zip(ours, golden)) if a != b), None)
    if diff is not None:
        margin = case["top2_margins"][diff]
        assert margin < NEAR_TIE, f"tokens differ at step {diff} with a clear margin {margin}"


@pytest.fixture(scope="module")
def gemma3_model(gemma3_path):
    from vllm_actors.kernels.numpy_backend import NumpyBackend
    from vllm_actors.loaders.model_files import resolve_model
    from vllm_actors.models.registry import load_model
    backend = NumpyBackend()
    return load_model(resolve_model(gemma3_path), backend), backend


@pytest.mark.parametrize("case", GREEDY["cases"][::3], ids=lambda c: c["name"])
def test_logits_match_transformers(gemma3_model, case):
    """Logits of the stored steps, recomputed by running prompt + golden tokens as a prompt."""
    from model_driver import golden_step_logit_error
    model, backend = gemma3_model
    worst = golden_step_logit_error(model, backend, case, GREEDY["logit_steps"], LOGITS)
    assert worst <= LOGIT_TOLERANCE, f"max |logits - transformers| = {worst:.2e}"


def test_chat_through_the_server(gemma3_path):
    """The openai client chats with Gemma's template (the file ships none: the built-in one
    applies) and the answer stops at <end_of_turn>. On the default device and semantics (the
    compiled CPU backend under llama.cpp's semantics)."""
    import openai
    from server_process import ServerProcess

    from vllm_actors.loaders.tokenizer import get_tokenizer
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    expected_ids = get_tokenizer(gemma3_path).apply_chat_template(messages,
                                                                  add_generation_prompt=True)
    proc = ServerProcess(str(gemma3_path), "--max-model-len", "2048")
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model=client.models.list().data[0].id,
                                               messages=messages, max_tokens=48, temperature=0)
    finally:
        assert proc.stop() == 0, proc.log()
    assert reply.usage.prompt_tokens == len(expected_ids)
    assert reply.choices[0].message.content.strip()
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_tokenizer_matches_llama_cpp(gemma3_path):
    """Gemma's SentencePiece vocabulary (262k pieces, no space prefix) tokenizes as llama.cpp
    does (golden ids from llama-cpp-python)."""
    from vllm_actors.loaders.tokenizer import get_tokenizer
    pinned = load_golden("tokenizer.json")["gemma3_270m"]
    tokenizer = get_tokenizer(gemma3_path)
    wrong = {text: (tokenizer.encode(text, add_special_tokens=False), ids)
             for text, ids in pinned.items()
             if tokenizer.encode(text, add_special_tokens=False) != ids}
    assert len(pinned) >= 20 and not wrong
