"""Continuous batching on the real model: 48 mixed-length prompts in one call give each
prompt's tokens when run alone (near-tie rule as in the oracle tests), also with preemption;
prefix caching reuses a shared system prompt without changing outputs."""

import pytest
from oracle.prompts import LONG_ESSAY
from parity import GREEDY_12 as GREEDY
from parity import assert_same_or_near_tie

from vllm_actors import LLM, SamplingParams


@pytest.fixture(scope="module")
def prompts(mixed_prompts):
    return mixed_prompts


@pytest.fixture(scope="module")
def alone(smollm2_path, prompts):
    """Each prompt on its own: an engine that runs one request at a time."""
    with LLM(str(smollm2_path), max_num_seqs=1) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_batch_equals_alone(smollm2_llm, smollm2_model, prompts, alone):
    before = smollm2_llm.get_metrics()["vllm:num_preemptions"]
    outputs = smollm2_llm.generate(prompts, GREEDY)
    assert_same_or_near_tie(smollm2_model, prompts, alone,
                            [o.outputs[0].token_ids for o in outputs])
    assert smollm2_llm.get_metrics()["vllm:num_preemptions"] == before


def test_batch_with_preemption_equals_alone(smollm2_path, smollm2_model, prompts, alone):
    with LLM(str(smollm2_path), max_num_seqs=8, max_model_len=1024,
             num_gpu_blocks_override=80, max_num_batched_tokens=512) as llm:
        outputs = llm.generate(prompts, GREEDY)
        metrics = llm.get_metrics()
    print(metrics)
    assert metrics["vllm:num_preemptions"] > 0
    assert_same_or_near_tie(smollm2_model, prompts, alone,
                            [o.outputs[0].token_ids for o in outputs])


def test_prefix_caching_shares_a_system_prompt(smollm2_path):
    system = LONG_ESSAY[:1500]
    questions = [f"Question {i}: what is point number {i} of the text?" for i in range(16)]
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                     for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    cached = LLM(str(smollm2_path))
    with_cache = cached.chat(conversations, params)
    with LLM(str(smollm2_path), enable_prefix_caching=False) as plain_llm:
        plain = plain_llm.chat(conversations, params)
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
    cached.shutdown()
