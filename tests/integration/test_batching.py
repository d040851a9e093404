"""Continuous batching on the real model: 48 mixed-length prompts in one call give each
prompt's tokens when run alone (near-tie rule as in the oracle tests), also with preemption;
prefix caching reuses a shared system prompt without changing outputs."""

import numpy as np
import pytest
from model_driver import prompt_logits
from oracle.prompts import LONG_CODE, LONG_ESSAY

from vllm_actors import LLM, SamplingParams

NUM_PROMPTS = 48
MAX_TOKENS = 12
NEAR_TIE = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    """48 prompts of 8..600 tokens cut from different offsets of two long texts."""
    source = smollm2_tokenizer.encode(LONG_ESSAY + "\n\n" + LONG_CODE)
    lengths = np.linspace(8, 600, NUM_PROMPTS).astype(int)
    rng = np.random.default_rng(0)
    rng.shuffle(lengths)
    out = []
    for i, n in enumerate(lengths):
        start = (i * 37) % (len(source) - n)
        out.append({"prompt_token_ids": source[start:start + n]})
    return out


@pytest.fixture(scope="module")
def alone(smollm2_path, prompts):
    """Each prompt on its own: an engine that runs one request at a time."""
    llm = LLM(str(smollm2_path), max_num_seqs=1)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    return llm, tokens


def assert_same_or_near_tie(llm, prompts, reference, outputs):
    runner = llm.client.core.executor.runner
    for prompt, ref, out in zip(prompts, reference, outputs):
        got = out.outputs[0].token_ids
        diff = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if diff is None:
            assert got == ref
            continue
        ids = prompt["prompt_token_ids"] + ref[:diff]
        row = np.sort(prompt_logits(runner.model, runner.backend, ids)[-1])
        margin = float(row[-1] - row[-2])
        print(f"{len(prompt['prompt_token_ids'])}-token prompt: differs at step {diff}, "
              f"top-2 margin {margin:.2e}")
        assert margin < NEAR_TIE


def test_batch_equals_alone(smollm2_path, prompts, alone):
    ref_llm, reference = alone
    llm = LLM(str(smollm2_path))
    outputs = llm.generate(prompts, GREEDY)
    assert_same_or_near_tie(ref_llm, prompts, reference, outputs)
    assert llm.get_metrics()["vllm:num_preemptions"] == 0


def test_batch_with_preemption_equals_alone(smollm2_path, prompts, alone):
    ref_llm, reference = alone
    llm = LLM(str(smollm2_path), max_num_seqs=8, max_model_len=1024,
              num_gpu_blocks_override=80, max_num_batched_tokens=512)
    outputs = llm.generate(prompts, GREEDY)
    metrics = llm.get_metrics()
    print(metrics)
    assert metrics["vllm:num_preemptions"] > 0
    assert_same_or_near_tie(ref_llm, prompts, reference, outputs)


def test_prefix_caching_shares_a_system_prompt(smollm2_path):
    system = LONG_ESSAY[:1500]
    questions = [f"Question {i}: what is point number {i} of the text?" for i in range(16)]
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                     for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    cached = LLM(str(smollm2_path))
    with_cache = cached.chat(conversations, params)
    plain = LLM(str(smollm2_path), enable_prefix_caching=False).chat(conversations, params)
    prompt_len = len(with_cache[0].prompt_token_ids)
    assert prompt_len >= 300
    assert with_cache[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 288 for o in with_cache[1:])
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert [o.outputs[0].token_ids for o in with_cache] == [o.outputs[0].token_ids for o in plain]
    metrics = cached.get_metrics()
    assert metrics["vllm:prefix_cache_hits"] == sum(o.num_cached_tokens for o in with_cache)
    again = cached.chat(conversations[:1], params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == \
        with_cache[0].outputs[0].token_ids
    assert cached.reset_prefix_cache()
    assert cached.chat(conversations[:1], params)[0].num_cached_tokens == 0
