"""Platform: the one place that knows about device kinds (workers/platform.py), and the
Executor seam every way of running ranks implements (workers/executor.py)."""

import importlib.util
import inspect

import pytest

from vllm_actors.config import DeviceConfig
from vllm_actors.errors import ValidationError
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.workers import executor
from vllm_actors.workers.parallel_state import HostGroup
from vllm_actors.workers.platform import THREAD_VARS, Platform


def platform(name: str) -> Platform:
    return Platform(DeviceConfig(name))


def test_cpu_ranks_share_the_cores_and_see_no_gpu():
    env = platform("numpy").rank_env(1, 2, env={}, cpu_count=8)
    assert all(env[v] == "4" for v in THREAD_VARS) and "CUDA_VISIBLE_DEVICES" not in env
    kept = platform("cpu").rank_env(0, 3, env={"OMP_NUM_THREADS": "7"}, cpu_count=2)
    assert kept["OMP_NUM_THREADS"] == "7" and kept["OPENBLAS_NUM_THREADS"] == "1"


def test_cuda_ranks_see_one_gpu_each():
    cuda = platform("cuda")
    assert cuda.rank_env(1, 2, env={}, cpu_count=2)["CUDA_VISIBLE_DEVICES"] == "1"
    listed = {"CUDA_VISIBLE_DEVICES": "3,5"}
    assert cuda.rank_env(1, 2, env=listed, cpu_count=2)["CUDA_VISIBLE_DEVICES"] == "5"
    with pytest.raises(ValidationError, match="needs 3 GPUs; CUDA_VISIBLE_DEVICES lists 2"):
        cuda.rank_env(0, 3, env=listed, cpu_count=2)
    # auto with too few GPUs will run on the CPU: the variable is left alone
    assert platform("auto").rank_env(0, 3, env=listed, cpu_count=2)["CUDA_VISIBLE_DEVICES"] \
        == "3,5"


def test_extras_name_the_install(monkeypatch):
    assert platform("cpu").extras() is None
    platform("cpu").check_installed()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cupy" else real(name, *a))
    with pytest.raises(ValidationError, match=r"pip install 'vllm-actors\[cuda12\]"):
        platform("cuda").check_installed()


def test_backend_and_group_by_device():
    numpy = platform("numpy")
    backend = numpy.backend(rank=1)
    assert isinstance(backend, NumpyBackend)
    assert not numpy.shares_cores(backend, 1)

    class Comm:
        rank, world_size = 1, 2
    assert type(numpy.group(Comm(), backend)) is HostGroup


def test_every_executor_implements_the_protocol():
    members = [m for m in vars(executor.Executor) if not m.startswith("_")]
    assert set(members) >= {"start", "execute", "collective_rpc", "check_health", "shutdown"}
    for cls in (executor.InprocExecutor, executor.MultiprocExecutor):
        for name in members:
            if name == "ready":
                continue
            ours = inspect.signature(getattr(cls, name))
            theirs = inspect.signature(getattr(executor.Executor, name))
            assert list(ours.parameters) == list(theirs.parameters), (cls.__name__, name)


def test_vllm_parallel_flags_at_one_are_accepted():
    """Scripts written for vLLM pass --pipeline-parallel-size 1 / --data-parallel-size 1."""
    import argparse

    from vllm_actors import EngineArgs
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", "m", "--pipeline-parallel-size", "1",
                              "--data-parallel-size", "1"])
    engine = EngineArgs.from_cli_args(args)
    assert engine.pipeline_parallel_size == engine.data_parallel_size == 1
    assert engine.create_engine_config().parallel.tensor_parallel_size == 1
    with pytest.raises(ValidationError, match="data parallelism is not implemented yet"):
        EngineArgs(model="m", data_parallel_size=2).create_engine_config()
