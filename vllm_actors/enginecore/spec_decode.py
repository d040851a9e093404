"""Speculative decoding in the engine core: which of a worker's drafts a request verifies
next step, and the rules that turn speculation down when it does not pay.

The workers propose drafts after each step (`StepOutput.draft_token_ids`); `DraftPolicy`
shortens them to what the request may still produce (max_tokens, max_model_len), to what its
grammar accepts (structured outputs: drafts after the first token the grammar rejects are
dropped), and to nothing in a step with more running requests than `disable_by_batch_size`.

Acceptance rule: each request keeps a decaying count of its drafts' acceptances and
rejections (a verification of n drafts with a accepted is a successes and, when a < n, one
rejection; a new request starts at (2, 1)), whose ratio estimates the chance `alpha` that its
next draft is accepted when the one before it was. The i-th draft is then accepted with
probability alpha^i and costs `draft_cost` decode steps to verify, so the request verifies
the drafts with alpha^i > draft_cost: n = floor(log(draft_cost) / log(alpha)). A request
whose drafts are
rejected drops to none, and tries one draft every PROBE_INTERVAL steps to notice when drafts
pay again (e.g. when it starts quoting its prompt).

The scheduler counts the drafts as scheduled tokens; after the step, the rejected ones are
taken back from `num_computed_tokens` (their KV slots are written again next step) and never
reach block hashes or the prefix cache (only known tokens are hashed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm_actors.config_speculative import SpeculativeConfig
from vllm_actors.enginecore.request import Request

DECAY = 0.8          # weight of the older evidence at each verification
PROBE_INTERVAL = 8   # steps without drafts before a turned-down request tries one


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
        num = min(len(drafts), self.num_drafts_worth_verifying(request),
                  request.max_tokens - request.num_output_tokens - 1,
                  request.max_model_len - request.num_tokens - 1)
        kept = list(drafts[:max(num, 0)])
        if kept and request.grammar is not None:
            kept = kept[:request.grammar.validate_tokens(kept)]
        return kept

    def num_drafts_worth_verifying(self, request: Request) -> int:
        cost = self.config.draft_cost
        accepted, rejected = request.spec_evidence
        alpha = accepted / (accepted + rejected)
        if cost <= 0 or alpha >= 1:
            return self.num_speculative_tokens
        num = int(math.log(cost) / math.log(alpha)) if 0 < alpha and cost < 1 else 0
        if num == 0:
            request.spec_idle_steps += 1
            if request.spec_idle_steps >= PROBE_INTERVAL:
                request.spec_idle_steps = 0
                return 1
        return min(num, self.num_speculative_tokens)

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts accepted `num_accepted`."""
        accepted, rejected = request.spec_evidence
        request.spec_evidence = (DECAY * accepted + num_accepted,
                                 DECAY * rejected + (num_accepted < num_drafts))
