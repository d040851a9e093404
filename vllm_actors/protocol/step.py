"""Engine core <-> worker messages. A request's full data travels once (NewRequestData); after
that only diffs: new blocks and the computed-token count. Workers append their own sampled
tokens, so the core never sends back what a worker produced (except to the stages of a
pipeline, which do not sample: `CachedRequestData.new_token_ids`)."""

from __future__ import annotations

import msgspec

from vllm_actors.lora_request import LoRARequest
from vllm_actors.pooling_params import PoolingParams
from vllm_actors.protocol.engine import PooledOutput, TokenLogprobs
from vllm_actors.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the worker has not seen (or must rebuild after preemption).

    Attributes:
        token_ids: every token known so far (prompt, plus outputs when resumed).
        block_ids: KV blocks per KV cache group, each in order: block i holds positions
            [i * block_size, (i+1) * block_size) (0, the null block, for blocks a sliding
            window no longer sees).
        num_computed_tokens: tokens whose KV is already in those blocks (prefix-cache hits).
        num_prompt_tokens: how many of token_ids are prompt (the rest are earlier outputs).
        eos_token_ids: masked with stop_token_ids until min_tokens (unless ignore_eos).
        child_index: which of its request's n completions this is: the row is seeded with
            `sampling_params.child_seed(child_index)`.
        params_from: the req_id of an earlier entry of the same `StepInput.new_requests`
            whose SamplingParams this one shares (sibling completions admitted in one step),
            so they travel once; `sampling_params` is then `SamplingParams()`, a
            placeholder. Read them with `StepInput.new_request_params`.
        lora_request: the request's LoRA adapter (None: the base model).
        pooling_params: a pooling request's (its whole prompt is in this step; it gets a
            pooled output instead of a sampled token).
    """

    req_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    num_computed_tokens: int
    num_prompt_tokens: int
    eos_token_ids: list[int] = []
    child_index: int = 0
    params_from: str = ""
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Diffs for requests the worker already holds (parallel lists; new blocks per request
    per KV cache group).

    new_token_ids: with pipeline parallelism only (empty otherwise), the tokens sampled for
    each request since it was last scheduled: the stages before the last never see the
    sampled ids, so every stage appends them from here (vLLM's PP does the same)."""

    req_ids: list[str] = []
    new_block_ids: list[list[list[int]]] = []
    num_computed_tokens: list[int] = []
    new_token_ids: list[list[int]] = []


class StepInput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's work.

    Attributes:
        num_scheduled_tokens: tokens to compute this step, per request id, in the order the
            worker lays them out (running requests first, then newly admitted ones).
        finished_req_ids: requests to forget (finished, aborted or preempted) before the step;
            a preempted request comes back later as a NewRequestData with all its tokens.
        spec_token_ids: draft tokens to verify, per request (speculative decoding): they
            follow the request's last known token and are counted in its scheduled tokens;
            the worker samples at the last known token and at every draft.
        grammar_req_ids / grammar_bitmask: structured-output requests that sample this step
            and their allowed tokens, int32 [rows, ceil(vocab / 32)] as bytes (bit t % 32 of
            word t // 32 set = token t allowed); a request with drafts has one row per
            sampled position (1 + its drafts), consecutive, in grammar_req_ids order.
    """

    new_requests: list[NewRequestData] = []
    cached_requests: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = {}
    finished_req_ids: list[str] = []
    grammar_req_ids: list[str] = []
    grammar_bitmask: bytes = b""
    spec_token_ids: dict[str, list[int]] = {}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def new_request_params(self) -> list[SamplingParams]:
        """The SamplingParams of each of new_requests, `params_from` resolved: siblings
        get one shared object."""
        by_id: dict[str, SamplingParams] = {}
        params = []
        for new in self.new_requests:
            p = by_id[new.params_from] if new.params_from else new.sampling_params
            by_id[new.req_id] = p
            params.append(p)
        return params


class StepOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sampled tokens per scheduled request, in `req_ids` order; an empty list for a request
    whose prompt is not fully computed yet (a partial prefill chunk).

    Attributes:
        failed: requests that could not be served this step (e.g. non-finite logits), with
            the reason; the core finishes them with finish_reason "error".
        failed_params: for failed requests at fault themselves (a grammar that allows no
            token, masks that leave none), the request field to blame.
        logprobs / prompt_logprobs: for requests that asked, keyed by request id (prompt
            logprobs arrive once, with the request's first sampled token); with drafts, one
            entry per sampled token.
        draft_token_ids: speculative decoding: drafts proposed for the next step, per
            request that sampled (the core may shorten or drop them).
        pooled: pooling requests' outputs, by request id (they finish with them).

    With drafts, sampled_token_ids holds the accepted drafts and one token after them.
    """

    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    failed: dict[str, str] = {}
    logprobs: dict[str, TokenLogprobs] = {}
    prompt_logprobs: dict[str, TokenLogprobs] = {}
    failed_params: dict[str, str] = {}
    draft_token_ids: dict[str, list[int]] = {}
    pooled: dict[str, PooledOutput] = {}
