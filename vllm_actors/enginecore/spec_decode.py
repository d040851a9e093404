"""Speculative decoding in the engine core: which of a worker's drafts a request verifies
next step, and the rules that turn speculation down when it does not pay.

The workers propose drafts after each step (`StepOutput.draft_token_ids`); `DraftPolicy`
shortens them to what the request may still produce (max_tokens, max_model_len), to what its
grammar accepts (structured outputs: drafts after the first token the grammar rejects are
dropped), and to nothing in a step with more running requests than `disable_by_batch_size`.
A request whose recent drafts are mostly rejected (an exponential average of its acceptance
rate below `min_acceptance`) verifies one draft per step until drafts are accepted again: a
rejected draft costs a position of compute, and on a CPU a verification of k drafts costs
about k decode positions of matmul work.

The scheduler counts the drafts as scheduled tokens; after the step, the rejected ones are
taken back from `num_computed_tokens` (their KV slots are written again next step) and never
reach block hashes or the prefix cache (only known tokens are hashed).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_actors.config_speculative import SpeculativeConfig
from vllm_actors.enginecore.request import Request

ACCEPTANCE_WEIGHT = 0.25   # weight of the latest verification in a request's average


class DraftPolicy:
    """Args:
        config: the speculative-decoding configuration.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        # a draft model writes KV for its own drafts: their slots are reserved ahead
        self.num_lookahead_tokens = config.num_speculative_tokens if config.uses_draft_model \
            else 0

    def accept(self, request: Request, drafts: Sequence[int], num_running: int) -> list[int]:
        """The drafts `request` verifies next step (possibly none)."""
        limit = self.config.disable_by_batch_size
        if not drafts or (limit is not None and num_running > limit):
            return []
        num = min(len(drafts), self.num_speculative_tokens,
                  request.max_tokens - request.num_output_tokens - 1,
                  request.max_model_len - request.num_tokens - 1)
        if request.spec_acceptance < self.config.min_acceptance:
            num = min(num, 1)
        kept = list(drafts[:max(num, 0)])
        if kept and request.grammar is not None:
            kept = kept[:request.grammar.validate_tokens(kept)]
        return kept

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts accepted `num_accepted`."""
        request.spec_acceptance += ACCEPTANCE_WEIGHT * (num_accepted / num_drafts
                                                        - request.spec_acceptance)
