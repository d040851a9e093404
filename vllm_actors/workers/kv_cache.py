"""KV cache sizing: how many blocks to allocate for the model and the settings."""

from __future__ import annotations

from vllm_actors.config import CacheConfig
from vllm_actors.errors import ValidationError
from vllm_actors.models.base import ModelArgs


def kv_bytes_per_block(args: ModelArgs, block_size: int) -> int:
    """K and V of every layer for one block, float32."""
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * 4


def num_kv_blocks(cache: CacheConfig, max_model_len: int) -> int:
    """Usable blocks (the null block 0 comes on top).

    Raises:
        ValidationError: the cache cannot hold one request of max_model_len.
    """
    needed = -(-max_model_len // cache.block_size)
    blocks = cache.num_gpu_blocks_override or needed
    if blocks < needed:
        raise ValidationError(
            f"{blocks} KV blocks of {cache.block_size} tokens hold {blocks * cache.block_size} "
            f"tokens, fewer than one request of max_model_len={max_model_len}; raise the KV "
            "cache size or lower --max-model-len", "num_gpu_blocks_override")
    return blocks
