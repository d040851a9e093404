"""The sampling surface on SmolLM2: logprobs and prompt logprobs against the oracle, masks and
biases that hold, and seeds that ignore the batch around them."""

import numpy as np
import pytest
from golden_files import GOLDEN, load_golden

from vllm_actors import SamplingParams

GREEDY = load_golden("smollm2_greedy.json")
ORACLE = np.load(GOLDEN / "smollm2_logits.npz")
CASES = [c for c in GREEDY["cases"] if c["name"] in
         ("chat_capital", "plain_code_fib", "plain_japanese", "chat_long_essay")]
TOLERANCE = 1e-3


def oracle_logprob(case: dict, step: int, token_id: int) -> float | None:
    ids = ORACLE[f"{case['name']}/{step}/ids"]
    hit = np.flatnonzero(ids == token_id)
    return float(ORACLE[f"{case['name']}/{step}/logprobs"][hit[0]]) if len(hit) else None


def test_sampled_logprobs_match_the_oracle(smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True, logprobs=5)
    outs = smollm2_llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in CASES],
                                params, use_tqdm=False)
    checked = 0
    for case, out in zip(CASES, outs):
        completion = out.outputs[0]
        assert completion.token_ids == case["tokens"][:33]
        assert len(completion.logprobs) == 33
        assert completion.cumulative_logprob == pytest.approx(
            sum(completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)))
        for step in GREEDY["logit_steps"]:
            position = completion.logprobs[step]
            assert position[completion.token_ids[step]].rank == 1   # greedy picks rank 1
            for token_id, lp in position.items():
                expected = oracle_logprob(case, step, token_id)
                if expected is not None:
                    assert abs(lp.logprob - expected) <= TOLERANCE, (case["name"], step)
                    checked += 1
    assert checked >= 8 * 5


def test_prompt_logprobs_match_the_oracle(smollm2_llm):
    case = CASES[0]
    n = len(case["prompt_token_ids"])
    prompt = case["prompt_token_ids"] + case["tokens"][:33]
    out = smollm2_llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for step in GREEDY["logit_steps"]:
        position = out.prompt_logprobs[n + step]
        token = prompt[n + step]
        assert abs(position[token].logprob - oracle_logprob(case, step, token)) <= TOLERANCE
        assert position[token].rank == 1 and len(position) <= 3
    assert out.num_cached_tokens == 0   # prompt logprobs skip prefix-cache reads


def test_logit_bias_and_allowed_token_ids(smollm2_llm):
    prompt = "The capital of France is"
    biased = smollm2_llm.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=6, logit_bias={11: 100.0}), use_tqdm=False)[0]
    assert biased.outputs[0].token_ids == [11] * 6
    allowed = [504, 3575, 282, 4649, 314]
    only = smollm2_llm.generate(prompt, SamplingParams(
        temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed), use_tqdm=False)[0]
    assert set(only.outputs[0].token_ids) <= set(allowed)


def test_bad_words_spanning_several_tokens(smollm2_llm, smollm2_tokenizer):
    prompt = "The capital of France is"
    plain = smollm2_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24),
                                 use_tqdm=False)[0].outputs[0]
    word = "The answer"      # greedy text: " Paris.\n\nThe answer is: ..."
    assert word in plain.text and len(smollm2_tokenizer.encode(word)) > 1
    banned = smollm2_llm.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=24, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert word not in banned.text and banned.text != plain.text
    assert banned.text.startswith(plain.text[:plain.text.index(word)])


def test_min_tokens_holds_eos_back(smollm2_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    short = smollm2_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64),
                             use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    long = smollm2_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64,
                                                     min_tokens=20), use_tqdm=False)[0]
    ids = long.outputs[0].token_ids
    assert len(ids) >= 20 and 2 not in ids[:19]


def test_a_seed_gives_the_same_tokens_alone_and_in_a_batch(smollm2_llm):
    prompts = [f"Write a short poem about the number {i}." for i in range(16)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i,
                             max_tokens=16) for i in range(16)]
    together = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 7, 15):
        alone = smollm2_llm.generate(prompts[i], params[i], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == together[i].outputs[0].token_ids


def test_every_control_at_once_runs(smollm2_llm):
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05,
                            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                            logit_bias={504: -5.0}, bad_words=["Paris"], min_tokens=4, seed=5,
                            max_tokens=12, logprobs=2, stop=["\n\n"])
    out = smollm2_llm.generate("The capital of France is", params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert 4 <= len(completion.token_ids) <= 12 and "Paris" not in completion.text
    assert len(completion.logprobs) == len(completion.token_ids)


def test_n_completions_are_the_requests_seeded_seed_plus_i(smollm2_llm):
    """Completion i of a seeded n=4 request is exactly the n=1 request seeded seed + i
    (mod 2^64: this seed wraps after the second child)."""
    prompt = "Once upon a time"
    seed = 2**64 - 2
    together = smollm2_llm.generate(prompt, SamplingParams(
        n=4, temperature=1.0, seed=seed, max_tokens=12), use_tqdm=False)[0]
    alone = smollm2_llm.generate([prompt] * 4, [
        SamplingParams(temperature=1.0, seed=(seed + i) % 2**64, max_tokens=12)
        for i in range(4)], use_tqdm=False)
    assert [c.index for c in together.outputs] == [0, 1, 2, 3]
    assert [(c.token_ids, c.text) for c in together.outputs] == \
        [(a.outputs[0].token_ids, a.outputs[0].text) for a in alone]
    assert len({c.text for c in together.outputs}) > 1


def test_many_bad_words_at_n_8_leave_a_neighbour_fast(smollm2_llm):
    """A plain request next to one with 200,000 bad words at n=8 (their masks built once and
    applied per step by lookup) takes about as long as next to the same n=8 request without
    bad words. Before, the sampler looped over every word of every row at every step: 1.0 s
    alone became 30.6 s beside it (docs/BENCHMARKS.md). Compared with a neighbour of the same
    shape because 8 more decoding rows slow every step by themselves; the bound (3x + 2 s)
    leaves room for the CPUs this suite shares with other work."""
    import threading
    import time
    rng = np.random.default_rng(0)
    words = [rng.integers(0, 49152, int(rng.integers(1, 5))).tolist() for _ in range(200_000)]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = "The capital of France is"

    def latency_beside(**neighbour) -> float:
        params = SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True,
                                **neighbour)
        done = {}
        worker = threading.Thread(target=lambda: done.update(out=smollm2_llm.generate(
            prompt, params, use_tqdm=False)[0]))
        worker.start()
        deadline = time.monotonic() + 120
        while smollm2_llm.get_metrics()["vllm:num_requests_running"] < 8:
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.02)          # admitted (its masks built) and decoding
        start = time.perf_counter()
        smollm2_llm.generate(prompt, plain, use_tqdm=False)
        elapsed = time.perf_counter() - start
        worker.join()
        assert [len(c.token_ids) for c in done["out"].outputs] == [40] * 8
        return elapsed

    control = latency_beside()
    hostile = latency_beside(bad_words_token_ids=words)
    print(f"plain request beside n=8: {control:.2f} s; beside n=8 with 200,000 bad words: "
          f"{hostile:.2f} s")
    assert hostile < 3 * control + 2.0
