"""The sampler on synthetic logits: truncation equivalences, sampling frequencies, penalties
and masks with hand-computed values, seeds, logprobs."""

import numpy as np
import pytest

from vllm_actors.sampling_params import SamplingParams
from vllm_actors.workers.sampler import Sampler, log_softmax, output_counts, top_logprobs
from vllm_actors.workers.sampling_state import SamplingState

V = 50


def batch(params: list[SamplingParams], tokens: list[list[int]], num_prompt: list[int],
          eos: list[int] = (2,)):
    state = SamplingState(len(params))
    for row, p in enumerate(params):
        state.set_row(row, p, list(eos))
    width = max(len(t) for t in tokens) + 1
    token_ids = np.zeros((len(params), width), np.int32)
    for row, t in enumerate(tokens):
        token_ids[row, :len(t)] = t
    return (np.arange(len(params)), state, token_ids, np.asarray(num_prompt),
            np.asarray([len(t) for t in tokens]))


def sample_all(params, logits, tokens=None, num_prompt=None, sampler=None):
    """(ids, logprobs, failed rows) from one sampler call."""
    tokens = tokens or [[1, 1]] * len(params)
    num_prompt = num_prompt or [1] * len(params)
    rows, state, token_ids, np_, nt = batch(params, tokens, num_prompt)
    return (sampler or Sampler(0)).sample(np.asarray(logits, np.float32), rows, state,
                                         token_ids, np_, nt)


def sample(params, logits, tokens=None, num_prompt=None, sampler=None):
    """(ids, logprobs) where no row may fail."""
    ids, lp, failed = sample_all(params, logits, tokens, num_prompt, sampler)
    assert not failed, failed
    return ids, lp


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng(0).standard_normal((64, V)).astype(np.float32) * 3
    greedy = logits.argmax(axis=1)
    for p in (SamplingParams(temperature=1.3, top_k=1, seed=1),
              SamplingParams(temperature=1.3, top_p=1e-6, seed=2),
              SamplingParams(temperature=0.0)):
        tokens, _ = sample([p] * 64, logits)
        assert np.array_equal(tokens, greedy)


def test_frequencies_match_softmax():
    """20000 draws at temperature 0.7 over 8 tokens; chi-square with 7 degrees of freedom
    must stay under 24.32 (the 0.1 % critical value)."""
    logits = np.array([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2], np.float32)
    expected = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    sampler, counts = Sampler(1234), np.zeros(8)
    params = [SamplingParams(temperature=0.7)] * 2000
    for _ in range(10):
        tokens, _ = sample(params, np.tile(logits, (2000, 1)), sampler=sampler)
        counts += np.bincount(tokens, minlength=8)
    chi2 = float((((counts - 20000 * expected) ** 2) / (20000 * expected)).sum())
    print(f"chi-square = {chi2:.2f} (bound 24.32)")
    assert chi2 < 24.32


def test_penalties_on_a_hand_computed_example():
    logits = np.array([[2.0, -1.0, 0.5, 3.0, 1.0]], np.float32)
    tokens = [[2, 0, 0, 3]]            # prompt [2], output [0, 0, 3]
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                       presence_penalty=0.25)
    rows, state, token_ids, np_, nt = batch([p], tokens, [1])
    out = Sampler(0).processed_logits(logits, rows, state, token_ids, np_, nt)
    # token 0: 2.0 / 2 - 0.5 * 2 - 0.25; token 1 untouched; token 2 (prompt): 0.5 / 2;
    # token 3: 3.0 / 2 - 0.5 - 0.25; token 4 untouched
    assert np.allclose(out, [[-0.25, -1.0, 0.25, 0.75, 1.0]], atol=1e-6)
    negative = np.array([[-2.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    rows, state, token_ids, np_, nt = batch([p], [[4, 0]], [1])
    out = Sampler(0).processed_logits(negative, rows, state, token_ids, np_, nt)
    assert out[0, 0] == pytest.approx(-3.0)   # a negative logit is multiplied


def test_masks_and_bias():
    logits = np.zeros((4, 8), np.float32)
    logits[:, 5] = 1.0
    params = [SamplingParams(temperature=0, allowed_token_ids=[1, 3], logit_bias={3: 0.5}),
              SamplingParams(temperature=0, logit_bias={7: 100.0}),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5]),
              SamplingParams(temperature=0, bad_words_token_ids=[[6, 5], [4]])]
    tokens = [[0, 1], [0, 1], [0, 1], [0, 6]]
    rows, state, token_ids, np_, nt = batch(params, tokens, [1, 1, 1, 1])
    out = Sampler(0).processed_logits(logits, rows, state, token_ids, np_, nt)
    assert np.isneginf(out[0, [0, 2, 4, 5, 6, 7]]).all() and out[0, 3] == 0.5
    assert out[1, 7] == 100.0
    assert np.isneginf(out[2, [5, 2]]).all()     # stop id and EOS masked before min_tokens
    assert np.isneginf(out[3, [5, 4]]).all() and out[3, 6] == 0   # 6 then 5 is banned
    tokens, _ = sample(params, logits, tokens, [1, 1, 1, 1])
    assert tokens.tolist() == [3, 7, 0, 0]


def test_seeded_rows_ignore_their_neighbours():
    logits = np.random.default_rng(3).standard_normal((16, V)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(16)]
    together, _ = sample(params, logits)
    alone = [sample([params[i]], logits[i:i + 1])[0][0] for i in range(16)]
    assert together.tolist() == alone


def test_logprobs_are_raw_and_ranked():
    logits = np.random.default_rng(4).standard_normal((3, V)).astype(np.float32)
    params = [SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, seed=9),
              SamplingParams(temperature=0.8, seed=5, logprobs=0)]
    tokens, lp = sample(params, logits, [[1, 7]] * 3, [1] * 3)
    assert lp.rows.tolist() == [0, 2]
    raw = log_softmax(logits[[0, 2]])
    assert np.allclose(lp.logprobs[:, 0], raw[[0, 1], tokens[[0, 2]]], atol=1e-6)
    assert lp.token_ids[0, 1:].tolist() == np.argsort(-raw[0])[:3].tolist()
    assert lp.ranks.tolist() == [int((raw[i] > raw[i, tokens[[0, 2]][i]]).sum()) + 1
                                 for i in range(2)]


@pytest.mark.parametrize("k", [1, 3, 32, 40])
def test_top_logprobs_equal_a_full_sort(k):
    """Both ways to the k best (argmax passes to k = 32, a partition past it) give a stable
    descending sort's ids (ties to the lower id where argmax finds them), distinct ids on rows
    with fewer than k finite logprobs (a grammar's mask), ranks counting the better ids, and
    leave the logprobs unchanged."""
    rng = np.random.default_rng(k)
    lp = np.round(rng.standard_normal((7, 300)), 1).astype(np.float32)   # many ties
    lp[3, 5:] = -np.inf                                 # 5 tokens allowed
    lp[4, :] = -np.inf
    lp[4, 17] = 0.0                                     # one token allowed
    before = lp.copy()
    chosen = np.array([0, 1, 2, 3, 17, 299, 150])
    ids, lps, ranks = top_logprobs(lp, chosen, k)
    assert np.array_equal(lp, before)
    assert np.array_equal(ids[:, 0], chosen) and np.array_equal(lps, np.take_along_axis(lp, ids, 1))
    for row in range(len(lp)):
        best = ids[row, 1:]
        assert len(set(best.tolist())) == k
        assert np.array_equal(lp[row, best], np.sort(lp[row])[::-1][:k])
        assert ranks[row] == (lp[row] > lp[row, chosen[row]]).sum() + 1
        finite = np.isfinite(lp[row, best])
        if k <= 32:
            assert np.array_equal(best[finite],
                                  np.argsort(-lp[row], kind="stable")[:finite.sum()])


def test_output_counts():
    token_ids = np.array([[1, 2, 2, 3, 0], [4, 4, 4, 4, 4]])
    counts = output_counts(token_ids, np.array([0, 1]), np.array([1, 2]), np.array([4, 5]), 6)
    assert counts.tolist() == [[0, 0, 2, 1, 0, 0], [0, 0, 0, 0, 3, 0]]
    # rows are batch rows: a penalized request need not sit in row 0
    counts = output_counts(token_ids, np.array([1]), np.array([1]), np.array([3]), 6)
    assert counts.tolist() == [[0, 0, 0, 0, 2, 0]]


def test_penalties_read_the_penalized_rows_own_tokens():
    """Regression: the penalties counted row 0's tokens for a request in another row."""
    state = SamplingState(4)
    state.set_row(0, SamplingParams(temperature=0), [])
    state.set_row(1, SamplingParams(temperature=0, frequency_penalty=2.0), [])
    token_ids = np.zeros((4, 8), np.int32)
    token_ids[0, :4] = [1, 1, 1, 1]
    token_ids[1, :4] = [2, 3, 3, 3]
    out = Sampler(0).processed_logits(np.zeros((1, 5), np.float32), np.array([1]), state,
                                      token_ids, np.array([1, 1, 0, 0]), np.array([4, 4, 0, 0]))
    assert out.tolist() == [[0.0, 0.0, 0.0, -6.0, 0.0]]


def reference_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """vLLM's definition written plainly: sort, keep while the mass before is below top_p."""
    out = np.zeros_like(probs)
    order = np.argsort(-probs, kind="stable")
    before = 0.0
    for i in order:
        if before >= top_p * probs.sum():
            break
        out[i] = probs[i]
        before += probs[i]
    return out


@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_top_p_matches_the_definition(shape):
    from vllm_actors.workers.sampler import _softmax, _top_p
    rng = np.random.default_rng(7)
    scale = 6.0 if shape == "peaked" else 0.3
    probs = _softmax((rng.standard_normal((6, 400)) * scale).astype(np.float32))
    top_p = np.array([0.05, 0.5, 0.9, 0.95, 0.99, 0.999])
    got = _top_p(probs, top_p)
    for i in range(6):
        assert np.array_equal(got[i] > 0, reference_top_p(probs[i], top_p[i]) > 0), i


# -- extreme controls: no row can fail its neighbours, no value can crash the sampler --------

def test_extreme_controls_sample_valid_tokens_beside_a_normal_row():
    """Values at the edges of what validation accepts (found to crash the engine before):
    each row gets a token in the vocabulary, and the ordinary row next to them is sampled
    exactly as when alone."""
    logits = np.random.default_rng(11).standard_normal((6, V)).astype(np.float32) * 4
    extreme = [SamplingParams(temperature=1e39, allowed_token_ids=[1, 2, 3], seed=1),
               SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=2),
               SamplingParams(temperature=1.0, top_k=2**64 - 1, seed=3),
               SamplingParams(temperature=1.0, seed=2**64 - 1),
               SamplingParams(temperature=1e-4, seed=4)]
    normal = SamplingParams(temperature=0.9, seed=77)
    tokens, _ = sample([*extreme, normal], logits, [[1, 7, 7]] * 6, [2] * 6)
    assert ((0 <= tokens) & (tokens < V)).all()
    assert tokens[0] in (1, 2, 3)
    alone, _ = sample([normal], logits[5:6], [[1, 7, 7]], [2])
    assert tokens[5] == alone[0]


def test_huge_seeds_are_reproducible_and_distinct():
    logits = np.zeros((1, V), np.float32)
    draws = {seed: [int(sample([SamplingParams(temperature=1.0, seed=seed)], logits)[0][0])
                    for _ in range(2)] for seed in (2**63, 2**64 - 1, 5)}
    assert all(a == b for a, b in draws.values())
    params = [SamplingParams(temperature=1.0, seed=2**64 - 1 - i) for i in range(20)]
    assert len(set(sample(params, np.zeros((20, V), np.float32))[0].tolist())) > 1


def test_a_row_with_no_token_left_fails_alone():
    logits = np.random.default_rng(12).standard_normal((3, V)).astype(np.float32)
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, allowed_token_ids=[4], bad_words=["x"],
                             bad_words_token_ids=[[4]], seed=1),
              SamplingParams(temperature=0.0, allowed_token_ids=[4], bad_words=["x"],
                             bad_words_token_ids=[[4]])]
    tokens, _, failed = sample_all(params, logits)
    assert tokens.tolist() == [int(logits[0].argmax()), -1, -1]
    assert set(failed) == {1, 2} and failed[1][1] == "allowed_token_ids"
    assert "no token is left" in failed[1][0]


def test_a_row_that_raises_fails_alone(monkeypatch):
    """Whatever raises inside sampling (here: one seeded row's generator) fails that row;
    the batch is sampled again row by row and the other rows get their tokens."""
    real = np.random.default_rng

    def rng(seed=None):
        if isinstance(seed, tuple) and seed[0] == 666:
            raise OverflowError("boom")
        return real(seed)

    monkeypatch.setattr(np.random, "default_rng", rng)
    logits = np.random.default_rng(13).standard_normal((3, V)).astype(np.float32)
    params = [SamplingParams(temperature=0.8, seed=1, logprobs=2),
              SamplingParams(temperature=0.8, seed=666),
              SamplingParams(temperature=0.0, logprobs=0)]
    tokens, lp, failed = sample_all(params, logits)
    assert list(failed) == [1] and "OverflowError: boom" in failed[1][0]
    alone = sample([params[0]], logits[:1])[0][0]
    assert tokens.tolist() == [alone, -1, int(logits[2].argmax())]
    assert lp.rows.tolist() == [0, 2] and lp.token_ids[:, 0].tolist() == [alone, tokens[2]]


def test_a_top_p_that_underflows_keeps_the_likeliest_token():
    """top_p=1e-300 passes validation ((0, 1]) but is 0 in float32: the likeliest token
    alone stays, as for any top_p below its probability (found by the fuzz test)."""
    logits = np.random.default_rng(14).standard_normal((4, V)).astype(np.float32)
    tokens, _ = sample([SamplingParams(temperature=1.0, top_p=1e-300, seed=i) for i in range(4)],
                       logits)
    assert tokens.tolist() == logits.argmax(axis=1).tolist()


# -- list-valued controls: precomputed once per request, per-step cost independent of size --

def reference_masks(logits: np.ndarray, params: list[SamplingParams], token_ids: np.ndarray,
                    num_prompt: np.ndarray, ends: np.ndarray, eos: list[int]) -> np.ndarray:
    """allowed ids, bad words, min_tokens stop ids and logit bias written plainly, one
    word at a time (the sampler's earlier loop, vLLM's rule): a bad word of L tokens bans its
    last token when the previous L - 1 output tokens equal its prefix."""
    out = logits.copy()
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            keep = out[i, p.allowed_token_ids]
            out[i] = -np.inf
            out[i, p.allowed_token_ids] = keep
        generated = token_ids[i, num_prompt[i]:ends[i]].tolist()
        for word in p.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or generated[len(generated) - len(prefix):] == prefix:
                out[i, word[-1]] = -np.inf
        if p.min_tokens > ends[i] - num_prompt[i]:
            stop = [*p.stop_token_ids, *([] if p.ignore_eos else eos)]
            out[i, stop] = -np.inf
        if p.logit_bias:
            np.add.at(out[i], list(p.logit_bias), np.float32(list(p.logit_bias.values())))
    return out


def random_list_params(rng: np.random.Generator, vocab: int, alphabet: int) -> SamplingParams:
    """Bad words over a small alphabet (so prefixes match often), lengths 1-4, repeats and
    shared prefixes included; sometimes allowed ids, min_tokens stop ids, a bias."""
    words = [rng.integers(0, alphabet, int(rng.integers(1, 5))).tolist()
             for _ in range(int(rng.integers(0, 30)))]
    kw = {}
    if rng.random() < 0.3:
        kw["allowed_token_ids"] = rng.integers(0, vocab, 12).tolist()
    if rng.random() < 0.3:
        kw.update(min_tokens=int(rng.integers(1, 6)),
                  stop_token_ids=rng.integers(0, vocab, 3).tolist())
    if rng.random() < 0.3:
        kw["logit_bias"] = {int(t): float(rng.normal()) for t in rng.integers(0, vocab, 4)}
    return SamplingParams(temperature=0.0, bad_words_token_ids=words, **kw)


def test_list_masks_match_the_reference_on_random_cases():
    rng = np.random.default_rng(21)
    vocab, alphabet, rows = 24, 5, 6
    for case in range(200):
        params = [random_list_params(rng, vocab, alphabet) for _ in range(rows)]
        params[1] = params[0]                  # rows that share one params object
        num_prompt = rng.integers(1, 4, rows)
        ends = num_prompt + rng.integers(0, 7, rows)
        token_ids = rng.integers(0, alphabet, (rows, 12)).astype(np.int32)
        state = SamplingState(rows)
        for row, p in enumerate(params):
            state.set_row(row, p, [2], child_index=row)
        logits = rng.standard_normal((rows, vocab)).astype(np.float32)
        got = Sampler(0).processed_logits(logits, np.arange(rows), state, token_ids,
                                          num_prompt, ends)
        want = reference_masks(logits, params, token_ids, num_prompt, ends, [2])
        assert np.array_equal(got, want), case


def count_lines(fn) -> int:
    """Python line events while fn() runs (in every frame it calls)."""
    import sys
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def list_controls(num_words: int, num_ids: int) -> SamplingParams:
    """Bad words of 1-4 tokens (the same four prefix lengths whatever num_words), including
    words that match the output [.., 7, 8, 9]; allowed ids, stop ids and a bias of num_ids."""
    rng = np.random.default_rng(5)
    words = [[3], [9, 4], [8, 9, 5], [7, 8, 9, 6]]
    words += [rng.integers(10, 1000, int(rng.integers(1, 5))).tolist()
              for _ in range(num_words)]
    return SamplingParams(temperature=0.0, bad_words_token_ids=words, min_tokens=50,
                          max_tokens=100,
                          allowed_token_ids=list(range(num_ids)),
                          stop_token_ids=list(range(1, num_ids)),
                          logit_bias={t: 0.5 for t in range(num_ids)})


def test_list_masks_cost_per_step_does_not_grow_with_the_lists_or_with_n():
    """The per-step masking runs as many Python lines for 4 bad words and 10 ids as for
    50,000 words and 1,000 ids (no loop over a list's entries), and 8 rows that share params
    build their index once."""
    vocab = 1000
    token_ids = np.tile(np.arange(12, dtype=np.int32), (8, 1))   # outputs end 7, 8, 9
    num_prompt, ends = np.full(8, 2), np.full(8, 10)
    logits = np.zeros((8, vocab), np.float32)
    lines = {}
    for size, (num_words, num_ids) in {"small": (4, 10), "large": (50_000, 1000)}.items():
        p = list_controls(num_words, num_ids)
        state = SamplingState(8)
        for row in range(8):
            state.set_row(row, p, [2], child_index=row)
        assert len({id(state.masks[row]) for row in range(8)}) == 1   # built once
        sampler = Sampler(0)

        def step(sampler=sampler, state=state):
            return sampler.processed_logits(logits, np.arange(8), state, token_ids,
                                            num_prompt, ends)

        out = step()                                     # first use builds the vocab mask
        assert np.isneginf(out[:, [3, 4, 5, 6]]).all()   # every matching word banned
        lines[size] = count_lines(step)
    print(f"per-step Python lines: {lines}")
    assert lines["small"] == lines["large"]


def test_children_are_seeded_seed_plus_index():
    """Completion i of n shares its parent's params and is seeded seed + i (mod 2^64): the
    same tokens as a request of its own with that seed."""
    logits = np.random.default_rng(8).standard_normal((4, V)).astype(np.float32)
    parent = SamplingParams(n=4, temperature=1.0, seed=2**64 - 2)
    state = SamplingState(4)
    for i in range(4):
        state.set_row(i, parent, [2], child_index=i)
    assert state.seed.tolist() == [2**64 - 2, 2**64 - 1, 0, 1] and state.seeded.all()
    rows, _, token_ids, num_prompt, num_tokens = batch([parent] * 4, [[1, 1]] * 4, [1] * 4)
    together, _, _ = Sampler(0).sample(logits, rows, state, token_ids, num_prompt, num_tokens)
    alone = [sample([SamplingParams(temperature=1.0, seed=s)], logits[i:i + 1])[0][0]
             for i, s in enumerate([2**64 - 2, 2**64 - 1, 0, 1])]
    assert together.tolist() == alone
    state.set_row(0, SamplingParams(n=4, temperature=1.0), [2], child_index=3)
    assert not state.seeded[0]
