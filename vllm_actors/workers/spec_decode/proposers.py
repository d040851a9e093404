"""Proposers as the model runner calls them: after a step, drafts for the requests that
sampled, into `StepOutput.draft_token_ids`; `finish` when a request leaves the batch.

`RequestProposer` runs a per-request method (n-gram, suffix) over each request's known tokens
in the persistent batch; the draft model (`draft_model.py`) is batched. A new method (EAGLE,
Medusa, MTP heads) is a new class with the same two calls.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from vllm_actors.config import EngineConfig
from vllm_actors.protocol.step import StepOutput
from vllm_actors.workers.input_batch import InputBatch
from vllm_actors.workers.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    def propose_for(self, batch: InputBatch, rows: np.ndarray, req_ids: list[str],
                    accepted: list[list[int]], out: StepOutput) -> None:
        """Drafts for the requests in `rows` that got tokens this step (`accepted`, per
        request; [] for one that failed), written to out.draft_token_ids."""

    def finish(self, req_id: str) -> None:
        """The request left the batch (finished, aborted or preempted)."""

    def kv_bytes_per_block(self) -> int:
        """KV bytes the proposer keeps per block id (a draft model's own cache)."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate that cache for `num_blocks` usable blocks."""


class RequestProposer:
    """A per-request method over each request's tokens; nothing is drafted in a step with
    more requests in the batch than `disable_by_batch_size` (the core applies the same
    rule; skipping here saves the work)."""

    def __init__(self, method: Any, disable_by_batch_size: int | None) -> None:
        self.method = method
        self.limit = disable_by_batch_size

    def propose_for(self, batch: InputBatch, rows: np.ndarray, req_ids: list[str],
                    accepted: list[list[int]], out: StepOutput) -> None:
        if self.limit is not None and len(batch) > self.limit:
            return
        for row, req_id, kept in zip(rows.tolist(), req_ids, accepted):
            if kept:
                drafts = self.method.propose(req_id, batch.token_ids[row, :batch.num_tokens[row]],
                                             int(batch.num_prompt_tokens[row]))
                if drafts:
                    out.draft_token_ids[req_id] = drafts

    def finish(self, req_id: str) -> None:
        self.method.finish(req_id)

    def kv_bytes_per_block(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """No cache."""


def make_proposer(config: EngineConfig, backend: Any, target_args: Any) -> Proposer:
    spec = config.speculative
    assert spec is not None
    if spec.method == "ngram":
        return RequestProposer(NgramProposer(spec.num_speculative_tokens,
                                             spec.prompt_lookup_min, spec.prompt_lookup_max),
                               spec.disable_by_batch_size)
    if spec.method == "suffix":
        from vllm_actors.workers.spec_decode.suffix import SuffixProposer
        return RequestProposer(SuffixProposer(
            spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob), spec.disable_by_batch_size)
    from vllm_actors.workers.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(config, backend, target_args)
