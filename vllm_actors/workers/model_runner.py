"""ModelRunner: holds the model, the paged KV cache and per-request state; runs one StepInput.

It applies the step's diffs (new requests, new blocks, finished ids), lays the scheduled
tokens out flat with their positions and KV slots, runs the model, and samples one token for
each request whose scheduled tokens reach the end of what it knows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from vllm_actors.config import EngineConfig
from vllm_actors.errors import ValidationError
from vllm_actors.kernels import get_backend
from vllm_actors.kernels.ops import AttentionMetadata
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.registry import load_model
from vllm_actors.protocol.engine import EngineReady
from vllm_actors.protocol.step import StepInput, StepOutput
from vllm_actors.sampling_params import SamplingParams
from vllm_actors.workers.kv_cache import num_kv_blocks
from vllm_actors.workers.sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    generator: np.random.Generator | None


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.backend = get_backend(config.device.backend)
        self.model = load_model(resolve_model(config.model.model), self.backend)
        args = self.model.args
        limit = args.max_position_embeddings
        self.max_model_len = config.model.max_model_len or limit
        if self.max_model_len > limit:
            raise ValidationError(f"max_model_len={self.max_model_len} is larger than the "
                                  f"model's context length ({limit})", "max_model_len")
        self.block_size = config.cache.block_size
        self.num_blocks = num_kv_blocks(config.cache, self.max_model_len)
        self.kv_caches = self.backend.allocate_kv_cache(
            args.num_layers, self.num_blocks + 1, self.block_size, args.num_kv_heads,
            args.head_dim)
        logger.info("KV cache: %d blocks of %d tokens", self.num_blocks, self.block_size)
        self.sampler = Sampler(config.model.seed)
        self.requests: dict[str, _RequestState] = {}

    @property
    def ready(self) -> EngineReady:
        return EngineReady(self.num_blocks, self.block_size, self.max_model_len,
                           self.model.args.vocab_size)

    def _apply_diffs(self, step: StepInput) -> None:
        for req_id in step.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in step.new_requests:
            generator = None if new.sampling_params.seed is None else \
                np.random.default_rng(new.sampling_params.seed)
            self.requests[new.req_id] = _RequestState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                new.sampling_params, generator)
        cached = step.cached_requests
        for req_id, blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                            cached.num_computed_tokens):
            state = self.requests[req_id]
            state.block_ids.extend(blocks)
            state.num_computed_tokens = computed

    def _prepare(self, step: StepInput) -> tuple[np.ndarray, np.ndarray, AttentionMetadata]:
        states = [self.requests[r] for r in step.num_scheduled_tokens]
        counts = np.fromiter(step.num_scheduled_tokens.values(), np.int32, len(states))
        starts = np.array([s.num_computed_tokens for s in states], np.int32)
        query_start_loc = np.zeros(len(states) + 1, np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        seq_lens = starts + counts
        max_blocks = max(len(s.block_ids) for s in states)
        block_tables = np.zeros((len(states), max_blocks), np.int32)
        for row, s in enumerate(states):
            block_tables[row, :len(s.block_ids)] = s.block_ids
        rows = np.repeat(np.arange(len(states)), counts)
        positions = starts[rows] + (np.arange(len(rows)) - query_start_loc[rows])
        token_ids = np.concatenate([np.asarray(s.token_ids[a:a + n], np.int64)
                                    for s, a, n in zip(states, starts, counts)])
        slots = (block_tables[rows, positions // self.block_size].astype(np.int64)
                 * self.block_size + positions % self.block_size)
        meta = AttentionMetadata(query_start_loc, seq_lens, block_tables, slots,
                                 int(counts.max()), int(seq_lens.max()))
        return token_ids, positions, meta

    def execute(self, step: StepInput) -> StepOutput:
        self._apply_diffs(step)
        if not step.num_scheduled_tokens:
            return StepOutput()
        token_ids, positions, meta = self._prepare(step)
        hidden = self.model.forward(token_ids, positions, meta, self.kv_caches)
        req_ids = list(step.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        complete = [i for i, s in enumerate(states) if meta.seq_lens[i] >= len(s.token_ids)]
        sampled: list[list[int]] = [[] for _ in req_ids]
        if complete:
            last_rows = meta.query_start_loc[1:][complete] - 1
            logits = self.model.compute_logits(hidden[last_rows])
            tokens = self.sampler.sample(logits, [states[i].params for i in complete],
                                         [states[i].generator for i in complete])
            for i, token in zip(complete, tokens):
                states[i].token_ids.append(token)
                sampled[i] = [token]
        for s, n in zip(states, step.num_scheduled_tokens.values()):
            s.num_computed_tokens += n
        return StepOutput(req_ids, sampled)
