"""SmolLM2 split over 3 CPU worker processes (9 query heads, 3 KV heads: 3 heads and 1 KV
head per rank): the same greedy tokens as the single-process engine (near-tie rule), the same
logprobs; a killed worker makes the engine dead within 2 s with no process left behind;
a size the model does not divide into fails at startup with the worker's own message."""

import asyncio
import json
import os
import signal
import time

import psutil
import pytest
from engine_death import kill_while_streaming
from parity import GREEDY_12, assert_same_or_near_tie

from vllm_actors import (AsyncLLM, EngineDeadError, LLM, SamplingParams,
                         StructuredOutputsParams)
from vllm_actors.errors import ValidationError

LOGPROB_TOLERANCE = 1e-3     # as the logprob oracle tests: float32 sums in another order


@pytest.fixture(scope="module")
def prompts(mixed_prompts):
    return mixed_prompts[::4]      # 8 prompts of 8..600 tokens


@pytest.fixture(scope="module")
def tp3_llm(smollm2_path):
    with LLM(str(smollm2_path), gguf_activations="float32",
             tensor_parallel_size=3) as llm:
        yield llm


def test_tp3_greedy_tokens_equal_tp1(mixed_reference, smollm2_model, tp3_llm, prompts):
    reference = mixed_reference.of(prompts, GREEDY_12.max_tokens)   # TP=1, conftest
    outputs = [o.outputs[0].token_ids for o in tp3_llm.generate(prompts, GREEDY_12)]
    assert_same_or_near_tie(smollm2_model, prompts, reference, outputs)


def test_tp3_logprobs_equal_tp1(smollm2_llm, tp3_llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    # the longest prompt: its prompt logprobs take the logits gather through several chunks
    prompt = max(prompts, key=lambda p: len(p["prompt_token_ids"]))
    a, b = (llm.generate(prompt, params, use_tqdm=False)[0] for llm in (smollm2_llm, tp3_llm))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    pairs = [(x, y) for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                                    b.prompt_logprobs[1:] + b.outputs[0].logprobs, strict=True)]
    diffs = [abs(x[t].logprob - y[t].logprob) for x, y in pairs for t in x if t in y]
    print(f"{len(pairs)} positions, max |logprob TP3 - TP1| = {max(diffs):.2e}")
    assert len(diffs) >= 2 * len(pairs)   # at least the top 2 of every position
    assert max(diffs) <= LOGPROB_TOLERANCE


def test_tp3_structured_outputs_equal_tp1(smollm2_llm, tp3_llm):
    """The grammar bitmask rides in the broadcast StepInput; rank 0 masks, the other ranks
    follow its ids. A constrained row and a free row in one batch equal TP=1's."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0,
                                                          "maximum": 99}},
              "required": ["answer"], "additionalProperties": False}
    chat = [{"role": "user", "content": "What is 2+2? Answer in JSON."}]
    params = [SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=8)]
    a, b = (llm.chat([chat, chat], params, use_tqdm=False) for llm in (smollm2_llm, tp3_llm))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert 0 <= json.loads(b[0].outputs[0].text)["answer"] <= 99


def test_indivisible_size_fails_at_startup(smollm2_path):
    with pytest.raises(ValidationError,
                       match="9 attention heads are not divisible by --tensor-parallel-size 2"):
        LLM(str(smollm2_path), tensor_parallel_size=2)




def test_sigkill_of_a_worker_kills_the_engine_fast_and_leaves_no_process(smollm2_path):
    llm = AsyncLLM(str(smollm2_path), gguf_activations="float32",
                   tensor_parallel_size=3)
    core = psutil.Process(llm.client.pid)
    workers = core.children()
    assert len(workers) == 3

    killed_at, results = asyncio.run(kill_while_streaming(llm, workers[1].pid, 2))
    for when, message in results.values():
        print(f"EngineDeadError {when - killed_at:.2f}s after the kill: {message}")
        assert when - killed_at < 2.0
        assert "worker rank" in message and "exited unexpectedly" in message
    llm.shutdown()
    psutil.wait_procs([core, *workers], timeout=5)
    assert not [p for p in (core, *workers) if p.is_running() and
                p.status() != psutil.STATUS_ZOMBIE]
    assert not set(p.pid for p in (core, *workers)) & \
        set(p.pid for p in psutil.Process().children(recursive=True))


def test_shm_segments_are_unlinked_after_startup(tp3_llm):
    mine = [f for f in os.listdir("/dev/shm") if f.startswith(f"va-{tp3_llm.engine.client.pid}-")]
    assert mine == []


def test_worker_death_while_idle_is_noticed(smollm2_path):
    llm = AsyncLLM(str(smollm2_path), gguf_activations="float32",
                   tensor_parallel_size=3)
    core = psutil.Process(llm.client.pid)
    workers = core.children()

    async def scenario():
        await llm.check_health()                 # healthy, and the output handler runs
        os.kill(workers[2].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < 5:
            try:
                await llm.check_health()
            except EngineDeadError as e:
                return time.monotonic() - killed_at, str(e)
            await asyncio.sleep(0.02)
        return 99.0, "still healthy after 5 s"

    after, message = asyncio.run(scenario())
    print(f"engine dead {after:.2f}s after an idle worker's death: {message}")
    assert after < 2.0 and "worker rank 2" in message
    assert llm.errored
    llm.shutdown()
    psutil.wait_procs([core, *workers], timeout=5)
    assert not [p for p in (core, *workers) if p.is_running() and
                p.status() != psutil.STATUS_ZOMBIE]
