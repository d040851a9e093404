"""Frontend output pieces with exact values: stop strings, hold-back, collectors, kinds."""

import asyncio

import pytest

from vllm_actors.frontend.collector import RequestOutputCollector
from vllm_actors.frontend.detokenizer import (IncrementalDetokenizer, find_stop_string,
                                              partial_stop_length)
from vllm_actors.frontend.metrics import FrontendMetrics
from vllm_actors.frontend.output_processor import OutputProcessor, ParentRequest
from vllm_actors.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_actors.protocol.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm_actors.sampling_params import RequestOutputKind, SamplingParams

K = RequestOutputKind


def test_find_stop_string():
    assert find_stop_string("hello world", 5, ["wor"], False) == ("wor", 6)
    assert find_stop_string("hello world", 5, ["wor"], True) == ("wor", 9)
    assert find_stop_string("hello world", 4, ["o w"], False) is None   # all in older text
    assert find_stop_string("hello world", 5, ["o w"], False) == ("o w", 4)  # straddles it
    assert find_stop_string("abcabc", 3, ["zz", "bc", "ab"], False) == ("bc", 4)  # list order


def test_partial_stop_length():
    assert partial_stop_length("the end of", ["of the"]) == 2
    assert partial_stop_length("the end o", ["of the", "o"]) == 1
    assert partial_stop_length("the end", ["of the"]) == 0
    assert partial_stop_length("aab", ["aabx", "bz"]) == 3


def test_detokenizer_stops_and_holds_back(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(" The answer is forty two.")
    params = SamplingParams(stop=["forty t"], max_tokens=20)
    detok = IncrementalDetokenizer(tok, [], params)
    shown = []
    for i, token in enumerate(ids):
        stop = detok.update([token])
        shown.append(detok.output_text[:detok.releasable_text_length(stop is not None)])
        if stop is not None:
            break
    assert stop == "forty t" and detok.output_text == " The answer is "
    assert all("forty" not in s for s in shown[:-1])


def test_min_tokens_delays_stop_strings(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(" a b a b")
    detok = IncrementalDetokenizer(smollm2_tokenizer, [], SamplingParams(stop=["a"],
                                                                           min_tokens=2))
    assert detok.update(ids[:1]) is None and detok.update(ids[1:2]) is None
    assert detok.update(ids[2:3]) == "a" and detok.output_text == " a b "


def test_special_tokens_kept_add_no_spaces(smollm2_tokenizer):
    """With special tokens kept, the text is the fast tokenizer's (vLLM's path): no spaces
    around them, whatever spaces_between_special_tokens says (they had been put in, and
    Gemma's newline tokens, added tokens there, came out padded); an unfinished character
    before a stop token is flushed as the tokenizer decodes it (it had been dropped)."""
    ids = smollm2_tokenizer.encode("<|im_start|>user hi<|im_end|>")
    for spaces in (True, False):
        assert smollm2_tokenizer.decode(ids, spaces_between_special_tokens=spaces) == \
            "<|im_start|>user hi<|im_end|>"
    prompt = smollm2_tokenizer.encode("Say")
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt, SamplingParams(
        skip_special_tokens=False))
    detok.update(ids)
    assert detok.output_text == "<|im_start|>user hi<|im_end|>"
    lead = smollm2_tokenizer.encode("鑫")[:1]         # the first of its three byte tokens
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt, SamplingParams())
    detok.update(lead + [2], finished=True, stop_terminated=True)
    assert detok.output_text == smollm2_tokenizer.decode(lead) == "\ufffd"


def test_collector_merges_deltas_and_raises():
    async def scenario():
        c = RequestOutputCollector(K.DELTA)
        c.put(RequestOutput("r", None, [1], [CompletionOutput(0, "a", [5])]))
        c.put(RequestOutput("r", None, [1], [CompletionOutput(1, "x", [9])]))
        c.put(RequestOutput("r", None, [1], [CompletionOutput(0, "b", [6], "stop")], True))
        merged = await c.get()
        died = ValueError("engine died")
        depths = []
        for _ in range(3):        # every request the death fails raises it afresh
            c.put(died)
            with pytest.raises(ValueError, match="engine died") as info:
                await c.get()
            depths.append(len(info.traceback))
        assert depths[0] == depths[-1], depths
        return merged

    merged = asyncio.run(scenario())
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in merged.outputs] == \
        [(0, "ab", [5, 6], "stop"), (1, "x", [9], None)]
    assert merged.finished


def test_collector_merges_delta_logprobs():
    """A slow consumer of a stream still gets every token's logprobs and the prompt's."""
    first = [{5: Logprob(-0.5, 1, "a")}]
    prompt_lps = [None, {7: Logprob(-2.0, 3, "p")}]

    async def scenario():
        c = RequestOutputCollector(K.DELTA)
        c.put(RequestOutput("r", None, [1, 7], [CompletionOutput(0, "a", [5], None, None,
                                                                 first, -0.5)],
                            prompt_logprobs=prompt_lps))
        c.put(RequestOutput("r", None, [1, 7], [CompletionOutput(
            0, "b", [6], "length", None, [{6: Logprob(-1.5, 2, "b")}], -2.0)], True))
        return await c.get()

    merged = asyncio.run(scenario())
    (out,) = merged.outputs
    assert out.token_ids == [5, 6] and out.cumulative_logprob == -2.0
    assert [list(p) for p in out.logprobs] == [[5], [6]]
    assert out.logprobs[1][6].logprob == -1.5
    assert merged.prompt_logprobs is prompt_lps


def test_final_only_parent_waits_for_all_children(smollm2_tokenizer):
    async def scenario():
        processor = OutputProcessor(smollm2_tokenizer, FrontendMetrics("m"))
        collector = RequestOutputCollector(K.FINAL_ONLY)
        parent = ParentRequest("p", None, [1], K.FINAL_ONLY, collector, 2)
        params = SamplingParams(n=2, max_tokens=2, output_kind=K.FINAL_ONLY)
        assert processor.add_request(parent, EngineCoreRequest("p", [1], params, [], 0.0,
                                                               n=2)) == ["0_p", "1_p"]
        processor.process_outputs([EngineCoreOutput("0_p", [504]),
                                   EngineCoreOutput("1_p", [7042])])
        assert collector.pending is None
        processor.process_outputs([EngineCoreOutput("1_p", [30], FinishReason.LENGTH)])
        assert collector.pending is None
        processor.process_outputs([EngineCoreOutput("0_p", [2988], FinishReason.LENGTH)])
        return await collector.get(), processor

    out, processor = asyncio.run(scenario())
    assert out.finished and [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[1].text == " Paris." and out.outputs[1].finish_reason == "length"
    assert not processor.has_unfinished_requests() and not processor.children


def test_children_share_derived_state_and_abort_with_their_parent(smollm2_tokenizer):
    """n completions registered from one message share what is derived from its params
    (the EOS set, the stop-string index; stop_token_ids are not even copied); aborting the
    parent finishes every child with "abort" and names all their engine ids for the core."""
    async def scenario():
        processor = OutputProcessor(smollm2_tokenizer, FrontendMetrics("m"))
        collector = RequestOutputCollector(K.DELTA)
        parent = ParentRequest("p", None, [1], K.DELTA, collector, 3)
        params = SamplingParams(n=3, max_tokens=5, stop=["x", "yz"], stop_token_ids=[9],
                                output_kind=K.DELTA)
        ids = processor.add_request(parent, EngineCoreRequest("p", [1], params, [2], 0.0,
                                                              n=3))
        states = [processor.states[i] for i in ids]
        assert all(s.eos_token_ids is states[0].eos_token_ids and
                   s.stop_token_ids is params.stop_token_ids and
                   s.detokenizer.stop_prefixes is states[0].detokenizer.stop_prefixes
                   for s in states)
        assert states[0].eos_token_ids == {2} and [s.index for s in states] == [0, 1, 2]
        assert states[0].detokenizer.stop_prefixes.stop == ["x", "yz"]
        processor.process_outputs([EngineCoreOutput("1_p", [504])])
        aborted = processor.abort_requests(["p"])
        return ids, aborted, await collector.get(), processor

    ids, aborted, out, processor = asyncio.run(scenario())
    assert ids == ["0_p", "1_p", "2_p"] and aborted == ids
    assert out.finished and [(c.index, c.finish_reason) for c in out.outputs] == \
        [(0, "abort"), (1, "abort"), (2, "abort")]
    assert not processor.has_unfinished_requests() and not processor.children


def test_stopped_by_token_without_a_set_of_the_stop_ids(smollm2_tokenizer):
    """EOS or a stop id ended the request (its text is left out), read from the core's
    stop_reason, the EOS set, or, for a grammar's end, the params' list."""
    from vllm_actors.frontend.output_processor import RequestState
    state = RequestState(None, 0, None, 0.0, 1, eos_token_ids=frozenset({2}),
                         stop_token_ids=[9, 11])
    STOP = FinishReason.STOP
    assert state.stopped_by_token(EngineCoreOutput("r", [5, 9], STOP, stop_reason=9))
    assert state.stopped_by_token(EngineCoreOutput("r", [2], STOP))
    assert state.stopped_by_token(EngineCoreOutput("r", [11], STOP))   # grammar end on 11
    assert not state.stopped_by_token(EngineCoreOutput("r", [7], STOP))
    assert not state.stopped_by_token(EngineCoreOutput("r", [9], FinishReason.LENGTH))
    assert not state.stopped_by_token(EngineCoreOutput("r", [], STOP))


def test_metrics_render_with_vllm_names():
    from vllm_actors.protocol.engine import SchedulerStats
    metrics = FrontendMetrics("smol")
    metrics.observe_step(SchedulerStats(3, 1, 0.5, 100, 64, 2))
    metrics.observe_tokens(1, 0.2, None)
    metrics.observe_tokens(2, None, 0.1)
    metrics.observe_finished("stop", 10, 1.5, 0.05)
    text = metrics.render().decode()
    for line in ('vllm:num_requests_running{engine="0",model_name="smol"} 3.0',
                 'vllm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.5',
                 'vllm:prefix_cache_hits_total{engine="0",model_name="smol"} 64.0',
                 'vllm:num_preemptions_total{engine="0",model_name="smol"} 2.0',
                 'vllm:generation_tokens_total{engine="0",model_name="smol"} 3.0',
                 'vllm:prompt_tokens_total{engine="0",model_name="smol"} 10.0',
                 'vllm:request_success_total{engine="0",finished_reason="stop",'
                 'model_name="smol"} 1.0',
                 'vllm:time_to_first_token_seconds_count{engine="0",model_name="smol"} 1.0',
                 'vllm:inter_token_latency_seconds_sum{engine="0",model_name="smol"} 0.05',
                 'vllm:request_queue_time_seconds_count{engine="0",model_name="smol"} 1.0'):
        assert line in text, line
    assert metrics.snapshot()["vllm:prefix_cache_queries"] == 100


def test_stop_prefix_index_equals_the_plain_search():
    """The indexed hold-back gives what checking every prefix of every stop string gives."""
    import random

    def plain(text, stops):
        return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1)
                    if text.endswith(s[:n])), default=0)

    rng = random.Random(5)
    for _ in range(300):
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 12)))
        assert partial_stop_length(text, stops) == plain(text, stops), (text, stops)
