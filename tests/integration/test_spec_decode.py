"""Speculative decoding on SmolLM2 through the whole engine: each method's greedy tokens equal
transformers' golden tokens (near-tie rule), a batch of 16 with preemption equals the engine
without speculation, seeded samples are the same tokens with and without drafts, unseeded
samples at temperature 0.8 follow the same distribution (chi-square), and stop rules,
logprobs, structured outputs and tensor parallelism see no difference. Every test also
checks that drafts were verified and accepted, so it cannot pass with speculation idle."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
from golden_files import load_golden
from oracle.prompts import LONG_CODE, LONG_ESSAY
from parity import assert_same_or_near_tie

from vllm_actors import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import draft_gguf  # noqa: E402

GREEDY = load_golden("smollm2_greedy.json")
NEAR_TIE = 1e-4
# drafts at any batch size here (the default stops them above 8 running requests)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "disable_by_batch_size": None}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "disable_by_batch_size": None}
# drafts for text that quotes its prompt
QUOTING = [f"Copy this text exactly.\n\n{LONG_ESSAY[i:i + 400]}\n\nCopy:\n{LONG_ESSAY[i:i + 60]}"
           for i in (0, 700, 1500)] + [f"Repeat the code.\n{LONG_CODE[:300]}\nAgain:\n"]


def accepted(llm: LLM) -> int:
    return llm.get_metrics()["vllm:spec_decode_num_accepted_tokens"]


@pytest.fixture(scope="module")
def draft_path(smollm2_path, tmp_path_factory):
    """SmolLM2 without 8 of its 30 layers: a draft that agrees often, not always."""
    return str(draft_gguf.write_draft(smollm2_path, tmp_path_factory.mktemp("draft")
                                      / "draft.gguf", [4, 7, 10, 13, 16, 19, 22, 25]))


@pytest.fixture(scope="module")
def ngram_llm(smollm2_path):
    with LLM(str(smollm2_path), gguf_activations="float32",
             speculative_config=NGRAM, max_num_seqs=64) as llm:
        yield llm


def golden_prompts(cases: list[dict]) -> list[dict]:
    return [{"prompt_token_ids": case["prompt_token_ids"]} for case in cases]


def assert_golden(cases: list[dict], outputs: list[list[int]]) -> None:
    for case, ours in zip(cases, outputs, strict=True):
        golden = case["tokens"]
        assert len(ours) == len(golden)
        diff = next((i for i, (a, b) in enumerate(zip(ours, golden)) if a != b), None)
        if diff is not None:
            margin = case["top2_margins"][diff]
            print(f"{case['name']}: first difference at step {diff}, margin {margin:.2e}")
            assert margin < NEAR_TIE, f"{case['name']} differs at step {diff}"


# suffix decoding's tokens are checked in the batch with preemption below (against the engine
# without speculation, itself checked against these golden tokens)
# The draft model runs every other golden prompt (a draft's forward costs most of the target's
# here; the long prompts are in both halves).
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_tokens_match_transformers(method, smollm2_path, ngram_llm, draft_path):
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY["num_generated"], ignore_eos=True)
    cases = GREEDY["cases"] if method == "ngram" else GREEDY["cases"][::2]
    if method == "ngram":
        llm, before = ngram_llm, accepted(ngram_llm)
        outputs = llm.generate(golden_prompts(cases), params, use_tqdm=False)
        assert accepted(llm) > before
    else:
        config = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": 3,
                  "disable_by_batch_size": None}
        with LLM(str(smollm2_path), gguf_activations="float32",
                 speculative_config=config) as llm:
            outputs = llm.generate(golden_prompts(cases), params, use_tqdm=False)
            metrics = llm.get_metrics()
        print(metrics)
        assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
        assert metrics["vllm:spec_decode_num_accepted_tokens"] < \
            metrics["vllm:spec_decode_num_draft_tokens"]
    assert_golden(cases, [o.outputs[0].token_ids for o in outputs])


def test_batch_of_16_with_preemption_equals_no_speculation(smollm2_path, smollm2_llm,
                                                           smollm2_model, smollm2_tokenizer,
                                                           mixed_prompts, mixed_reference):
    """Suffix decoding over 16 prompts (the quoting ones and 12 mixed, 8..600 tokens), 8
    running in 80 KV blocks: preempted and recomputed with drafts in flight."""
    quoting = [{"prompt_token_ids": smollm2_tokenizer.encode(p)} for p in QUOTING]
    prompts = quoting + mixed_prompts[:12]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # without speculation: the quoting prompts here, the mixed ones from conftest's reference
    reference = [o.outputs[0].token_ids for o in smollm2_llm.generate(quoting, params,
                                                                      use_tqdm=False)] + \
        mixed_reference.of(mixed_prompts[:12], params.max_tokens)
    with LLM(str(smollm2_path), gguf_activations="float32",
             speculative_config=SUFFIX, max_num_seqs=8, max_model_len=1024,
             num_gpu_blocks_override=80, max_num_batched_tokens=512) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        metrics = llm.get_metrics()
    print(metrics)
    assert metrics["vllm:num_preemptions"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert_same_or_near_tie(smollm2_model, prompts, reference,
                            [o.outputs[0].token_ids for o in outputs])


def test_seeded_samples_are_the_same_tokens(ngram_llm, smollm2_llm):
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=32,
                             frequency_penalty=0.2 * (i % 2)) for i in range(8)]
    prompts = [QUOTING[i % len(QUOTING)] for i in range(8)]
    before = accepted(ngram_llm)
    spec = ngram_llm.generate(prompts, params, use_tqdm=False)
    plain = smollm2_llm.generate(prompts, params, use_tqdm=False)
    assert accepted(ngram_llm) > before
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


# 2 x 8 table (the 7 likeliest outputs and the rest): 7 degrees of freedom, p = 0.001
CHI2_BOUND_7_DOF = 24.32


def test_unseeded_samples_follow_the_same_distribution(ngram_llm, smollm2_llm):
    """Outputs of 4 tokens at temperature 0.8 after a repetitive prompt, 300 draws with and
    without drafts: a chi-square test of homogeneity over the likeliest outputs."""
    prompt = "one two three four five six seven eight " * 6 + "one two"
    params = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True)
    before = accepted(ngram_llm)

    def draws(llm: LLM) -> collections.Counter:
        outs = llm.generate([prompt] * 300, params, use_tqdm=False)
        return collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)

    spec, plain = draws(ngram_llm), draws(smollm2_llm)
    assert accepted(ngram_llm) - before > 300      # most positions came from drafts
    top = [k for k, _ in (spec + plain).most_common(7)]
    rows = [[c[k] for k in top] + [300 - sum(c[k] for k in top)] for c in (spec, plain)]
    total = [a + b for a, b in zip(*rows)]
    chi2 = sum((row[j] - total[j] / 2) ** 2 / (total[j] / 2)
               for row in rows for j in range(8) if total[j])
    print(f"chi-square {chi2:.2f} (bound {CHI2_BOUND_7_DOF}); {rows}")
    assert chi2 < CHI2_BOUND_7_DOF


def test_stop_rules_and_logprobs_see_no_drafts(ngram_llm, smollm2_llm, smollm2_tokenizer):
    """max_tokens, stop strings, stop token ids, min_tokens with eos, and logprobs: the same
    outputs with drafts (stops inside a run of accepted drafts end the output there)."""
    prompt = QUOTING[0]
    stop_id = smollm2_tokenizer.encode(" the")[0]
    cases = [SamplingParams(temperature=0.0, max_tokens=7),
             SamplingParams(temperature=0.0, max_tokens=60, stop=["and"]),
             SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[stop_id]),
             SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30),
             SamplingParams(temperature=0.0, max_tokens=20, logprobs=3)]
    before = accepted(ngram_llm)
    spec = ngram_llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    plain = smollm2_llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    assert accepted(ngram_llm) > before
    for s, p in zip(spec, plain):
        a, b = s.outputs[0], p.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason)
    lp_spec, lp_plain = spec[-1].outputs[0].logprobs, plain[-1].outputs[0].logprobs
    assert len(lp_spec) == len(lp_plain) == 20
    for x, y in zip(lp_spec, lp_plain):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-3 for t in x)


def test_structured_output_checks_drafts_against_the_grammar(ngram_llm, smollm2_llm):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "tags": {"type": "array", "maxItems": 3,
                                                        "items": {"type": "string"}}},
              "required": ["name", "tags"]}
    prompt = ('Return JSON like {"name": "x", "tags": ["a", "b"]} for the fox: '
              '{"name": "fox", "tags": ["quick", "brown", "quick", "brown", "quick"')
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_outputs={"json": schema})
    before = accepted(ngram_llm)
    spec = ngram_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    plain = smollm2_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert accepted(ngram_llm) > before
    assert spec.token_ids == plain.token_ids
    assert spec.finish_reason == "stop"
    assert set(json.loads(spec.text)) == {"name", "tags"}


def test_tensor_parallel_with_drafts(smollm2_path, smollm2_llm, smollm2_model,
                                     smollm2_tokenizer):
    prompts = [{"prompt_token_ids": smollm2_tokenizer.encode(p)} for p in QUOTING[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = smollm2_llm.generate(prompts, params, use_tqdm=False)
    with LLM(str(smollm2_path), gguf_activations="float32",
             speculative_config=NGRAM, tensor_parallel_size=3,
             max_num_seqs=4) as llm:
        spec = llm.generate(prompts, params, use_tqdm=False)
        assert accepted(llm) > 0
    assert_same_or_near_tie(smollm2_model, prompts, [o.outputs[0].token_ids for o in plain],
                            [o.outputs[0].token_ids for o in spec])
