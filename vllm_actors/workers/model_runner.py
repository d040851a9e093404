"""ModelRunner: the model, its paged KV cache and the persistent InputBatch; runs a StepInput.

Per step: apply the diffs (finished ids, new requests, new blocks), lay the scheduled tokens
out flat with vectorized numpy (positions, token ids, KV slots, block tables), run the model,
and sample only for requests whose scheduled tokens reach their last known token; logprobs
and prompt logprobs for the requests that asked.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np

from vllm_actors.config import EngineConfig, resolve_kv_dtype
from vllm_actors.errors import ValidationError
from vllm_actors.kernels import get_backend
from vllm_actors.kernels.kv_quant import kv_format
from vllm_actors.kernels.ops import AttentionMetadata, Backend
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.base import CausalLM, ParallelGroup, PipelineStage, SingleRank
from vllm_actors.models.kv_layout import kv_cache_groups, layer_slots
from vllm_actors.models.registry import load_model
from vllm_actors.protocol.engine import EngineReady, TokenLogprobs
from vllm_actors.protocol.step import StepInput, StepOutput
from vllm_actors.workers.input_batch import InputBatch
from vllm_actors.workers.kv_cache import kv_bytes_per_block, num_kv_blocks
from vllm_actors.workers.lora_manager import LoRAManager
from vllm_actors.workers.pooling import (Pooling, make_pooling, resolve_runner,
                                         sentence_max_length)
from vllm_actors.workers.sampler import (SampledLogprobs, Sampler, apply_token_bitmask,
                                        log_softmax, top_logprobs)
from vllm_actors.workers.spec_decode.proposers import make_proposer
from vllm_actors.workers.spec_decode.verify import (SampleLayout, accepted_tokens,
                                                    sample_layout)
from vllm_actors.workers.warm_up import warm_up

logger = logging.getLogger(__name__)


def _token_logprobs(ids: np.ndarray, lps: np.ndarray, ranks: np.ndarray) -> TokenLogprobs:
    return TokenLogprobs(ids.tolist(), lps.astype(float).tolist(), ranks.tolist())


class ModelRunner:
    """Args:
        config: the engine configuration.
        model: an already built model on `config`'s backend (tests, benchmarks); by default
            the model named by `config.model.model` is loaded.
        backend: the backend to use (a worker builds it first for its tensor-parallel
            group); by default the one `config.device` names.
        tp: this rank's tensor-parallel group. Every rank runs every step on the same
            inputs; only rank 0 samples, and it broadcasts the sampled ids so that every
            rank's persistent batch stays the same.
        allocate_kv: False leaves the KV cache to `initialize_kv_cache` (a worker allocates
            the block count agreed by all ranks).
        stage / channel: with pipeline parallelism, this rank's stage (its layers, their KV)
            and the channel its hidden states arrive on and leave by. A stage before the last
            returns an empty StepOutput; every stage appends the sampled tokens the core
            sends (`CachedRequestData.new_token_ids`) instead of its own.
    """

    def __init__(self, config: EngineConfig, model: CausalLM | None = None,
                 backend: Backend | None = None, tp: ParallelGroup | None = None,
                 allocate_kv: bool = True, stage: PipelineStage | None = None,
                 channel: Any = None) -> None:
        device = config.device
        self.backend = backend or get_backend(device.backend, device.opencl_platform,
                                              device.opencl_device)
        self.tp = tp or SingleRank()
        self.stage, self.channel = stage or PipelineStage(), channel
        self._model_source = None if model is not None else resolve_model(config.model.model)
        self.model = model or load_model(self._model_source, self.backend, self.tp,
                                         config.model.max_model_len or 0, self.stage,
                                         config.model.gguf_activations)
        quantized = getattr(self.model, "gguf_activations", "float32") == "quantized"
        cache = replace(config.cache, kv_cache_dtype=resolve_kv_dtype(
            config.cache.kv_cache_dtype, quantized))
        args = self.model.args
        self.local_args = getattr(self.model, "local_args", args)
        model_dir = self._model_source.path if self._model_source is not None else None
        self.runner = resolve_runner(config.model.runner, self.model, model_dir)
        self.pooling: Pooling | None = (make_pooling(self.model, model_dir,
                                                     config.model.pooler_config)
                                        if self.runner == "pooling" else None)
        # an encoder attends within each request's own step: no KV cache at all
        self.encoder_only = getattr(self.model, "encoder_only", False)
        limit = args.max_position_embeddings
        if config.model.max_model_len is None and self.pooling is not None:
            limit = min(limit, sentence_max_length(model_dir) or limit)
        self.max_model_len = config.model.max_model_len or limit
        if self.max_model_len > args.max_position_embeddings:
            raise ValidationError(f"max_model_len={self.max_model_len} is larger than the "
                                  f"model's context length ({args.max_position_embeddings})",
                                  "max_model_len")
        self.block_size = config.cache.block_size
        self.kv_format = kv_format(cache.kv_cache_dtype, ggml_products=quantized)
        # llama.cpp's tokens: rows past a prompt (drafts' verification, a preempted request's
        # recomputed tokens) run as one-row requests
        self._one_row_decode = quantized
        self.kv_groups = kv_cache_groups(self.local_args)
        self.layer_ids = list(getattr(self.model, "layer_ids", range(args.num_layers)))
        slot_of = layer_slots(self.kv_groups)[1]
        self.kv_slots = sorted({slot_of[i] for i in self.layer_ids})   # this stage's slots
        # drafts for speculative decoding come from rank 0
        self.proposer = make_proposer(config, self.backend, args) \
            if config.speculative is not None and self.tp.rank == 0 else None
        self.num_blocks = self._count_blocks(config, cache)
        self.kv_caches: list = []
        if allocate_kv:
            self.initialize_kv_cache(self.num_blocks)
        self.batch = InputBatch(config.scheduler.max_num_seqs, self.max_model_len,
                                self.block_size, len(self.kv_groups))
        self.sampler = Sampler(config.model.seed)
        # backends with an argmax (the devices', the cpu's) take the ids of plain-greedy
        # steps themselves (see _sample); under tensor parallelism the logits are gathered on
        # the host of rank 0. Host logits keep the family's scale and soft-cap.
        self.device_greedy = hasattr(self.backend, "argmax") and self.tp.world_size == 1
        self.raw_greedy_logits = not getattr(self.backend, "host_logits", False)
        self.follow_tokens = self.stage.size > 1   # sampled ids come in the StepInput
        self.lora = LoRAManager(config.lora, self.model) if config.lora else None
        self._lora_failed: dict[str, str] = {}     # adapters that failed to load, this step

    def _count_blocks(self, config: EngineConfig, cache: Any) -> int:
        """The KV blocks this rank can hold (`num_kv_blocks`), the draft's share taken out;
        an encoder's only count tokens for the scheduler (it keeps no KV)."""
        if self.encoder_only:
            budget = max(config.scheduler.max_num_batched_tokens, self.max_model_len)
            return (budget + config.scheduler.max_num_seqs * self.block_size) // self.block_size
        blocks = num_kv_blocks(cache, self.local_args, self.max_model_len,
                               self.backend.free_memory(),
                               config.scheduler.max_num_batched_tokens, len(self.kv_slots))
        draft_bytes = self.proposer.kv_bytes_per_block() if self.proposer else 0
        if draft_bytes and config.cache.num_gpu_blocks_override is None:
            # the draft's cache shares the KV budget, block for block
            target_bytes = kv_bytes_per_block(self.local_args, self.block_size, self.kv_groups,
                                              len(self.kv_slots), cache.kv_cache_dtype)
            blocks = blocks * target_bytes // (target_bytes + draft_bytes)
        return blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` usable blocks (plus the null block) of this rank's KV heads:
        one tensor per slot of the KV cache groups, each layer handed its group's slot."""
        local = self.local_args
        self.num_blocks = num_blocks
        if self.encoder_only:
            self.kv_caches = [None] * len(self.layer_ids)
            if getattr(self.backend, "compiles_lazily", False):
                self._warm_up_encoder()
            return
        slots = self.backend.allocate_kv_cache(
            len(self.kv_slots), num_blocks + 1, self.block_size, local.num_kv_heads,
            local.head_dim, self.kv_format)
        index = {slot: i for i, slot in enumerate(self.kv_slots)}
        slot_of = layer_slots(self.kv_groups)[1]
        self.kv_caches = [slots[index[slot_of[layer]]] for layer in self.layer_ids]
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks)
        if getattr(self.backend, "compiles_lazily", False):
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile-on-first-use backends (cpu) get every kernel before the engine reports
        ready (`warm_up`); a model this runner loaded itself may be loaded again by the
        cold-start compile helper."""
        own = self._model_source if self.tp.world_size == self.stage.size == 1 else None
        warm_up(self.model, self.kv_caches, self.block_size, self.max_model_len,
                self.backend, own.path if own is not None else None,
                getattr(self.model, "gguf_activations", "float32"))

    def _warm_up_encoder(self) -> None:
        """Compile an encoder's kernels: one forward pass of requests of 3 and twice 40
        tokens (83 rows, so the float32 linears' BLAS path for many rows compiles too)."""
        counts = np.array([3] + [min(40, self.max_model_len)] * 2, np.int32)
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        total = int(bounds[-1])
        meta = AttentionMetadata(bounds, counts, np.zeros((len(counts), 1), np.int32),
                                 np.zeros(total, np.int64), self.block_size)
        positions = np.concatenate([np.arange(n) for n in counts])
        self.model.forward(np.zeros(total, np.int64), positions, meta, self.kv_caches)

    @property
    def ready(self) -> EngineReady:
        ready = EngineReady(self.num_blocks, self.block_size, self.max_model_len,
                            self.model.args.vocab_size, [g.window for g in self.kv_groups],
                            runner=self.runner)
        if self.pooling is not None:
            ready.pooling_tasks = list(self.pooling.tasks)
            ready.hidden_size = self.model.args.hidden_size
            ready.labels = list(getattr(self.model.args, "id2label", ()))
            ready.matryoshka = bool(getattr(self.model.args, "is_matryoshka", False))
        return ready

    def _apply_diffs(self, step: StepInput) -> None:
        batch = self.batch
        for req_id in step.finished_req_ids:
            row = batch.req_id_to_row.get(req_id)
            if self.lora is not None and row is not None and batch.lora_ids[row]:
                self.lora.release(int(batch.lora_ids[row]))
            batch.remove_request(req_id)
            if self.pooling is not None:
                self.pooling.params.pop(req_id, None)
            if self.proposer is not None:
                self.proposer.finish(req_id)
        for new, params in zip(step.new_requests, step.new_request_params()):
            row = batch.add_request(new, params)
            if self.pooling is not None and new.pooling_params is not None:
                self.pooling.params[new.req_id] = new.pooling_params
            if new.lora_request is not None:
                self._acquire_lora(new, row)
        cached = step.cached_requests
        for req_id, blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                            cached.num_computed_tokens):
            row = batch.req_id_to_row[req_id]
            batch.append_blocks(row, blocks)
            batch.num_computed_tokens[row] = computed
        for req_id, tokens in zip(cached.req_ids, cached.new_token_ids):
            row = np.array([batch.req_id_to_row[req_id]])
            for token in tokens:                  # one at a time: append_tokens is per row
                batch.append_tokens(row, np.array([token], np.int64))
        for req_id, drafts in step.spec_token_ids.items():   # after the known tokens
            row = batch.req_id_to_row[req_id]
            batch.token_ids[row, batch.num_tokens[row]:batch.num_tokens[row] + len(drafts)] = \
                drafts

    def _acquire_lora(self, new: Any, row: int) -> None:
        """Hold a new request's adapter for as long as it runs; one that cannot be loaded
        (dropped, then its files went away) fails that request alone."""
        try:
            if self.lora is None:
                raise ValidationError("this engine serves no LoRA adapters (--enable-lora)",
                                      "lora_request")
            self.lora.acquire(new.lora_request)
        except ValidationError as e:
            self.batch.lora_ids[row] = 0
            self._lora_failed[new.req_id] = str(e)

    def _prepare(self, rows: np.ndarray, counts: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[AttentionMetadata]]:
        """Flat step layout: token ids, positions, the row of each token, and the attention
        layout of each KV cache group."""
        batch, bs = self.batch, self.block_size
        query_start_loc = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        token_rows = np.repeat(rows, counts)                       # [T] row of each token
        offsets = np.arange(len(token_rows)) - np.repeat(query_start_loc[:-1], counts)
        starts = batch.num_computed_tokens[rows]
        positions = np.repeat(starts, counts) + offsets
        token_ids = batch.token_ids[token_rows, positions]
        seq_lens = starts + counts
        num_blocks = -(-int(seq_lens.max()) // bs)
        metas = []
        for group, table in zip(self.kv_groups, batch.block_table):
            slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
            tables = table[rows, :num_blocks]
            if group.window:
                # blocks behind the window went back to the pool (and maybe to another
                # request): point them at the null block, which the window mask hides
                first = np.maximum(starts - group.window + 1, 0) // bs
                tables[np.arange(num_blocks)[None, :] < first[:, None]] = 0
            metas.append(AttentionMetadata(query_start_loc, seq_lens, tables, slots, bs,
                                           batch.num_prompt_tokens[rows]))
        return token_ids, positions, token_rows, metas

    def _one_row_decodes(self, metas: list[AttentionMetadata], rows: np.ndarray,
                         counts: np.ndarray) -> list[AttentionMetadata]:
        """Under the quantized semantics, the forward pass's layout with each row past a
        request's prompt as a request of its own: llama.cpp decoding alone computes those
        tokens one at a time, so their attention and matmuls take its one-row float orders.
        Such rows come several to a request when drafts are verified, and when a preempted
        request recomputes the tokens it had generated (its prompt's rows stay one request,
        in its prompt's orders). Sampling keeps `metas`."""
        if not self._one_row_decode:
            return metas
        starts = self.batch.num_computed_tokens[rows]
        pre = np.clip(self.batch.num_prompt_tokens[rows] - starts, 0, counts)  # prompt rows
        post = counts - pre
        split = (post > 1) | ((pre > 0) & (post > 0))
        if not split.any():
            return metas
        lead = (pre > 0).astype(np.int64)
        pieces = np.where(split, lead + post, 1)
        idx = np.repeat(np.arange(len(rows)), pieces)           # original request of each
        nth = np.arange(len(idx)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        prompt_piece = (nth < lead[idx]) | ~split[idx]
        new_counts = np.where(prompt_piece, np.where(split[idx], pre[idx], counts[idx]), 1)
        query_start_loc = np.zeros(len(idx) + 1, np.int32)
        np.cumsum(new_counts, out=query_start_loc[1:])
        ends = pre[idx] + nth - lead[idx] + 1                   # a decoded row's seq_len
        seq_lens = (starts[idx] + np.where(prompt_piece, new_counts, ends)).astype(np.int32)
        return [AttentionMetadata(query_start_loc, seq_lens, m.block_tables[idx],
                                  m.slot_mapping, m.block_size,
                                  None if m.prompt_lens is None else m.prompt_lens[idx])
                for m in metas]

    def _collect_prompt_logprobs(self, hidden: object, positions: np.ndarray,
                                 token_rows: np.ndarray) -> None:
        """Logprobs of the next prompt token at every prompt position computed this step,
        for rows that asked; kept until the request's first sampled token."""
        batch = self.batch
        k = batch.sampling.num_prompt_logprobs[token_rows]
        sel = np.flatnonzero((k >= 0) & (positions + 1 < batch.num_prompt_tokens[token_rows]))
        if not len(sel):
            return
        logits = self.model.compute_logits(hidden, sel)
        if logits is None:      # a tensor-parallel rank other than 0
            return
        lp = log_softmax(logits)
        nxt = batch.token_ids[token_rows[sel], positions[sel] + 1]
        ids, lps, ranks = top_logprobs(lp, nxt, int(k[sel].max()))
        for row in np.unique(token_rows[sel]).tolist():
            mine = token_rows[sel] == row
            batch.prompt_logprobs.setdefault(row, []).append(
                _token_logprobs(ids[mine], lps[mine], ranks[mine]))

    def _sample(self, hidden: object, meta: AttentionMetadata, rows: np.ndarray,
                req_ids: list[str], step: StepInput, out: StepOutput) -> None:
        """Sample for the requests whose scheduled tokens reach their last known token, at
        that token and at each of their drafts (`spec_decode/verify.py`)."""
        batch = self.batch
        done = np.flatnonzero(batch.num_computed_tokens[rows] >= batch.num_tokens[rows])
        if not len(done):
            return
        drafts = [step.spec_token_ids.get(req_ids[i], []) for i in done.tolist()] \
            if step.spec_token_ids else [[] for _ in range(len(done))]
        layout = sample_layout(meta.query_start_loc[1:][done],
                               np.fromiter(map(len, drafts), np.int64, len(done)))
        entry_rows = rows[done][layout.owner]
        if self.tp.rank != 0:
            self._follow_sampling(hidden, layout, entry_rows, drafts)
            return
        tokens, lp = self._sample_entries(hidden, layout, entry_rows, done, req_ids, step, out)
        if self.tp.world_size > 1 and not self.follow_tokens:
            self.tp.broadcast_ids(tokens, len(tokens))
        accepted = accepted_tokens(tokens, layout, drafts)
        self._append_accepted(rows[done], accepted, drafts)
        for i, kept in zip(done.tolist(), accepted):
            if kept:
                out.sampled_token_ids[i] = kept
        if lp is not None:
            self._add_logprobs(lp, layout, done, accepted, req_ids, out)
        for i, row in zip(done.tolist(), rows[done].tolist()):
            pieces = batch.prompt_logprobs.pop(row, None)
            if pieces:
                out.prompt_logprobs[req_ids[i]] = TokenLogprobs(
                    [t for p in pieces for t in p.token_ids],
                    [v for p in pieces for v in p.logprobs], [r for p in pieces for r in p.ranks])
        if self.proposer is not None:
            self.proposer.propose_for(batch, rows[done], [req_ids[i] for i in done.tolist()],
                                      accepted, out)

    def _sample_entries(self, hidden: object, layout: SampleLayout, entry_rows: np.ndarray,
                        done: np.ndarray, req_ids: list[str], step: StepInput,
                        out: StepOutput) -> tuple[np.ndarray, SampledLogprobs | None]:
        """The token at every entry (-1: it could not be sampled; the first entry's failure
        is reported), with logprobs for the entries that asked."""
        batch, n = self.batch, layout.num_entries
        tokens, lp = np.full(n, -1, np.int64), None
        if self.device_greedy and not step.grammar_req_ids and \
                batch.sampling.plain_greedy(entry_rows):
            # only the sampled ids come back from the device (-1: non-finite logits)
            tokens[:] = self.backend.argmax(self.model.compute_logits(
                hidden, layout.index, on_device=self.raw_greedy_logits))
            finite = tokens >= 0
        else:
            logits = self.model.compute_logits(hidden, layout.index)
            finite = np.isfinite(logits).all(axis=1)
            if step.grammar_req_ids:
                finite &= self._apply_grammar(logits, layout, done, req_ids, step, out)
            ok = np.flatnonzero(finite)
            if len(ok):
                sampled, lp, failed = self.sampler.sample(
                    logits[ok], entry_rows[ok], batch.sampling, batch.token_ids,
                    batch.num_prompt_tokens, batch.num_tokens, layout.offset[ok])
                tokens[ok] = sampled
                for j, (reason, param) in failed.items():
                    if layout.offset[ok[j]] == 0:
                        req_id = req_ids[done[layout.owner[ok[j]]]]
                        out.failed.setdefault(req_id, reason)
                        if param is not None:
                            out.failed_params[req_id] = param
                if lp is not None:
                    lp.rows = ok[lp.rows]
        for e in np.flatnonzero(~finite & (layout.offset == 0)).tolist():
            out.failed.setdefault(req_ids[done[layout.owner[e]]],
                                  "the model produced non-finite logits for this request")
        return tokens, lp

    def _append_accepted(self, done_rows: np.ndarray, accepted: list[list[int]],
                         drafts: list[list[int]]) -> None:
        """Every rank's batch takes the accepted tokens; rejected drafts are not computed."""
        if self.follow_tokens:
            return
        batch = self.batch
        for row, kept, draft in zip(done_rows.tolist(), accepted, drafts):
            if kept:
                n = batch.num_tokens[row]
                batch.token_ids[row, n:n + len(kept)] = kept
                batch.num_tokens[row] = n + len(kept)
            batch.num_computed_tokens[row] -= len(draft) + 1 - max(len(kept), 1)

    def _add_logprobs(self, lp: SampledLogprobs, layout: SampleLayout, done: np.ndarray,
                      accepted: list[list[int]], req_ids: list[str], out: StepOutput) -> None:
        """Each request's logprobs at its accepted positions (the entries are in order)."""
        entries = {e: j for j, e in enumerate(lp.rows.tolist())}
        starts = layout.starts.tolist()
        for i, kept in enumerate(accepted):
            picked = [entries[e] for e in range(starts[i], starts[i] + len(kept))
                      if e in entries]
            if kept and len(picked) == len(kept):
                out.logprobs[req_ids[done[i]]] = _token_logprobs(
                    lp.token_ids[picked], lp.logprobs[picked], lp.ranks[picked])

    def _apply_grammar(self, logits: np.ndarray, layout: SampleLayout, done: np.ndarray,
                       req_ids: list[str], step: StepInput, out: StepOutput) -> np.ndarray:
        """Mask the structured-output entries of logits [E, V] with the step's bitmask (rows
        in grammar_req_ids order, one per entry). Returns a boolean [E]: False for entries
        whose grammar allows no token (a first entry's request is reported failed)."""
        position = {req_ids[i]: j for j, i in enumerate(done.tolist())}
        owners = [position[r] for r in step.grammar_req_ids]
        assert len(owners) == len(step.grammar_req_ids), "grammar rows must sample this step"
        starts = layout.starts
        masked = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in owners])
        bitmask = np.frombuffer(step.grammar_bitmask, np.int32).reshape(len(masked), -1)
        ok = np.ones(layout.num_entries, bool)
        for j in apply_token_bitmask(logits, masked, bitmask).tolist():
            ok[masked[j]] = False
            if layout.offset[masked[j]] == 0:
                req_id = req_ids[done[layout.owner[masked[j]]]]
                out.failed[req_id] = "the request's grammar allows no next token"
                out.failed_params[req_id] = "structured_outputs"
        return ok

    def _follow_sampling(self, hidden: object, layout: SampleLayout, entry_rows: np.ndarray,
                         drafts: list[list[int]]) -> None:
        """A rank other than 0: its share of the logits, then rank 0's sampled ids (which a
        pipeline stage gets from the next StepInput instead)."""
        self.model.compute_logits(hidden, layout.index)
        if self.follow_tokens:
            return
        tokens = self.tp.broadcast_ids(None, layout.num_entries)
        done_rows = entry_rows[layout.starts[:-1]]
        self._append_accepted(done_rows, accepted_tokens(tokens, layout, drafts), drafts)

    def _token_types(self, req_ids: list[str], positions: np.ndarray,
                     counts: np.ndarray) -> np.ndarray | None:
        """Token type ids [T]: 1 from a text pair's second text on (cross-encoders)."""
        starts = [self.pooling.params[r].token_type_start if self.pooling is not None
                  and r in self.pooling.params else None for r in req_ids]
        if all(s is None for s in starts):
            return None
        first = np.array([len(positions) + 1 if s is None else s for s in starts], np.int64)
        return (positions >= np.repeat(first, counts)).astype(np.int64)

    def _pool(self, hidden: Any, rows: np.ndarray, req_ids: list[str],
              meta: AttentionMetadata) -> StepOutput:
        """The pooled outputs of the requests whose prompt this step completed."""
        assert self.pooling is not None
        batch = self.batch
        done = np.flatnonzero(batch.num_computed_tokens[rows] >= batch.num_tokens[rows])
        out = StepOutput(req_ids, [[] for _ in req_ids])
        if len(done):
            out.pooled = self.pooling.pool(self.model, self.backend.to_host(hidden), req_ids,
                                           meta.query_start_loc, done)
        return out

    def execute(self, step: StepInput) -> StepOutput:
        self._apply_diffs(step)
        if not step.num_scheduled_tokens:
            return StepOutput()
        req_ids = list(step.num_scheduled_tokens)
        rows = self.batch.rows_of(req_ids)
        counts = np.fromiter(step.num_scheduled_tokens.values(), np.int32, len(rows))
        token_ids, positions, token_rows, metas = self._prepare(rows, counts)
        layouts = self._one_row_decodes(metas, rows, counts)
        meta = layouts[0] if len(layouts) == 1 else layouts
        lora = self.lora.batch(self.batch.lora_ids[token_rows]) if self.lora else None
        extra: dict[str, Any] = {} if lora is None else {"lora": lora}
        if self.encoder_only:
            extra["token_type_ids"] = self._token_types(req_ids, positions, counts)
        if self.stage.first:
            hidden = self.model.forward(token_ids, positions, meta, self.kv_caches, **extra)
        else:
            hidden = self.model.forward(token_ids, positions, meta, self.kv_caches,
                                        hidden_in=self.backend.from_host(self.channel.recv()),
                                        **extra)
        self.batch.num_computed_tokens[rows] += counts
        if not self.stage.last:
            self.channel.send(self.backend.to_host(hidden))
            return StepOutput()
        if self.pooling is not None:
            return self._pool(hidden, rows, req_ids, metas[0])
        self._collect_prompt_logprobs(hidden, positions, token_rows)
        out = StepOutput(req_ids, [[] for _ in req_ids])
        self._sample(hidden, metas[0], rows, req_ids, step, out)
        if self._lora_failed:
            out.failed.update(self._lora_failed)
            out.failed_params.update(dict.fromkeys(self._lora_failed, "lora_request"))
            self._lora_failed = {}
        return out
