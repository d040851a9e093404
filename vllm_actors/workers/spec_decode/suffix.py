"""Suffix decoding: draft tokens from suffix tries over the request and over recent outputs.

In the spirit of SuffixDecoding (arXiv 2411.04975) and vLLM's `method: "suffix"`.

Data structure (`_SuffixTrie`): a trie of every substring of length <= `max_depth` of the
sequences inserted into it. Node 0 is the root (the empty string); a node at depth `d` is one
substring `s` of length `d`, and its child through token `t` is `s + [t]`. Storage is flat:
`_child_by_key` maps `parent * 2**32 + token` to the child's id (token ids must lie in
[0, 2**31)), and `array('i')` columns hold, per node id, its token, parent, depth, counts and
a doubly linked list of its children (`first_child`, `next_sibling`, `prev_sibling`; -1 ends a
list). Freed ids go to a free list and are reused.

Invariants, for every live node `s` (those in `_child_by_key`, plus the root):
- `num_occ[s]` = the number of occurrences of `s` in the inserted sequences (> 0).
- `num_cont[s]` = the number of those occurrences followed by a token
  = sum of `num_occ` over the children of `s` (0 at depth `max_depth`: no children kept).
  The probability of continuing `s` with `t` is `num_occ[s + t] / num_cont[s]`. Using
  continuation counts (not occurrences) matters for the request's own trie: its last tokens
  always occur at the end of the sequence, where nothing follows them yet.
- The trie is suffix- and prefix-closed, and `num_cont` can only shrink when a token is added
  on the left: so "the suffix of length L has a continuation" is monotone in L.

Appending a token `t` to a sequence: the nodes of the suffixes ending at the previous token
(lengths 0..max_depth-1, the caller's `active_ids`) each gain the child `t` (created if
missing, `num_occ += 1`, parent's `num_cont += 1`): O(max_depth) per token. Removing a
sequence replays the same walk with decrements and frees the nodes whose count reaches 0.

Proposing: a matched context is the longest suffix (length <= max_depth - 1, since its
continuations live one level deeper) with `num_cont > 0`. The draft walks down from it, taking
the child with the highest count (ties: the smallest token id), multiplying a running
probability by `num_occ[child] / num_cont[node]`; it stops when that probability falls below
`min_token_prob`, at a node with no continuation, or at the limit
`min(num_speculative_tokens, max(1, floor(max_spec_factor * match_length)))`. At depth
`max_depth` the walk re-matches the last max_depth - 1 tokens of (context + draft). A draft's
score is the sum of its running probabilities (expected accepted tokens); the request's own
trie and the global trie (outputs of recently finished requests) each propose, and the higher
score wins (the request's own on ties).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict

import numpy as np

_KEY_BASE = 1 << 32  # child key: parent * _KEY_BASE + token
_MAX_TOKEN_ID = (1 << 31) - 1  # token ids are stored as int32


class _SuffixTrie:
    """A bounded-depth suffix trie with continuation counts (see the module docstring)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._child_by_key: dict[int, int] = {}
        self._free_ids: list[int] = []
        # Per-node columns; index 0 is the root (token 0 unused, no parent, no children yet).
        self.token = array("i", [0])
        self.parent = array("i", [-1])
        self.depth = array("i", [0])
        self.num_occ = array("i", [0])
        self.num_cont = array("i", [0])
        self.first_child = array("i", [-1])
        self.next_sibling = array("i", [-1])
        self.prev_sibling = array("i", [-1])

    @property
    def num_nodes(self) -> int:
        """Live nodes, the root included."""
        return len(self._child_by_key) + 1

    def _new_node(self, parent: int, token: int) -> int:
        """A child `token` of `parent` with zero counts, first in the parent's child list."""
        sibling = self.first_child[parent]
        if self._free_ids:
            node = self._free_ids.pop()
            self.token[node], self.parent[node] = token, parent
            self.depth[node] = self.depth[parent] + 1
            self.num_occ[node] = self.num_cont[node] = 0
            self.first_child[node] = self.prev_sibling[node] = -1
            self.next_sibling[node] = sibling
        else:
            node = len(self.token)
            self.token.append(token)
            self.parent.append(parent)
            self.depth.append(self.depth[parent] + 1)
            self.num_occ.append(0)
            self.num_cont.append(0)
            self.first_child.append(-1)
            self.next_sibling.append(sibling)
            self.prev_sibling.append(-1)
        if sibling != -1:
            self.prev_sibling[sibling] = node
        self.first_child[parent] = node
        self._child_by_key[parent * _KEY_BASE + token] = node
        return node

    def _free_node(self, node: int) -> None:
        parent, prev, nxt = self.parent[node], self.prev_sibling[node], self.next_sibling[node]
        if prev == -1:
            self.first_child[parent] = nxt
        else:
            self.next_sibling[prev] = nxt
        if nxt != -1:
            self.prev_sibling[nxt] = prev
        del self._child_by_key[parent * _KEY_BASE + self.token[node]]
        self._free_ids.append(node)

    def append(self, active_ids: list[int], token: int) -> list[int]:
        """Add one token after the suffixes `active_ids` (node ids by length, from the root);
        returns the suffixes ending at the new token."""
        get, num_occ, num_cont = self._child_by_key.get, self.num_occ, self.num_cont
        new_active_ids = [0]
        for node in active_ids[:self.max_depth]:
            child = get(node * _KEY_BASE + token)
            if child is None:
                child = self._new_node(node, token)
            num_occ[child] += 1
            num_cont[node] += 1
            new_active_ids.append(child)
        return new_active_ids

    def insert(self, token_ids: list[int]) -> None:
        active_ids = [0]
        for token in token_ids:
            active_ids = self.append(active_ids, token)

    def remove(self, token_ids: list[int]) -> None:
        """Undo exactly one `insert(token_ids)`."""
        child_by_key, num_occ, num_cont = self._child_by_key, self.num_occ, self.num_cont
        dead_ids = []
        active_ids = [0]
        for token in token_ids:
            new_active_ids = [0]
            for node in active_ids[:self.max_depth]:
                child = child_by_key[node * _KEY_BASE + token]
                num_occ[child] -= 1
                num_cont[node] -= 1
                if num_occ[child] == 0:
                    dead_ids.append(child)
                new_active_ids.append(child)
            active_ids = new_active_ids
        for node in dead_ids:  # after the walk: a dead node may be a parent on it
            self._free_node(node)

    def _find(self, token_ids: list[int]) -> int:
        node = 0
        get = self._child_by_key.get
        for token in token_ids:
            node = get(node * _KEY_BASE + token, -1)
            if node == -1:
                break
        return node

    def longest_match(self, tail_ids: list[int]) -> tuple[int, int]:
        """(node, length) of the longest suffix of `tail_ids` (length <= max_depth - 1) that
        has a continuation; (-1, 0) if none. Binary search (the property is monotone) after
        trying the longest, the usual case when re-matching along a repeated span."""
        lo, hi, best = 0, min(len(tail_ids), self.max_depth - 1), -1
        node = self._find(tail_ids[len(tail_ids) - hi:])
        if hi > 0 and node != -1 and self.num_cont[node] > 0:
            return node, hi
        hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self._find(tail_ids[len(tail_ids) - mid:])
            if node != -1 and self.num_cont[node] > 0:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo

    def best_child(self, node: int) -> int:
        """The child with the highest count; ties: the smallest token id."""
        best, child = -1, self.first_child[node]
        num_occ, token, next_sibling = self.num_occ, self.token, self.next_sibling
        while child != -1:
            if best == -1 or num_occ[child] > num_occ[best] or (
                    num_occ[child] == num_occ[best] and token[child] < token[best]):
                best = child
            child = next_sibling[child]
        return best

    def draft(self, node: int, limit: int, min_token_prob: float,
              tail_ids: list[int]) -> tuple[list[int], float]:
        """Walk down from the matched `node` (the context ends with `tail_ids`); returns
        (draft ids, score)."""
        draft_ids: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft_ids) < limit:
            if self.num_cont[node] == 0:
                if self.depth[node] < self.max_depth:
                    break
                node, _ = self.longest_match((tail_ids + draft_ids)[-(self.max_depth - 1):])
                if node == -1:
                    break
            child = self.best_child(node)
            prob *= self.num_occ[child] / self.num_cont[node]
            if prob < min_token_prob:
                break
            draft_ids.append(self.token[child])
            score += prob
            node = child
        return draft_ids, score

    def to_counts(self) -> dict[tuple[int, ...], tuple[int, int]]:
        """{substring: (num_occ, num_cont)} for every live node but the root (for tests)."""
        counts = {}
        for node in self._child_by_key.values():
            path_ids, cur = [], node
            while cur > 0:
                path_ids.append(self.token[cur])
                cur = self.parent[cur]
            counts[tuple(reversed(path_ids))] = (self.num_occ[node], self.num_cont[node])
        return counts


class _RequestState:
    """One running request: its own trie, the suffixes ending at its last token, and the
    tokens seen (to check that the next call extends them)."""

    def __init__(self, max_depth: int) -> None:
        self.trie = _SuffixTrie(max_depth)
        self.active_ids = [0]
        self.token_ids = np.zeros(0, np.int64)
        self.num_prompt_tokens = 0


class SuffixProposer:
    """Per-request suffix decoding proposer (see the module docstring)."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24,
                 max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        if num_speculative_tokens < 1 or max_tree_depth < 2:
            raise ValueError("need num_speculative_tokens >= 1 and max_tree_depth >= 2")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _RequestState] = {}
        self._global = _SuffixTrie(max_tree_depth)
        # req_id -> output ids inserted into the global trie, oldest first
        self._cached_output_ids: OrderedDict[str, list[int]] = OrderedDict()

    def propose(self, req_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> list[int]:
        """Up to num_speculative_tokens draft ids likely to follow `token_ids` (the verified
        prompt + output tokens); rebuilds the request's state if they do not extend the
        previous call's."""
        if req_id in self._cached_output_ids:  # restarted after finishing: no double count
            self._global.remove(self._cached_output_ids.pop(req_id))
        token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        state = self._requests.get(req_id)
        num_seen = 0 if state is None else len(state.token_ids)
        if state is None or len(token_ids) < num_seen or not np.array_equal(
                token_ids[:num_seen], state.token_ids):
            state = self._requests[req_id] = _RequestState(self.max_tree_depth)
            num_seen = 0
        new_ids = token_ids[num_seen:].tolist()
        if new_ids and (min(new_ids) < 0 or max(new_ids) > _MAX_TOKEN_ID):
            raise ValueError("token ids must lie in [0, 2**31)")
        for token in new_ids:
            state.active_ids = state.trie.append(state.active_ids, token)
        state.token_ids = token_ids.copy()
        state.num_prompt_tokens = num_prompt_tokens
        return self._propose(state)

    def _propose(self, state: _RequestState) -> list[int]:
        trie, depth = state.trie, self.max_tree_depth
        tail_ids = state.token_ids[-(depth - 1):].tolist()
        best_ids: list[int] = []
        best_score = 0.0
        # The own trie: the active suffixes give the candidates without a lookup.
        for length in range(min(len(state.active_ids), depth) - 1, 0, -1):
            node = state.active_ids[length]
            if trie.num_cont[node] > 0:
                best_ids, best_score = trie.draft(
                    node, self._limit(length), self.min_token_prob, tail_ids)
                break
        # A global draft can beat a local score only below num_speculative_tokens.
        if self._global.num_nodes > 1 and best_score < self.num_speculative_tokens:
            node, length = self._global.longest_match(tail_ids)
            if node != -1:
                draft_ids, score = self._global.draft(
                    node, self._limit(length), self.min_token_prob, tail_ids)
                if score > best_score:
                    best_ids = draft_ids
        return best_ids

    def _limit(self, match_length: int) -> int:
        return min(self.num_speculative_tokens,
                   max(1, math.floor(self.max_spec_factor * match_length)))

    def finish(self, req_id: str) -> None:
        """Drop the request's state; its output tokens (as of its last `propose`) join the
        global cache, evicting the oldest cached requests beyond max_cached_requests."""
        state = self._requests.pop(req_id, None)
        if state is None or self.max_cached_requests <= 0:
            return
        # Not cached now: propose() took it out of the cache when the request restarted.
        output_ids = state.token_ids[state.num_prompt_tokens:].tolist()
        if not output_ids:
            return
        self._global.insert(output_ids)
        self._cached_output_ids[req_id] = output_ids
        while len(self._cached_output_ids) > self.max_cached_requests:
            _, evicted_ids = self._cached_output_ids.popitem(last=False)
            self._global.remove(evicted_ids)
