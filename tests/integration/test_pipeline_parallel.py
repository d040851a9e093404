"""Pipeline parallel: SmolLM2's 30 layers split over 2 stage processes (and 2 x 3 with tensor
parallelism) give the single process's greedy tokens (near-tie rule), seeded samples,
logprobs and structured outputs; each stage holds only its layers; a killed stage makes the
engine dead within 2 s with no process left behind."""

import asyncio
import json

import psutil
import pytest
from engine_death import kill_while_streaming
from parity import GREEDY_12, assert_same_or_near_tie

from vllm_actors import AsyncLLM, LLM, SamplingParams, StructuredOutputsParams

LOGPROB_TOLERANCE = 1e-3     # as the tensor-parallel comparison


@pytest.fixture(scope="module")
def pp2_llm(smollm2_path):
    with LLM(str(smollm2_path), gguf_activations="float32", pipeline_parallel_size=2) as llm:
        yield llm


def test_each_stage_holds_its_layers(pp2_llm, smollm2_llm):
    """Each stage's KV cache has its 15 layers only: half the bytes per block."""
    ranks = pp2_llm.collective_rpc("describe")
    assert [(r["pipeline_stage"], r["layers"]) for r in ranks] == [(0, [0, 15]), (1, [15, 30])]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    whole = smollm2_llm.collective_rpc("describe")[0]
    per_block = [b // (r["num_kv_blocks"] + 1) for b, r in
                 zip(pp2_llm.collective_rpc("kv_cache_bytes"), ranks)]
    whole_per_block = smollm2_llm.collective_rpc("kv_cache_bytes")[0] // \
        (whole["num_kv_blocks"] + 1)
    assert per_block == [whole_per_block // 2] * 2


def test_pp2_greedy_tokens_equal_pp1(mixed_reference, smollm2_model, pp2_llm, mixed_prompts):
    prompts = mixed_prompts[::4]       # 8 prompts of 8..600 tokens
    reference = mixed_reference.of(prompts, GREEDY_12.max_tokens)   # one process, conftest
    outputs = [o.outputs[0].token_ids for o in pp2_llm.generate(prompts, GREEDY_12)]
    assert_same_or_near_tie(smollm2_model, prompts, reference, outputs)


def test_pp2_seeded_sampling_and_logprobs_equal_pp1(smollm2_llm, pp2_llm, mixed_prompts):
    prompts = mixed_prompts[2:10]
    params = [SamplingParams(temperature=0.8, top_k=40, max_tokens=10, seed=7 + i,
                             logprobs=2) for i in range(len(prompts))]
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (smollm2_llm, pp2_llm))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    diffs = [abs(x[t].logprob - y[t].logprob)
             for oa, ob in zip(a, b) for x, y in zip(oa.outputs[0].logprobs,
                                                     ob.outputs[0].logprobs) for t in x]
    assert len(diffs) >= 2 * 10 * len(prompts) and max(diffs) <= LOGPROB_TOLERANCE


def test_pp2_prompt_logprobs_and_structured_outputs(smollm2_llm, pp2_llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    chat = [{"role": "user", "content": "Give me a number as JSON."}]
    params = [SamplingParams(temperature=0.0, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1)]
    a, b = (llm.chat([chat, chat], params, use_tqdm=False) for llm in (smollm2_llm, pp2_llm))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert isinstance(json.loads(b[0].outputs[0].text)["n"], int)
    pairs = list(zip(a[1].prompt_logprobs[1:], b[1].prompt_logprobs[1:], strict=True))
    assert max(abs(x[t].logprob - y[t].logprob) for x, y in pairs for t in x if t in y) \
        <= LOGPROB_TOLERANCE


def test_tp3_pp2_greedy_tokens_equal_single(smollm2_path, mixed_reference, smollm2_model,
                                            mixed_prompts):
    """Six worker processes: 2 stages x 3 tensor-parallel ranks (SmolLM2's 9 heads and 3 KV
    heads split in 3), each stage's ranks with their own communicator."""
    prompts = mixed_prompts[1:25:4]
    reference = mixed_reference.of(prompts, GREEDY_12.max_tokens)
    with LLM(str(smollm2_path), gguf_activations="float32", pipeline_parallel_size=2,
             tensor_parallel_size=3) as llm:
        ranks = [(r["pipeline_stage"], r["rank"], r["layers"])
                 for r in llm.collective_rpc("describe")]
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY_12)]
    assert ranks == [(s, r, [15 * s, 15 * s + 15]) for s in range(2) for r in range(3)]
    assert_same_or_near_tie(smollm2_model, prompts, reference, outputs)


def test_preemption_with_steps_in_flight_keeps_tokens(smollm2_path):
    """30 KV blocks for 8 requests that need 8 each: requests are preempted (never one with a
    step in flight) and recomputed; the tokens equal one process's under the same pressure."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(i * 31 + j * 7) % 4000 + 100 for j in range(90)]}
               for i in range(8)]
    results, preemptions = [], []
    for pp in (1, 2):
        with LLM(str(smollm2_path), gguf_activations="float32", pipeline_parallel_size=pp,
                 num_gpu_blocks_override=30,
                 max_model_len=256, distributed_executor_backend="mp") as llm:
            results.append([o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)])
            preemptions.append(llm.get_metrics()["vllm:num_preemptions"])
    print("preemptions (pp 1, pp 2):", preemptions)
    assert min(preemptions) > 0
    assert results[0] == results[1]


def test_sigkill_of_a_stage_kills_the_engine_fast(smollm2_path):
    llm = AsyncLLM(str(smollm2_path), gguf_activations="float32", pipeline_parallel_size=2)
    try:
        core = psutil.Process(llm.client.pid)
        workers = core.children()
        assert len(workers) == 2
        killed_at, results = asyncio.run(kill_while_streaming(llm, workers[1].pid, 2))
        for when, message in results.values():
            print(f"EngineDeadError {when - killed_at:.2f}s after the kill: {message}")
            assert when - killed_at < 2.0
    finally:
        llm.shutdown()
    assert not any(psutil.pid_exists(w.pid) and w.status() != psutil.STATUS_ZOMBIE
                   for w in workers)
