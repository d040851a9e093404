"""InputBatch: the worker's persistent per-request arrays. A request keeps its row from
admission until it finishes or is preempted, so each step only writes what changed."""

from __future__ import annotations

import numpy as np

from vllm_actors.protocol.engine import TokenLogprobs
from vllm_actors.protocol.step import NewRequestData
from vllm_actors.sampling_params import SamplingParams
from vllm_actors.workers.sampling_state import SamplingState


class InputBatch:
    """Rows of preallocated arrays.

    Attributes:
        token_ids: [max_num_reqs, max_model_len] int32, prompt then outputs.
        num_tokens / num_prompt_tokens / num_computed_tokens: [max_num_reqs] int32.
        block_table: [num_kv_groups, max_num_reqs, max_blocks_per_req] int32, block ids per
            KV cache group (0 = the null block).
        lora_ids: [max_num_reqs] int32, each row's LoRA adapter id (0: none).
        num_blocks: [num_kv_groups, max_num_reqs] int32, filled entries of each row.
        params: the SamplingParams of each row (None for a free row).
        sampling: the rows' sampling controls as arrays.
        prompt_logprobs: per row, prompt logprobs of the chunks computed so far.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 num_kv_groups: int = 1) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int32)
        self.block_table = np.zeros((num_kv_groups, max_num_reqs, max_blocks), np.int32)
        self.num_blocks = np.zeros((num_kv_groups, max_num_reqs), np.int32)
        self.lora_ids = np.zeros(max_num_reqs, np.int32)   # 0: the base model
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.sampling = SamplingState(max_num_reqs)
        self.prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        self.req_id_to_row: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def add_request(self, new: NewRequestData, params: SamplingParams | None = None) -> int:
        """Give a request a row (its tokens, blocks, sampling params); returns the row.
        `params`: its SamplingParams when `new` shares a sibling's (`params_from`; see
        StepInput.new_request_params), else new.sampling_params."""
        if not self.free_rows:
            raise RuntimeError("InputBatch is full: more running requests than max_num_seqs")
        row = self.free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.lora_ids[row] = new.lora_request.lora_int_id if new.lora_request else 0
        self.num_blocks[:, row] = 0
        self.append_blocks(row, new.block_ids)
        params = new.sampling_params if params is None else params
        self.params[row] = params
        self.sampling.set_row(row, params, new.eos_token_ids, new.child_index)
        return row

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self.params[row] = None
            self.lora_ids[row] = 0
            self.sampling.clear_row(row)
            self.prompt_logprobs.pop(row, None)
            self.free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[list[int]]) -> None:
        """New block ids per KV cache group."""
        for group, ids in enumerate(block_ids):
            start = self.num_blocks[group, row]
            self.block_table[group, row, start:start + len(ids)] = ids
            self.num_blocks[group, row] = start + len(ids)

    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        return np.fromiter((self.req_id_to_row[r] for r in req_ids), np.int64, len(req_ids))

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """One sampled token per row, written after each row's last token."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
