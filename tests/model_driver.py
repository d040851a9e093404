"""Drive a loaded model directly over a paged KV cache (tests only): split a prompt into chunks,
run each chunk as one step, and collect the logits of every position."""

from __future__ import annotations

import numpy as np

from vllm_actors.kernels.ops import AttentionMetadata


def prompt_logits(model, backend, token_ids: list[int], chunks: list[int] | None = None,
                  block_size: int = 16, kv_format=None, first_row: int = 0,
                  one_prompt: bool = False) -> np.ndarray:
    """Logits [len(token_ids) - first_row, V] of the positions from `first_row` on (None on
    tensor-parallel ranks other than 0). `chunks` are step sizes (default: the whole prompt at
    once); `kv_format`: the cache's (kv_quant); `one_prompt`: the steps are chunks of one
    prompt of all the tokens (`AttentionMetadata.prompt_lens`), else each a request of its
    own. Blocks are handed out in a scrambled order so a wrong block-table lookup shows."""
    args = getattr(model, "local_args", model.args)   # a tensor-parallel shard's own heads
    num_blocks = -(-len(token_ids) // block_size)
    kv = backend.allocate_kv_cache(args.num_layers, num_blocks + 1, block_size,
                                   args.num_kv_heads, args.head_dim, kv_format)
    table = (np.arange(num_blocks, dtype=np.int32)[::-1] + 1)[None, :]
    chunks = chunks or [len(token_ids)]
    assert sum(chunks) == len(token_ids)
    rows, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n)
        meta = AttentionMetadata(
            query_start_loc=np.array([0, n], np.int32), seq_lens=np.array([start + n], np.int32),
            block_tables=table, slot_mapping=(table[0][pos // block_size].astype(np.int64)
                                              * block_size + pos % block_size),
            block_size=block_size,
            prompt_lens=np.array([len(token_ids)], np.int32) if one_prompt else None)
        hidden = model.forward(np.asarray(token_ids[start:start + n]), pos, meta, kv)
        if start + n > first_row:
            rows.append(model.compute_logits(hidden, np.arange(max(first_row - start, 0), n)))
        start += n
    return None if rows[0] is None else np.concatenate(rows)   # None: tensor-parallel rank > 0


def greedy_tokens(model, backend, prompt: list[int], steps: int, block_size: int = 8
                  ) -> list[int] | None:
    """Greedy continuation of `prompt` for `steps` tokens: one prefill step, then one decode
    step per token over the same paged KV cache (None on tensor-parallel ranks other than 0)."""
    args = getattr(model, "local_args", model.args)
    total = len(prompt) + steps
    num_blocks = -(-total // block_size)
    kv = backend.allocate_kv_cache(args.num_layers, num_blocks + 1, block_size,
                                   args.num_kv_heads, args.head_dim)
    table = (np.arange(num_blocks, dtype=np.int32)[::-1] + 1)[None, :]
    tokens, start, step_ids = [], 0, list(prompt)
    for _ in range(steps):
        n = len(step_ids)
        pos = np.arange(start, start + n)
        meta = AttentionMetadata(
            query_start_loc=np.array([0, n], np.int32), seq_lens=np.array([start + n], np.int32),
            block_tables=table, slot_mapping=(table[0][pos // block_size].astype(np.int64)
                                              * block_size + pos % block_size),
            block_size=block_size)
        hidden = model.forward(np.asarray(step_ids), pos, meta, kv)
        logits = model.compute_logits(hidden, np.array([n - 1]))
        ids = None if logits is None else np.array([int(logits[0].argmax())])
        tp = getattr(model, "tp", None)
        if tp is not None and tp.world_size > 1:
            ids = tp.broadcast_ids(ids, 1)
        tokens.append(int(ids[0]))
        start += n
        step_ids = [tokens[-1]]
    rank = getattr(getattr(model, "tp", None), "rank", 0)
    return tokens if rank == 0 else None


def golden_step_logit_error(model, backend, case: dict, steps: list[int], stored) -> float:
    """Largest |logit - golden| over a golden case's stored generation steps (the ids kept
    in `stored`, an npz of `{name}/{step}/ids` and `.../logits`), recomputed by running the
    prompt and the golden tokens as one prompt in two chunks."""
    ids = case["prompt_token_ids"] + case["tokens"][:max(steps)]
    first = len(case["prompt_token_ids"]) - 1 + min(steps)   # logits from the first step on
    logits = prompt_logits(model, backend, ids, chunks=[len(ids) - 5, 5], first_row=first)
    worst = 0.0
    for step in steps:
        row = logits[len(case["prompt_token_ids"]) - 1 + step - first]
        keys = stored[f"{case['name']}/{step}/ids"]
        worst = max(worst, float(np.abs(row[keys] - stored[f"{case['name']}/{step}/logits"]).max()))
    return worst
