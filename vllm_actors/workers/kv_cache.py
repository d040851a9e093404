"""KV cache sizing: how many blocks the settings and the device's memory allow."""

from __future__ import annotations

import logging

from vllm_actors.config import CacheConfig
from vllm_actors.errors import ValidationError
from vllm_actors.models.base import ModelArgs

logger = logging.getLogger(__name__)

# vLLM's CPU backend reserves 4 GiB for KV unless told otherwise; we do the same on numpy.
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30
DEFAULT_MEMORY_FRACTION = 0.9


def kv_bytes_per_block(args: ModelArgs, block_size: int) -> int:
    """K and V of every layer for one block, float32."""
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * 4


def num_kv_blocks(cache: CacheConfig, args: ModelArgs, max_model_len: int,
                  free_memory: int) -> int:
    """Usable blocks (the null block comes on top).

    From the first setting given: --num-gpu-blocks-override, --kv-cache-memory,
    --gpu-memory-utilization (x free memory after the weights), else the default budget.
    Raises:
        ValidationError: the cache cannot hold one request of max_model_len.
    """
    per_block = kv_bytes_per_block(args, cache.block_size)
    if cache.num_gpu_blocks_override is not None:
        blocks, source = cache.num_gpu_blocks_override, "--num-gpu-blocks-override"
    elif cache.kv_cache_memory is not None:
        blocks, source = cache.kv_cache_memory // per_block, "--kv-cache-memory"
    elif cache.gpu_memory_utilization is not None:
        blocks = int(free_memory * cache.gpu_memory_utilization) // per_block
        source = f"--gpu-memory-utilization of {free_memory / 2**30:.1f} GiB free"
    else:
        budget = min(DEFAULT_CPU_KV_CACHE_BYTES, int(free_memory * DEFAULT_MEMORY_FRACTION))
        blocks, source = budget // per_block, "the default budget"
    needed = -(-max_model_len // cache.block_size)
    if blocks < needed:
        raise ValidationError(
            f"{blocks} KV blocks of {cache.block_size} tokens ({source}) hold "
            f"{blocks * cache.block_size} tokens, fewer than one request of "
            f"max_model_len={max_model_len}; give the KV cache more memory (--kv-cache-memory, "
            "--gpu-memory-utilization, --num-gpu-blocks-override) or lower --max-model-len",
            "kv_cache_memory")
    tokens = blocks * cache.block_size
    logger.info("KV cache: %d blocks, %d tokens, %.1f MiB (%s); maximum concurrency for "
                "%d-token requests: %.2fx", blocks, tokens, blocks * per_block / 2**20, source,
                max_model_len, tokens / max_model_len)
    return blocks
