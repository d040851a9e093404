"""The suffix decoding proposer: exact drafts on hand-built sequences, continuation counts,
incremental building against a from-scratch build and a brute-force reference, the global
cache of finished outputs (eviction, preemption), min_token_prob and the adaptive length."""

from collections import Counter

import numpy as np
import pytest

from vllm_actors.workers.spec_decode.suffix import SuffixProposer, _SuffixTrie


def propose(proposer: SuffixProposer, req_id: str, prompt_ids: list[int],
            output_ids: list[int] = ()) -> list[int]:
    token_ids = np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64)
    return proposer.propose(req_id, token_ids, len(prompt_ids))


def run_request(proposer: SuffixProposer, req_id: str, prompt_ids: list[int],
                output_ids: list[int]) -> None:
    propose(proposer, req_id, prompt_ids, output_ids)
    proposer.finish(req_id)


def reference_draft(seq_ids: list[int], depth: int, num_spec: int, factor: float,
                    min_prob: float) -> list[int]:
    """Brute force over the sequence itself (no trie): the local proposal for `seq_ids`."""
    def followers(pattern: list[int]) -> Counter:
        n = len(pattern)
        return Counter(seq_ids[i + n] for i in range(len(seq_ids) - n)
                       if seq_ids[i:i + n] == pattern)

    def match(context_ids: list[int]) -> list[int]:
        for n in range(min(depth - 1, len(context_ids)), 0, -1):
            if followers(context_ids[-n:]):
                return context_ids[-n:]
        return []

    path_ids = match(seq_ids)
    limit = min(num_spec, max(1, int(factor * len(path_ids))))
    draft_ids, prob = [], 1.0
    while path_ids and len(draft_ids) < limit:
        if len(path_ids) == depth:
            path_ids = match(seq_ids + draft_ids)
            if not path_ids:
                break
        counts = followers(path_ids)
        if not counts:
            break
        token, count = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        prob *= count / sum(counts.values())
        if prob < min_prob:
            break
        draft_ids.append(token)
        path_ids = path_ids + [token]
    return draft_ids


def test_repeated_phrase_in_prompt_is_drafted():
    phrase_ids = [100, 101, 102, 103, 104, 105, 106, 107]
    prompt_ids = [1, 2] + phrase_ids + [3, 4]
    proposer = SuffixProposer(5, max_spec_factor=2.0)
    assert propose(proposer, "r", prompt_ids) == []
    # 3-token match: the limit is min(5, 2 * 3) = 5, the rest of the phrase
    assert propose(proposer, "r", prompt_ids, [100, 101, 102]) == [103, 104, 105, 106, 107]
    # drafts accepted: the walk continues past the phrase into the prompt
    assert propose(proposer, "r", prompt_ids, [100, 101, 102, 103, 104, 105]) == [
        106, 107, 3, 4, 100]
    # with factor 1.0 a 3-token match drafts 3 tokens
    adaptive = SuffixProposer(5)
    assert propose(adaptive, "r", prompt_ids, [100, 101, 102]) == [103, 104, 105]


def test_own_end_has_no_continuation():
    proposer = SuffixProposer(4)
    assert propose(proposer, "a", [1, 2, 3, 4, 5]) == []
    assert propose(proposer, "b", [7]) == []
    assert propose(proposer, "c", []) == []
    # [1, 2] occurs twice but only the first is followed by a token
    assert propose(proposer, "d", [1, 2, 3, 1, 2]) == [3, 1]
    with pytest.raises(ValueError):
        propose(proposer, "e", [1, -1])


def test_probabilities_use_continuation_counts():
    # [7] occurs twice, once followed by 8: p(8) = 1, not 1/2
    proposer = SuffixProposer(4, min_token_prob=0.6)
    assert propose(proposer, "r", [7, 8, 7]) == [8]
    trie = _SuffixTrie(3)
    trie.insert([7, 8, 7])
    assert trie.to_counts() == {(7,): (2, 1), (8,): (1, 1), (7, 8): (1, 1), (8, 7): (1, 0),
                                (7, 8, 7): (1, 0)}


def test_incremental_equals_from_scratch_and_reference():
    rng = np.random.default_rng(0)
    for depth, factor in ((24, 1.0), (4, 3.0)):
        seq_ids = rng.integers(0, 8, size=400).tolist()
        incremental = SuffixProposer(5, max_tree_depth=depth, max_spec_factor=factor)
        num_tokens, num_drafted, num_checks = 10, 0, 0
        while num_tokens <= len(seq_ids):
            prefix_ids = seq_ids[:num_tokens]
            got = propose(incremental, "r", prefix_ids[:6], prefix_ids[6:])
            fresh = SuffixProposer(5, max_tree_depth=depth, max_spec_factor=factor)
            assert got == propose(fresh, "x", prefix_ids[:6], prefix_ids[6:])
            assert got == reference_draft(prefix_ids, depth, 5, factor, 0.1)
            num_drafted += len(got)
            num_checks += 1
            num_tokens += int(rng.integers(1, 5))
        assert num_drafted > num_checks  # the check is not vacuous


def test_restart_with_other_tokens_rebuilds():
    proposer = SuffixProposer(4)
    assert propose(proposer, "r", [1, 2, 3, 1, 2]) == [3, 1]
    assert propose(proposer, "r", [4, 5, 6, 4]) == [5]
    # longer but not an extension: a state appended to would hold [4, 5, 6, 4, 8] -> []
    assert propose(proposer, "r", [7, 8, 9, 7, 8]) == [9, 7]


def test_global_cache_drafts_finished_outputs_and_evicts():
    proposer = SuffixProposer(8, max_cached_requests=2, max_spec_factor=2.0)
    output_a = [10, 11, 12, 13, 14, 15]
    run_request(proposer, "A", [50, 51, 60, 61, 62, 63], output_a)
    # B's own tokens have no match; the global cache drafts the rest of A's output
    assert propose(proposer, "B", [70, 71], [10, 11]) == [12, 13, 14, 15]
    # A's prompt is not cached
    assert propose(proposer, "B2", [72, 60, 61]) == []
    run_request(proposer, "C", [1], [20, 21, 22])
    assert propose(proposer, "B3", [73], [10, 11]) == [12, 13, 14, 15]
    run_request(proposer, "D", [1], [30, 31, 32])
    assert propose(proposer, "B4", [74], [10, 11]) == []
    # eviction removed exactly A's contributions
    only_cd = SuffixProposer(8, max_cached_requests=2)
    run_request(only_cd, "C", [1], [20, 21, 22])
    run_request(only_cd, "D", [1], [30, 31, 32])
    assert proposer._global.to_counts() == only_cd._global.to_counts()
    assert proposer._global.num_nodes == only_cd._global.num_nodes == 13


def test_finishing_twice_does_not_double_count():
    proposer = SuffixProposer(4, min_token_prob=0.6)
    run_request(proposer, "A", [1], [10, 11, 12])
    run_request(proposer, "E", [2], [10, 11, 13])
    counts = proposer._global.to_counts()
    # preemption: A restarts with the same tokens, then finishes again
    run_request(proposer, "A", [1], [10, 11, 12])
    proposer.finish("A")  # a second finish without a propose is a no-op
    assert proposer._global.to_counts() == counts
    assert counts[(10, 11)] == (2, 2)
    # p(12 | 10 11) = 1/2 < 0.6; double counting A would make it 2/3
    assert propose(proposer, "B", [3], [10, 11]) == []
    # a restarted request still running is not in the cache
    propose(proposer, "E", [2], [10])
    assert proposer._global.to_counts()[(10, 11)] == (1, 1)


@pytest.mark.parametrize("min_prob, factor, expected", [
    (0.8, 1.0, []),                 # p(5) = 3/4 < 0.8
    (0.5, 1.0, [5]),                # then p(5, 10) = 3/4 * 1/3 < 0.5
    (0.2, 1.0, [5, 10]),            # ties 10/11/12: smallest id; limit floor(1.0 * 2) = 2
    (0.2, 2.0, [5, 10, 1, 2]),      # limit min(4, floor(2.0 * 2)) = 4
])
def test_min_token_prob(min_prob, factor, expected):
    prompt_ids = [1, 2, 5, 10, 1, 2, 5, 11, 1, 2, 5, 12, 1, 2, 6, 13, 1, 2]
    proposer = SuffixProposer(4, min_token_prob=min_prob, max_spec_factor=factor)
    assert propose(proposer, "r", prompt_ids) == expected


def test_draft_score_is_sum_of_running_probabilities():
    trie = _SuffixTrie(24)
    trie.insert([1, 2, 5, 10, 1, 2, 5, 11, 1, 2, 5, 12, 1, 2, 6, 13, 1, 2])
    node = trie._find([1, 2])
    assert trie.num_occ[node] == 5 and trie.num_cont[node] == 4
    draft_ids, score = trie.draft(node, 4, 0.2, [1, 2])
    assert draft_ids == [5, 10, 1, 2] and score == pytest.approx(0.75 + 3 * 0.25)


def test_adaptive_length():
    seq_ids = [1, 2, 3, 4, 5, 6, 9, 1, 2]
    assert propose(SuffixProposer(8), "r", seq_ids) == [3, 4]
    assert propose(SuffixProposer(8, max_spec_factor=2.0), "r", seq_ids) == [3, 4, 5, 6]
    assert propose(SuffixProposer(3, max_spec_factor=2.0), "r", seq_ids) == [3, 4, 5]
    assert propose(SuffixProposer(8, max_spec_factor=0.1), "r", seq_ids) == [3]


def test_higher_score_wins_between_local_and_global():
    proposer = SuffixProposer(5, max_spec_factor=4.0, min_token_prob=0.6)
    run_request(proposer, "A", [0], [10, 11, 20, 21, 22, 23])
    # local: [10, 11] -> 30 or 31 with p = 1/2 < 0.6 (score 0); global: 20..23 (score 4)
    assert propose(proposer, "B", [10, 11, 30, 10, 11, 31, 5], [10, 11]) == [20, 21, 22, 23]
    # equal scores (4; the local walk stops at 9 or 8, p = 1/2): the request's own draft wins
    prompt_ids = [10, 11, 30, 31, 32, 33, 9, 10, 11, 30, 31, 32, 33, 8, 7]
    assert propose(proposer, "C", prompt_ids, [10, 11]) == [30, 31, 32, 33]
    # a longer global match ([7, 8, 9] -> 1 or 2, p = 1/2 < 0.6: nothing) loses to a shorter
    # local one ([8, 9] -> 3, 4, 7, 8, 9: score 5)
    run_request(proposer, "D", [0], [7, 8, 9, 1, 7, 8, 9, 2])
    assert propose(proposer, "E", [8, 9, 3, 4], [7, 8, 9]) == [3, 4, 7, 8, 9]
    # the global draft with a lower min_token_prob, and its score
    assert proposer._global.draft(proposer._global._find([7, 8, 9]), 4, 0.1, [7, 8, 9]) == (
        [1, 7, 8, 9], 2.0)


def test_remove_frees_nodes_and_reuses_ids():
    trie = _SuffixTrie(4)
    trie.insert([1, 2, 3, 1, 2])
    snapshot, num_nodes = trie.to_counts(), trie.num_nodes
    trie.insert([2, 3, 4, 5])
    num_ids = len(trie.token)
    trie.remove([1, 2, 3, 1, 2])
    trie.insert([1, 2, 3, 1, 2])
    trie.remove([2, 3, 4, 5])
    assert trie.to_counts() == snapshot and trie.num_nodes == num_nodes
    assert len(trie.token) == num_ids  # freed ids were reused
    trie.remove([1, 2, 3, 1, 2])
    assert trie.num_nodes == 1 and trie.first_child[0] == -1 and trie.num_cont[0] == 0
