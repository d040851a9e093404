"""The adapters one rank holds (`--enable-lora`): loaded on `add_lora` (every rank, before
any request names them) or on first use, kept up to `--max-cpu-loras` (least recently used
dropped first, never one a running request uses), and grouped per step by token rows."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from vllm_actors.config import LoRAConfig
from vllm_actors.loaders.lora import LoRAAdapterError, load_adapter
from vllm_actors.lora_request import LoRARequest
from vllm_actors.models.lora import LoRABatch, ModelLoRA, build_model_lora, check_lora_support


class LoRAManager:
    def __init__(self, config: LoRAConfig, model: Any) -> None:
        check_lora_support(model)
        self._warm_up = getattr(model.backend, "warm_up_lora", None)
        if self._warm_up is not None:   # compiled kernels: before READY, not at a first request
            self._warm_up(half=False)
        self.config = config
        self.model = model
        self.loaded: collections.OrderedDict[int, tuple[LoRARequest, ModelLoRA]] = \
            collections.OrderedDict()
        self.in_use: collections.Counter[int] = collections.Counter()   # id -> running reqs
        self.removed: set[int] = set()    # removed while in use: dropped when released

    def add(self, lora: LoRARequest) -> bool:
        """Load `lora` (again, when its path changed). Raises LoRAAdapterError."""
        held = self.loaded.get(lora.lora_int_id)
        if held is not None and held[0].lora_path == lora.lora_path:
            self.removed.discard(lora.lora_int_id)
            self.loaded.move_to_end(lora.lora_int_id)
            return True
        if held is not None and self.in_use[lora.lora_int_id]:
            raise LoRAAdapterError(lora.lora_name, lora.lora_path,
                                   f"id {lora.lora_int_id} belongs to {held[0].lora_name!r}, "
                                   "which running requests still use")
        args = self.model.args
        adapter = load_adapter(lora.lora_name, lora.lora_path, args,
                               self.config.max_lora_rank, self.config.lora_dtype,
                               getattr(self.model, "extra_names", None))
        if adapter.half and self._warm_up is not None:
            self._warm_up(half=True)     # float16 weights' kernels, once, at the first such load
        self.loaded[lora.lora_int_id] = (lora, build_model_lora(self.model, adapter))
        self.removed.discard(lora.lora_int_id)
        self._evict()
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter; False when it was not loaded. One that running requests use
        stays until the last of them finishes (as vLLM's, they finish with it)."""
        if lora_id not in self.loaded:
            return False
        if self.in_use[lora_id]:
            self.removed.add(lora_id)
        else:
            del self.loaded[lora_id]
        return True

    def ids(self) -> list[int]:
        return [i for i in self.loaded if i not in self.removed]

    def _evict(self) -> None:
        """Drop the least recently used adapters beyond --max-cpu-loras that no running
        request uses."""
        for lora_id in list(self.loaded):
            if len(self.loaded) <= self.config.cpu_loras:
                return
            if not self.in_use[lora_id]:
                del self.loaded[lora_id]

    def acquire(self, lora: LoRARequest) -> None:
        """A request starts running with `lora` (loaded here if it was dropped).
        Raises LoRAAdapterError when it cannot be loaded."""
        self.in_use[lora.lora_int_id] += 1       # first: loading it must not drop it again
        try:
            if lora.lora_int_id not in self.loaded:
                self.add(lora)
        except LoRAAdapterError:
            self.release(lora.lora_int_id)
            raise
        self.loaded.move_to_end(lora.lora_int_id)

    def release(self, lora_id: int) -> None:
        self.in_use[lora_id] -= 1
        if self.in_use[lora_id] <= 0:
            del self.in_use[lora_id]
            if lora_id in self.removed:
                self.removed.discard(lora_id)
                self.loaded.pop(lora_id, None)
            self._evict()

    def batch(self, token_lora_ids: np.ndarray) -> LoRABatch | None:
        """The step's groups from each token's adapter id (0: none); None without any."""
        if not token_lora_ids.any():
            return None
        groups = []
        for lora_id in np.unique(token_lora_ids):
            if lora_id and int(lora_id) in self.loaded:
                rows = np.flatnonzero(token_lora_ids == lora_id)
                groups.append((self.loaded[int(lora_id)][1],
                               None if len(rows) == len(token_lora_ids) else rows))
        return LoRABatch(tuple(groups)) if groups else None
