"""Continuous batching on the real model: 32 mixed-length prompts at once give each prompt's
tokens when run alone (near-tie rule as in the oracle tests; every other prompt, 16 of 8..600
tokens, is run alone), also with preemption (those 16 under memory pressure); prefix caching
reuses a shared system prompt without changing outputs."""

import pytest
from oracle.prompts import LONG_ESSAY
from parity import GREEDY_12 as GREEDY
from parity import assert_same_or_near_tie

from vllm_actors import LLM, SamplingParams


@pytest.fixture(scope="module")
def prompts(mixed_prompts):
    """Every other mixed prompt (16, spread over 8..600 tokens): the ones run alone. The batch
    they are checked in is all 32 at once."""
    return mixed_prompts[::2]


@pytest.fixture(scope="module")
def alone(smollm2_path, prompts):
    """Each prompt on its own: an engine that runs one request at a time."""
    with LLM(str(smollm2_path), gguf_activations="float32", max_num_seqs=1) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_batch_equals_alone(mixed_reference, smollm2_model, prompts, alone):
    """The 32 prompts added at once to the default engine (conftest's `mixed_reference`, run
    once for the session), with no preemption, give each prompt's tokens alone (the 16 run
    alone)."""
    assert mixed_reference.num_preemptions == 0
    assert_same_or_near_tie(smollm2_model, prompts, alone,
                            mixed_reference.of(prompts, GREEDY.max_tokens))


def test_batch_with_preemption_equals_alone(smollm2_path, smollm2_model, prompts, alone):
    """The 16 prompts under memory pressure: 40 KV blocks (640 tokens) for 8 running
    requests preempt and recompute several of them (5 preemptions measured), and each prompt
    still gets its tokens alone."""
    with LLM(str(smollm2_path), gguf_activations="float32", max_num_seqs=8, max_model_len=640,
             num_gpu_blocks_override=40, max_num_batched_tokens=512) as llm:
        outputs = llm.generate(prompts, GREEDY)
        metrics = llm.get_metrics()
    print(metrics)
    assert metrics["vllm:num_preemptions"] > 0
    assert_same_or_near_tie(smollm2_model, prompts, alone,
                            [o.outputs[0].token_ids for o in outputs])


def test_prefix_caching_shares_a_system_prompt(smollm2_path, smollm2_llm):
    """The session's default engine (prefix caching on; its cache emptied first, its hit
    counter read as a difference) against an engine without prefix caching."""
    system = LONG_ESSAY[:1500]
    questions = [f"Question {i}: what is point number {i} of the text?" for i in range(8)]
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                     for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    cached = smollm2_llm
    assert cached.reset_prefix_cache()
    hits_before = cached.get_metrics()["vllm:prefix_cache_hits"]
    with_cache = cached.chat(conversations, params)
    with LLM(str(smollm2_path), gguf_activations="float32",
             enable_prefix_caching=False) as plain_llm:
        plain = plain_llm.chat(conversations, params)
    prompt_len = len(with_cache[0].prompt_token_ids)
    assert prompt_len >= 300
    assert with_cache[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 288 for o in with_cache[1:])
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert [o.outputs[0].token_ids for o in with_cache] == [o.outputs[0].token_ids for o in plain]
    metrics = cached.get_metrics()
    assert metrics["vllm:prefix_cache_hits"] - hits_before == \
        sum(o.num_cached_tokens for o in with_cache)
    again = cached.chat(conversations[:1], params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == \
        with_cache[0].outputs[0].token_ids
    assert cached.reset_prefix_cache()
    assert cached.chat(conversations[:1], params)[0].num_cached_tokens == 0
