"""Draft-model proposals (vLLM's "draft_model"): a small model with the target's vocabulary,
run by the same worker (rank 0 under tensor parallelism, unsharded), drafts its argmax k times
per request after each step, as vLLM's model proposers do (point-mass drafts, so the
verification in `verify.py` is exact).

The draft has its own paged KV cache, indexed by the target's block table: the same block ids
in tensors of its own. The scheduler reserves k slots ahead of each request's scheduled
tokens (`num_lookahead_tokens`), where the draft writes the KV of its own drafts. For every
request the draft tracks how many positions of its KV are valid: a new (or preempted and
resumed) request is computed from position 0 (blocks shared through the prefix cache may
hold no draft KV), and after a verification the positions of the accepted drafts stay valid,
those of rejected ones are computed again.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vllm_actors.config import EngineConfig
from vllm_actors.errors import ValidationError
from vllm_actors.kernels.ops import AttentionMetadata
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.kv_layout import kv_cache_groups, num_slots
from vllm_actors.models.registry import load_model
from vllm_actors.protocol.step import StepOutput
from vllm_actors.workers.input_batch import InputBatch

logger = logging.getLogger(__name__)


class DraftModelProposer:
    """Args:
        config: the engine configuration (`speculative.model` names the draft).
        backend: the target's backend (the draft runs on it too).
        target_args: the target model's arguments (vocabulary and layout checks).
    """

    def __init__(self, config: EngineConfig, backend: Any, target_args: Any) -> None:
        spec = config.speculative
        assert spec is not None and spec.model is not None
        self.k = spec.num_speculative_tokens
        self.limit = spec.disable_by_batch_size
        self.backend = backend
        self.block_size = config.cache.block_size
        self.model = load_model(resolve_model(spec.model), backend, None,
                                config.model.max_model_len or 0,
                                gguf_activations=config.model.gguf_activations)
        args = self.model.args
        if args.vocab_size != target_args.vocab_size:
            raise ValidationError(f"the draft model's vocabulary ({args.vocab_size} tokens) "
                                  f"differs from the target's ({target_args.vocab_size})",
                                  "speculative_config")
        if len(kv_cache_groups(args)) > 1 or len(kv_cache_groups(target_args)) > 1:
            raise ValidationError("draft_model needs a target and a draft with one attention "
                                  "type (no sliding-window layers)", "speculative_config")
        self.kv_caches: list = []
        self.proposed: dict[str, tuple[int, list[int]]] = {}   # request -> (at, drafts)

    def kv_bytes_per_block(self) -> int:
        args = self.model.args
        return 2 * num_slots(kv_cache_groups(args)) * self.block_size * args.num_kv_heads \
            * args.head_dim * 4

    def initialize_kv_cache(self, num_blocks: int) -> None:
        args = self.model.args
        self.kv_caches = self.backend.allocate_kv_cache(args.num_layers, num_blocks + 1,
                                                        self.block_size, args.num_kv_heads,
                                                        args.head_dim)
        if getattr(self.backend, "compiles_lazily", False):
            from vllm_actors.workers.warm_up import FIRST_SIZES, STEP_SIZES, run_sizes
            run_sizes(self.model, self.kv_caches, self.block_size, FIRST_SIZES + STEP_SIZES)

    def finish(self, req_id: str) -> None:
        self.proposed.pop(req_id, None)

    def propose_for(self, batch: InputBatch, rows: np.ndarray, req_ids: list[str],
                    accepted: list[list[int]], out: StepOutput) -> None:
        if self.limit is not None and len(batch) > self.limit:
            return
        # requests that end too close to max_model_len for k drafts get none
        keep = [i for i, (kept, row) in enumerate(zip(accepted, rows.tolist()))
                if kept and batch.num_tokens[row] + self.k <= batch.max_model_len]
        if not keep:
            return
        rows = rows[keep]
        req_ids = [req_ids[i] for i in keep]
        ends = batch.num_tokens[rows].astype(np.int64)
        starts = np.array([self._valid(batch, row, r) for row, r in zip(rows.tolist(), req_ids)],
                          np.int64)
        tables = batch.block_table[0]
        drafts = np.empty((len(rows), self.k), np.int64)
        drafts[:, 0] = self._run(tables, rows, starts, ends - starts,
                                 lambda t_rows, pos: batch.token_ids[t_rows, pos])
        ones = np.ones(len(rows), np.int64)
        for j in range(1, self.k):   # feed draft j-1 at position end + j - 1
            drafts[:, j] = self._run(tables, rows, ends + j - 1, ones,
                                     lambda t_rows, pos, j=j: drafts[:, j - 1])
        for i, req_id in enumerate(req_ids):
            self.proposed[req_id] = (int(ends[i]), drafts[i].tolist())
            out.draft_token_ids[req_id] = drafts[i].tolist()

    def _valid(self, batch: InputBatch, row: int, req_id: str) -> int:
        """Positions of the request's draft KV still valid: up to its first draft that the
        verification did not keep (0 for a request not seen before)."""
        if req_id not in self.proposed:
            return 0
        at, drafts = self.proposed[req_id]
        num_tokens = int(batch.num_tokens[row])
        same = 0
        while same < len(drafts) - 1 and at + same < num_tokens - 1 and \
                batch.token_ids[row, at + same] == drafts[same]:
            same += 1
        return min(at + same, num_tokens - 1)   # drafts fed: the first k - 1

    def _run(self, tables: np.ndarray, rows: np.ndarray, starts: np.ndarray,
             counts: np.ndarray, tokens_at: Any) -> np.ndarray:
        """One draft forward over `counts` tokens per request from position `starts`;
        the argmax after each request's last token."""
        bs = self.block_size
        query_start_loc = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        token_rows = np.repeat(rows, counts)
        offsets = np.arange(len(token_rows)) - np.repeat(query_start_loc[:-1], counts)
        positions = np.repeat(starts, counts) + offsets
        token_ids = np.asarray(tokens_at(token_rows, positions), np.int64)
        seq_lens = (starts + counts).astype(np.int32)
        num_blocks = -(-int(seq_lens.max()) // bs)
        slots = tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        meta = AttentionMetadata(query_start_loc, seq_lens, tables[rows, :num_blocks], slots, bs)
        hidden = self.model.forward(token_ids, positions, meta, self.kv_caches)
        logits = self.model.compute_logits(hidden, query_start_loc[1:] - 1)
        return np.asarray(logits).argmax(axis=1)
