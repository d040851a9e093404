"""Tensor-parallel sharding of a decoder's weights at load time (Megatron-style).

Column-parallel (output rows split): the fused QKV by heads and gate/up by MLP width, so each
rank computes its own heads and MLP slice with no communication. Row-parallel (input columns
split): o_proj and down, whose partial outputs are summed by one all-reduce each. Vocab-
parallel: each rank holds a contiguous range of the embedding / LM-head rows; the embedding is
summed across ranks (out-of-range ids hit a zero row), the LM-head logits are gathered.

`gathered` (llama.cpp's float order, the quantized GGUF semantics): o_proj and down are split
by output rows instead, in runs of `HIDDEN_ALIGN`, after an all-gather of their inputs, and
their outputs are all-gathered: each output is then one dot over the whole input, in the order
llama.cpp computes it in one process, where partial dots summed across ranks are another.

KV heads: with at least as many KV heads as ranks they are split like query heads; with fewer,
each rank keeps the one KV head its query heads attend to (replicated across that group).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vllm_actors.errors import ValidationError
from vllm_actors.loaders.weights import RawTensor
from vllm_actors.models.base import ModelArgs


HIDDEN_ALIGN = 16    # a gathered o_proj / down shard's rows: whole chunks of the kernels' lanes


def _split(total: int, size: int, rank: int, align: int = 1) -> tuple[int, int]:
    per = -(-total // (size * align)) * align
    return min(total, rank * per), min(total, (rank + 1) * per)


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `size` holds. Ranges are [start, stop) in whole-model units."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    vocab_widths: list[int]
    local_args: ModelArgs
    hidden: tuple[int, int] = (0, 0)
    hidden_widths: tuple[int, ...] = ()
    gathered: bool = False

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @classmethod
    def build(cls, args: ModelArgs, rank: int, size: int, gathered: bool = False
              ) -> "ShardPlan":
        """`gathered`: o_proj and down split by output rows (the module docstring).

        Raises:
            ValidationError: heads, KV heads or the MLP width do not divide among the ranks.
        """
        _check_divisible(args, size)
        per_head = args.num_heads // size
        heads = (rank * per_head, (rank + 1) * per_head)
        if args.num_kv_heads >= size:
            per_kv = args.num_kv_heads // size
            kv_heads = (rank * per_kv, (rank + 1) * per_kv)
        else:   # replicate: the KV head of this rank's query heads
            kv = heads[0] // (args.num_heads // args.num_kv_heads)
            kv_heads = (kv, kv + 1)
        per_ffn = args.intermediate_size // size
        vocab_widths = [stop - start for start, stop in
                        (_split(args.vocab_size, size, r) for r in range(size))]
        local = replace(args, num_heads=per_head, num_kv_heads=kv_heads[1] - kv_heads[0],
                        intermediate_size=per_ffn)
        hidden = [_split(args.hidden_size, size, r, HIDDEN_ALIGN) for r in range(size)]
        if any(stop == start for start, stop in hidden):    # too narrow for whole runs
            hidden = [_split(args.hidden_size, size, r) for r in range(size)]
        return cls(rank, size, heads, kv_heads, (rank * per_ffn, (rank + 1) * per_ffn),
                   _split(args.vocab_size, size, rank), vocab_widths, local, hidden[rank],
                   tuple(stop - start for start, stop in hidden), gathered and size > 1)

    def q_rows(self, t: RawTensor, head_dim: int) -> RawTensor:
        return t.row_slice(self.heads[0] * head_dim, self.heads[1] * head_dim)

    def kv_rows(self, t: RawTensor, head_dim: int) -> RawTensor:
        return t.row_slice(self.kv_heads[0] * head_dim, self.kv_heads[1] * head_dim)

    def o_cols(self, t: RawTensor, head_dim: int) -> RawTensor:
        return t.col_slice(self.heads[0] * head_dim, self.heads[1] * head_dim)

    def ffn_rows(self, t: RawTensor) -> RawTensor:
        return t.row_slice(*self.ffn)

    def ffn_cols(self, t: RawTensor) -> RawTensor:
        return t.col_slice(*self.ffn)

    def o_shard(self, t: RawTensor, head_dim: int) -> RawTensor:
        """o_proj's part (its bias's too): output rows where `gathered`, else input columns."""
        return t.row_slice(*self.hidden) if self.gathered else self.o_cols(t, head_dim)

    def down_shard(self, t: RawTensor) -> RawTensor:
        """down's part: output rows where `gathered`, else input columns."""
        return t.row_slice(*self.hidden) if self.gathered else self.ffn_cols(t)

    def input_widths(self, per_rank: int) -> list[int]:
        """The widths a gathered layer's input arrives in from each rank (heads or MLP
        slices, the same on every rank)."""
        return [per_rank] * self.size

    def vocab_table(self, t: RawTensor) -> RawTensor:
        """This rank's vocabulary rows plus one zero row for ids owned by other ranks."""
        return t.row_slice(*self.vocab).with_zero_row()

    def local_ids(self, token_ids: np.ndarray) -> np.ndarray:
        """Whole-vocabulary ids [T] -> rows of `vocab_table` (the zero row when not ours)."""
        start, stop = self.vocab
        mine = (token_ids >= start) & (token_ids < stop)
        return np.where(mine, token_ids - start, stop - start)


def _check_divisible(args: ModelArgs, size: int) -> None:
    flag = f"--tensor-parallel-size {size}"
    if args.num_heads % size:
        raise ValidationError(f"{args.num_heads} attention heads are not divisible by {flag}",
                              "tensor_parallel_size")
    kv = args.num_kv_heads
    if kv % size and size % kv:
        raise ValidationError(f"{kv} KV heads and {flag} do not divide one another (each rank "
                              "needs whole KV heads, or one replicated KV head)",
                              "tensor_parallel_size")
    for what, width in (("MLP width", args.intermediate_size),
                        ("expert MLP width", args.moe_intermediate_size),
                        ("shared expert MLP width", args.shared_expert_size)):
        if width % size:
            raise ValidationError(f"{what} {width} is not divisible by {flag}",
                                  "tensor_parallel_size")
