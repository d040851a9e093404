"""Speculative decoding without a model, exact values: --speculative-config parsing, the
scheduler with drafts (budget, slots, rollback, block hashes of verified tokens only,
preemption), the draft policy's rules, the verification layout and acceptance, the n-gram
proposer, multi-token stop strings in the detokenizer, and the metrics."""

from __future__ import annotations

import numpy as np
import pytest
from test_scheduler import BS, make_request

from vllm_actors.config import EngineArgs, SchedulerConfig
from vllm_actors.config_speculative import SpeculativeConfig, speculative_config
from vllm_actors.enginecore.kv_cache_manager import KVCacheManager
from vllm_actors.enginecore.scheduler import Scheduler
from vllm_actors.enginecore.spec_decode import DraftPolicy
from vllm_actors.errors import ValidationError
from vllm_actors.frontend.metrics import FrontendMetrics, SpecDecodingLog
from vllm_actors.protocol.engine import FinishReason, SchedulerStats, SpecDecodingStats
from vllm_actors.protocol.step import StepOutput
from vllm_actors.workers.spec_decode.ngram import NgramProposer
from vllm_actors.workers.spec_decode.verify import accepted_tokens, sample_layout


def test_config_parsing_follows_vllm():
    c = speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert speculative_config({"model": "ngram", "num_speculative_tokens": 2}).method == "ngram"
    c = speculative_config({"model": "/m.gguf", "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.uses_draft_model
    assert speculative_config({"method": "suffix"}).num_speculative_tokens == 24
    assert speculative_config(None) is None
    config = EngineArgs(speculative_config='{"method": "suffix"}').create_engine_config()
    assert isinstance(config.speculative, SpeculativeConfig)


@pytest.mark.parametrize("value, words", [
    ("{", "not valid JSON"), ("[1]", "JSON object"), ({"method": "eagle"}, "draft head"),
    ({"method": "ngram"}, "num_speculative_tokens"), ({"method": "magic"}, "not one of"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, '"model"'),
    ({"method": "ngram", "num_speculative_tokens": 0}, "between 1 and 64"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "must not exceed"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": "x"},
     "unknown field"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "only its default"),
])
def test_config_errors_name_the_field(value, words):
    with pytest.raises(ValidationError, match=words) as e:
        speculative_config(value)
    assert e.value.param == "speculative_config"


def test_pipeline_parallel_is_refused():
    with pytest.raises(ValidationError, match="pipeline"):
        EngineArgs(speculative_config={"method": "suffix"},
                   pipeline_parallel_size=2).create_engine_config()


def spec_scheduler(k=3, num_blocks=64, budget=64, lookahead_model=False, **policy):
    """Every draft verified (draft_cost 0) unless the test says otherwise."""
    policy.setdefault("draft_cost", 0.0)
    config = SpeculativeConfig("draft_model" if lookahead_model else "ngram", k,
                               model="m" if lookahead_model else None, **policy)
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget),
                     KVCacheManager(num_blocks, BS, True),
                     max_model_len=256, drafts=DraftPolicy(config))


def prefill(s: Scheduler, request, drafts=()):
    s.add_request(request)
    step = s.schedule()
    s.update_from_output(step, StepOutput([request.request_id], [[7]],
                                          draft_token_ids={request.request_id: list(drafts)}))


def test_drafts_are_scheduled_verified_and_rolled_back():
    s = spec_scheduler()
    r = make_request("a", 6, max_tokens=20)
    prefill(s, r, [8, 9, 10, 11])          # 4 proposed, k = 3 kept
    assert r.spec_token_ids == [8, 9, 10] and r.num_tokens == 7 and r.num_computed_tokens == 6
    step = s.schedule()
    assert step.num_scheduled_tokens == {"a": 4} and step.spec_token_ids == {"a": [8, 9, 10]}
    # 8 accepted, 9 rejected (the worker sampled 5 there): tokens 8, 5; computed = 7 + 1
    outs = s.update_from_output(step, StepOutput(["a"], [[8, 5]],
                                                 draft_token_ids={"a": [1, 2, 3]}))
    assert outs[0].new_token_ids == [8, 5]
    assert r.all_token_ids[-3:] == [7, 8, 5] and r.num_computed_tokens == 8
    assert r.num_tokens == 9 and r.spec_token_ids == [1, 2, 3]
    stats = s.make_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.num_accepted_tokens_per_pos) == (1, 3, 1, [1])
    assert s.make_stats().spec_decoding is None      # counted once


def test_block_hashes_and_cache_never_see_drafts():
    s = spec_scheduler(k=4)
    r = make_request("a", 7, max_tokens=20)      # 7 tokens + 1 sampled = 2 full blocks
    prefill(s, r, [1, 2, 3, 4])
    assert len(r.block_hashes) == 2
    step = s.schedule()                          # computes positions 7..11 (1 + 4 drafts)
    assert step.num_scheduled_tokens == {"a": 5}
    assert s.kv.num_cached_blocks["a"] == 2      # block 3 holds drafts: not cached
    s.update_from_output(step, StepOutput(["a"], [[9]]))   # every draft rejected
    assert r.num_computed_tokens == 8 and len(r.block_hashes) == 2


def test_draft_model_reserves_lookahead_slots():
    s = spec_scheduler(k=4, lookahead_model=True)
    r = make_request("a", 6, max_tokens=20)
    prefill(s, r, [1, 2, 3, 4])                  # 6 tokens + 4 lookahead = 10 slots
    assert len(s.kv.req_blocks["a"][0]) == 3
    s.schedule()                                 # up to 6 + 1 + 4 drafts, + 4 lookahead
    assert len(s.kv.req_blocks["a"][0]) == 4     # 15 slots


def test_stop_inside_accepted_tokens_ends_the_output_there():
    s = spec_scheduler()
    r = make_request("a", 6, max_tokens=20, stop_token_ids=[9])
    prefill(s, r, [8, 9, 10])
    step = s.schedule()
    outs = s.update_from_output(step, StepOutput(["a"], [[8, 9, 10, 11]]))
    assert outs[0].new_token_ids == [8, 9]
    assert outs[0].finish_reason == FinishReason.STOP and outs[0].stop_reason == 9
    assert "a" not in s.requests


def test_policy_limits_drafts():
    s = spec_scheduler(k=8)
    r = make_request("a", 6, max_tokens=4)
    prefill(s, r, list(range(20, 30)))
    assert r.spec_token_ids == [20, 21]          # 1 output, 4 allowed: 2 drafts + 1 more
    busy = spec_scheduler(k=8, disable_by_batch_size=1)
    for name in "ab":
        busy.add_request(make_request(name, 6, max_tokens=20))
    step = busy.schedule()
    busy.update_from_output(step, StepOutput(["a", "b"], [[7], [7]],
                                             draft_token_ids={"a": [1], "b": [1]}))
    assert busy.requests["a"].spec_token_ids == [] == busy.requests["b"].spec_token_ids


def test_acceptance_sets_how_many_drafts_are_worth_verifying():
    """alpha^i > draft_cost: with cost 0.3 a new request (alpha 2/3) verifies 2 drafts; full
    acceptances raise it to k; rejections drop it to none, with a probe every 8 steps."""
    policy = DraftPolicy(SpeculativeConfig("ngram", 8, draft_cost=0.3))
    r = make_request("a", 6, max_tokens=500)
    r.append_output_token(7)
    drafts = list(range(10, 20))
    assert policy.accept(r, drafts, 1) == [10, 11]
    policy.observe(r, 2, 2)
    assert len(policy.accept(r, drafts, 1)) == 5      # alpha = 3.6 / 4.4: 0.818^6 < 0.3
    for _ in range(3):
        policy.observe(r, 6, 6)
    assert len(policy.accept(r, drafts, 1)) == 8
    for _ in range(8):
        policy.observe(r, 1, 0)
    assert len(policy.accept(r, drafts, 1)) == 1      # alpha 0.39: one draft
    for _ in range(8):
        policy.observe(r, 1, 0)
    got = [len(policy.accept(r, drafts, 1)) for _ in range(16)]
    assert got == [0] * 7 + [1] + [0] * 7 + [1]
    assert DraftPolicy(SpeculativeConfig("ngram", 8, draft_cost=0.0)).accept(r, drafts, 1) \
        == drafts[:8]


def test_preemption_drops_drafts():
    s = spec_scheduler(k=3, num_blocks=5)
    a, b = make_request("a", 7, max_tokens=30), make_request("b", 7, first=50, max_tokens=30)
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()
    s.update_from_output(step, StepOutput(["a", "b"], [[7], [7]],
                                          draft_token_ids={"a": [1, 2, 3], "b": [1, 2, 3]}))
    step = s.schedule()                          # 4 blocks free for 2 x 11 slots: b goes
    assert "b" not in step.num_scheduled_tokens and b.spec_token_ids == []
    assert step.spec_token_ids == {"a": [1, 2, 3]}


def test_sample_layout_and_acceptance():
    layout = sample_layout(np.array([3, 10, 12]), np.array([0, 3, 1]))
    assert layout.index.tolist() == [2, 6, 7, 8, 9, 10, 11]
    assert layout.owner.tolist() == [0, 1, 1, 1, 1, 2, 2]
    assert layout.offset.tolist() == [0, 0, 1, 2, 3, 0, 1]
    tokens = np.array([5, 8, 9, 4, 6, -1, 3])
    assert accepted_tokens(tokens, layout, [[], [8, 9, 7], [3]]) == [[5], [8, 9, 4], []]
    tokens = np.array([5, 8, -1, 4, 6, 3, 2])
    assert accepted_tokens(tokens, layout, [[], [8, 9, 7], [3]]) == [[5], [8], [3, 2]]


def test_ngram_proposer():
    p = NgramProposer(3, 2, 4)
    assert p.propose("a", np.array([5, 1, 2, 3, 4, 9, 9, 1, 2, 3]), 5) == [4, 9, 9]
    assert p.propose("a", np.array([1, 2, 3, 4]), 2) == []
    assert p.propose("a", np.array([7, 1, 2, 7, 1, 2, 7, 1, 2]), 2) == [7, 1, 2]
    assert NgramProposer(3, 3, 3).propose("a", np.array([1, 2, 5, 9, 2]), 2) == []


def test_detokenizer_stops_inside_several_tokens(smollm2_tokenizer):
    from vllm_actors.frontend.detokenizer import IncrementalDetokenizer
    from vllm_actors.sampling_params import SamplingParams
    ids = smollm2_tokenizer.encode(" one two three four five")
    detok = IncrementalDetokenizer(smollm2_tokenizer, [1], SamplingParams(stop=["three"]))
    assert detok.update(ids) == "three"
    assert detok.output_text == " one two " and detok.num_used_tokens == 3


def test_metrics_count_drafts_per_position():
    metrics = FrontendMetrics("m")
    stats = SpecDecodingStats()
    stats.observe(3, 2)
    stats.observe(3, 0)
    metrics.observe_step(SchedulerStats(spec_decoding=stats))
    snap = metrics.snapshot()
    assert (snap["vllm:spec_decode_num_drafts"], snap["vllm:spec_decode_num_draft_tokens"],
            snap["vllm:spec_decode_num_accepted_tokens"]) == (2, 6, 2)
    text = metrics.render().decode()
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",' \
           'position="1"} 1.0' in text
    log = SpecDecodingLog()
    log.window = stats
    assert log.line(2.0).startswith("SpecDecoding metrics: Mean acceptance length: 2.00, "
                                    "Accepted throughput: 1.00 tokens/s")
