"""KV cache sizing: how many blocks the settings and the device's memory allow."""

from __future__ import annotations

import logging

from vllm_actors.config import CacheConfig
from vllm_actors.errors import ValidationError
from vllm_actors.kernels.kv_quant import kv_format
from vllm_actors.models.base import ModelArgs
from vllm_actors.models.kv_layout import (KVCacheGroup, blocks_per_request, kv_cache_groups,
                                          num_slots)

logger = logging.getLogger(__name__)

# vLLM's CPU backend reserves 4 GiB for KV unless told otherwise; we do the same on numpy.
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30
DEFAULT_MEMORY_FRACTION = 0.9


# The context length the start-up line quotes a concurrency for, beside max_model_len's.
QUOTED_CONTEXT = 8192


def kv_bytes_per_block(args: ModelArgs, block_size: int,
                       groups: list[KVCacheGroup] | None = None, slots: int | None = None,
                       kv_cache_dtype: str = "float32") -> int:
    """K and V of one block id in the cache's storage format (`kernels/kv_quant.py`): one
    page in every slot of the KV cache groups (every layer when the model has one attention
    type); `slots`: only that many (a pipeline stage holds its own layers' slots)."""
    slots = slots or num_slots(groups or kv_cache_groups(args))
    row = kv_format(kv_cache_dtype).row_bytes(args.head_dim)
    return 2 * slots * block_size * args.num_kv_heads * row


def num_kv_blocks(cache: CacheConfig, args: ModelArgs, max_model_len: int,
                  free_memory: int, max_num_batched_tokens: int | None = None,
                  slots: int | None = None) -> int:
    """Usable blocks (the null block comes on top). A block is a page of one KV cache
    group's layers (`models/kv_layout.py`); a request holds blocks in every group, and a
    sliding-window group only a window's worth.

    From the first setting given: --num-gpu-blocks-override, --kv-cache-memory,
    --gpu-memory-utilization (x free memory after the weights), else the default budget;
    `slots`: the KV slots this rank holds (a pipeline stage's), all of them when None.
    Raises:
        ValidationError: the cache cannot hold one request of max_model_len.
    """
    groups = kv_cache_groups(args)
    per_block = kv_bytes_per_block(args, cache.block_size, groups, slots, cache.kv_cache_dtype)
    per_block_f32 = kv_bytes_per_block(args, cache.block_size, groups, slots)
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
    needed = blocks_per_request(groups, max_model_len, cache.block_size,
                                max_num_batched_tokens or max_model_len)
    if blocks < needed:
        raise ValidationError(
            f"{blocks} KV blocks of {cache.block_size} tokens ({source}) are fewer than one "
            f"request of max_model_len={max_model_len} holds ({needed}); "
            "give the KV cache more memory (--kv-cache-memory, "
            "--gpu-memory-utilization, --num-gpu-blocks-override) or lower --max-model-len",
            "kv_cache_memory")
    logger.info("KV cache: %d blocks of %d tokens in %d group(s) (windows %s), %.1f MiB (%s); "
                "maximum concurrency for %d-token requests: %.2fx", blocks, cache.block_size,
                len(groups), sorted({g.window for g in groups}), blocks * per_block / 2**20,
                source, max_model_len, blocks / needed)
    quoted = blocks_per_request(groups, QUOTED_CONTEXT, cache.block_size,
                                max_num_batched_tokens or max_model_len)
    logger.info("KV cache dtype %s: %d bytes per token (float32: %d, %.2fx smaller); maximum "
                "concurrency for %d-token requests: %.2fx (a float32 cache of the same memory: "
                "%.2fx)", cache.kv_cache_dtype, per_block // cache.block_size,
                per_block_f32 // cache.block_size, per_block_f32 / per_block, QUOTED_CONTEXT,
                blocks / quoted, blocks * per_block / per_block_f32 / quoted)
    return blocks
