"""The adapters one rank holds: least recently used dropped beyond --max-cpu-loras (never
one a running request uses) and loaded again from the request's path, removal while in use
deferred until the last request finishes, and an id that running requests use never
rebound to other weights."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_lora import write_peft_adapter
from tiny_models import TINY_CONFIGS, tiny_weights, write_hf_dir

from vllm_actors.config import LoRAConfig
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.loaders.lora import LoRAAdapterError
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.lora_request import LoRARequest
from vllm_actors.models.registry import load_model
from vllm_actors.workers.lora_manager import LoRAManager


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-manager")
    write_hf_dir(root / "model", "llama")
    weights = tiny_weights(TINY_CONFIGS["llama"])
    paths = [write_peft_adapter(root / f"a{i}", weights, seed=i) for i in (1, 2)]
    model = load_model(resolve_model(str(root / "model")), NumpyBackend())
    return model, [LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(paths, 1)]


def test_lru_in_use_and_deferred_removal(setup):
    model, (a, b) = setup
    manager = LoRAManager(LoRAConfig(max_loras=1, max_cpu_loras=1), model)
    manager.add(a)
    manager.add(b)
    assert manager.ids() == [2]                      # a dropped: least recently used
    manager.acquire(a)                               # loaded again from its path
    assert manager.ids() == [1]
    manager.acquire(b)                               # both in use: neither can go
    assert sorted(manager.ids()) == [1, 2]
    assert manager.remove(1) and manager.ids() == [2]
    assert 1 in manager.loaded                       # a request still runs with it
    with pytest.raises(LoRAAdapterError, match="running requests still use"):
        manager.add(LoRARequest("other", 1, b.lora_path))
    manager.release(1)
    assert 1 not in manager.loaded
    tokens = np.array([0, 2, 2, 0], np.int32)
    batch = manager.batch(tokens)
    assert [rows.tolist() for _, rows in batch.groups] == [[1, 2]]
    assert manager.batch(np.zeros(3, np.int32)) is None
