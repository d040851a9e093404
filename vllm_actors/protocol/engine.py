"""Frontend <-> engine core messages: requests in, per-step outputs out, the ready handshake.

Each direction is a msgspec tagged union (`FrontendMessage`, `CoreMessage`); receivers decode
one frame and dispatch with `match` on the Struct type.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from vllm_actors.lora_request import LoRARequest
from vllm_actors.pooling_params import PoolingParams
from vllm_actors.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request ended; `str()` gives the OpenAI spelling."""

    STOP = 0     # EOS, a stop token id, or a stop string
    LENGTH = 1   # max_tokens or the model's context length
    ABORT = 2    # the client went away or asked to stop
    ERROR = 3    # this request failed inside the engine; others continue

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=1):
    """A tokenized request, ready for the scheduler.

    Attributes:
        eos_token_ids: ids that end generation unless `sampling_params.ignore_eos`.
        arrival_time: seconds since the epoch when the frontend accepted it.
        priority: smaller runs first under `--scheduling-policy priority`.
        cache_salt: mixed into the first block's hash, so prefix-cache hits happen only
            between requests that carry the same salt.
        n: completions this one message stands for. The core runs them as n requests,
            ids `child_request_ids` (vLLM's `f"{i}_{request_id}"` when n > 1), that share
            this message's SamplingParams and prompt; completion i is seeded with
            `sampling_params.child_seed(i)`. Each child is then a request of its own
            (outputs, aborts, preemption, stop rules, metrics). The params' own `n` is not
            read by the core.
        grammar: the llguidance grammar the frontend built from
            `sampling_params.structured_outputs` and checked; the core compiles it as it is
            (None: the core builds it), so a large grammar is converted once, off the core.
        lora_request: the LoRA adapter this request runs with (None: the base model); the
            frontend has loaded it on every worker (`add_lora`) before sending the request.
        pooling_params: set for a pooling request (a pooling model's): its prompt is
            computed in one step, without the prefix cache, and it finishes with its pooled
            output (`EngineCoreOutput.pooled`) instead of sampling.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    n: int = 1
    grammar: str | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None

    @property
    def child_request_ids(self) -> list[str]:
        return child_request_ids(self.request_id, self.n)


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The engine request id of completion `index` of a request's n: the request's own id
    when n == 1, else `f"{index}_{request_id}"`."""
    return request_id if n == 1 else f"{index}_{request_id}"


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [child_request_id(request_id, i, n) for i in range(n)]


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities for consecutive token positions (parallel lists, one per position).

    Attributes:
        token_ids: the position's actual token first, then the top-k alternatives.
        logprobs: their log-probabilities under the raw model distribution.
        ranks: 1-based rank of the actual token.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class PooledOutput(msgspec.Struct, array_like=True, gc=False):
    """A pooling request's output: float32 values, C order, of `shape` ([D] for an
    embedding or label scores, [n, D] for per-token vectors)."""

    shape: list[int]
    data: bytes


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request produced in one step.

    Attributes:
        new_token_ids: tokens sampled this step (empty for a partial prefill).
        stop_reason: the stop token id that ended the request, if any.
        num_cached_tokens: prompt tokens served from the prefix cache.
        error: what went wrong, when finish_reason is ERROR.
        scheduled_time: epoch seconds of the request's first scheduling, on its first output.
        logprobs: for new_token_ids, when the request asked for logprobs.
        prompt_logprobs: for prompt positions 1.., with the first output, when asked for.
        error_param: with `error`, the request field at fault when the failure is the
            request's own (an invalid value, a grammar the engine cannot follow: HTTP 400);
            None when the engine failed (HTTP 500).
        pooled: a pooling request's output (it finishes with it).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    scheduled_time: float | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    error_param: str | None = None
    pooled: PooledOutput | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Drafts verified in one step (vLLM's spec-decode counters).

    Attributes:
        num_drafts: requests whose drafts were verified.
        num_draft_tokens / num_accepted_tokens: drafted / accepted tokens over them.
        num_accepted_tokens_per_pos: accepted drafts by position (index 0: first draft).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_accepted - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The scheduler's state after a step.

    Attributes:
        kv_cache_usage: fraction of KV blocks in use (0..1), the null block excluded.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found in the
            prefix cache by this step's admissions.
        num_preemptions: requests preempted (KV freed, to be recomputed) in this step.
        spec_decoding: this step's verified drafts (speculative decoding only).
        running_lora_adapters / waiting_lora_adapters: names of the LoRA adapters of the
            running and waiting requests (`vllm:lora_requests_info`).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_decoding: SpecDecodingStats | None = None
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=11):
    """All outputs of one engine step, with the scheduler's stats when a step ran."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None


class EngineReady(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=10):
    """Facts the core discovered at startup, sent once before any output.

    Attributes:
        num_kv_blocks: KV cache blocks allocated (excluding the null block).
        max_model_len: longest prompt + output the engine accepts.
        vocab_size: rows of the LM head (token ids must be below it).
        kv_group_windows: the sliding window of each KV cache group (0: full attention);
            block lists travel per group in this order.
        runner: "generate", or "pooling" for a pooling model (its requests carry
            PoolingParams and never sample).
        pooling_tasks: the pooling tasks the model serves (embed, encode, and classify /
            score with a classifier head).
        hidden_size: the width of its embeddings.
        labels: its classifier's labels, in order.
        matryoshka: whether embeddings may be cut to fewer dimensions.
    """

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    kv_group_windows: list[int] = msgspec.field(default_factory=lambda: [0])
    runner: str = "generate"
    pooling_tasks: list[str] = []
    hidden_size: int = 0
    labels: list[str] = []
    matryoshka: bool = False


class AbortRequests(msgspec.Struct, array_like=True, gc=False, tag=2):
    """Stop these requests; unknown or finished ids are ignored (aborts race completion)."""

    request_ids: list[str]


class UtilityKind(enum.IntEnum):
    RESET_PREFIX_CACHE = 0   # -> bool: False while requests hold KV blocks
    GET_STATS = 1            # -> SchedulerStats of the current state
    PING = 2                 # -> "pong"; a round trip through the core's input and output
    COLLECTIVE_RPC = 3       # args [method, *method_args] -> every rank's result (`results`)


class UtilityCall(msgspec.Struct, array_like=True, gc=False, tag=3):
    """A request for one of the core's utilities; answered by a UtilityResult."""

    call_id: int
    kind: UtilityKind
    args: list[Any] = []


class Shutdown(msgspec.Struct, array_like=True, gc=False, tag=4):
    """Stop the engine core process cleanly."""


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=12):
    """The answer to UtilityCall `call_id`: a value, or the error it raised."""

    call_id: int
    value: SchedulerStats | bool | str | None = None
    error: str | None = None
    results: list[Any] | None = None    # COLLECTIVE_RPC: one per rank


class EngineDead(msgspec.Struct, array_like=True, gc=False, tag=13):
    """Sent once before the core exits on a fatal error; every pending request fails."""

    reason: str


class EngineStartupError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=14):
    """Startup failed (model load, KV sizing, ...): the error's class name and message, so
    the frontend raises the same typed error."""

    error_type: str
    message: str
    param: str | None = None


FrontendMessage = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown
CoreMessage = EngineCoreOutputs | UtilityResult | EngineDead | EngineReady | EngineStartupError
