"""`--distributed-executor-backend ray`: tensor-parallel ranks as Ray actors in a local Ray
cluster (started by the engine core, stopped with it). TP=2 gives the in-process engine's
greedy tokens; collective_rpc reaches both actors; a killed actor fails the engine core
within 2 s; after shutdown no actor process and no Ray cluster is left."""

import importlib.util
import os
import signal
import time

import psutil
import pytest
from tiny_models import write_hf_dir

from vllm_actors import EngineArgs, SamplingParams
from vllm_actors.enginecore.core import EngineCore
from vllm_actors.errors import ValidationError, WorkerDiedError
from vllm_actors.protocol.engine import EngineCoreRequest

GREEDY_8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(i * 37 + j * 11) % 256 for j in range(5 + 9 * i)] for i in range(3)]


def engine(model_dir, **engine_args) -> EngineCore:
    return EngineCore(EngineArgs(model=str(model_dir), kv_cache_memory=16 << 20, device="cpu",
                                 **engine_args).create_engine_config())


def greedy(core: EngineCore) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(str(i), prompt, GREEDY_8, [2], 0.0))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def gone(pids: set[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_tp2_as_ray_actors(tmp_path):
    ray = pytest.importorskip("ray")
    write_hf_dir(tmp_path / "llama", "llama")
    reference = greedy(engine(tmp_path / "llama"))
    core = engine(tmp_path / "llama", tensor_parallel_size=2,
                  distributed_executor_backend="ray")
    try:
        assert greedy(core) == reference
        ranks = core.collective_rpc("describe", [])
        pids = {r["pid"] for r in ranks}
        assert [r["rank"] for r in ranks] == [0, 1] and len(pids) == 2
        assert os.getpid() not in pids
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError):
            core.check_health()
            core.add_request(EngineCoreRequest("after", PROMPTS[0], GREEDY_8, [2], 0.0))
            while core.has_unfinished_requests():
                core.step()
        assert time.monotonic() - start < 2.0
    finally:
        core.shutdown()
    assert not ray.is_initialized()
    assert gone(pids, within_s=10)


def test_ray_missing_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValidationError, match=r"needs Ray: pip install 'vllm-actors\[ray\]'"):
        EngineArgs(model="m", tensor_parallel_size=2,
                   distributed_executor_backend="ray").create_engine_config()
