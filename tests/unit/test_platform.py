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
    return Platform(DeviceConfig(backend=name))


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


def test_vllm_parallel_flags():
    """vLLM's parallel flags, long and short: data parallel (one machine, mp) and pipeline
    parallel (mp) are built; multi-node data parallel and pipeline stages on another
    executor are refused naming the flag."""
    import argparse

    from vllm_actors import EngineArgs
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", "m", "--pipeline-parallel-size", "1", "-dp", "2",
                              "--data-parallel-size-local", "2", "-dpb", "mp"])
    engine = EngineArgs.from_cli_args(args)
    assert engine.pipeline_parallel_size == 1 and engine.data_parallel_size == 2
    parallel = engine.create_engine_config().parallel
    assert (parallel.tensor_parallel_size, parallel.data_parallel_size,
            parallel.data_parallel_backend) == (1, 2, "mp")
    pipelined = EngineArgs(model="m", pipeline_parallel_size=2).create_engine_config()
    assert (pipelined.parallel.pipeline_parallel_size, pipelined.parallel.executor_backend) \
        == (2, "mp")
    refused = [(dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
               (dict(pipeline_parallel_size=2, distributed_executor_backend="uni"),
                "distributed_executor_backend"),
               (dict(data_parallel_size=0), "data_parallel_size"),
               (dict(data_parallel_size=2, data_parallel_size_local=1),
                "data_parallel_size_local"),
               (dict(data_parallel_size=2, data_parallel_address="10.0.0.1"),
                "data_parallel_address"),
               (dict(data_parallel_size=2, data_parallel_rpc_port=13345),
                "data_parallel_rpc_port"),
               (dict(data_parallel_size=2, data_parallel_backend="slurm"),
                "data_parallel_backend"),
               (dict(data_parallel_size=2, data_parallel_backend="ray",
                     data_parallel_size_local=1), "data_parallel_size_local"),
               (dict(data_parallel_size=2, multiprocessing=False), "data_parallel_size")]
    for kwargs, param in refused:
        with pytest.raises(ValidationError) as info:
            EngineArgs(model="m", **kwargs).create_engine_config()
        assert info.value.param == param, kwargs


def test_data_parallel_device_shares():
    """CPU cores split into contiguous parts (shared only when fewer CPUs than cores); GPUs
    sliced by tensor parallel size from CUDA_VISIBLE_DEVICES."""
    from vllm_actors import EngineArgs
    from vllm_actors.frontend.engine_group import device_shares
    cpu = EngineArgs(model="m", device="cpu", data_parallel_size=2).create_engine_config()
    assert device_shares(cpu, 1) == [({}, None)]
    assert [c for _, c in device_shares(cpu, 2, {}, [0, 1, 2, 3, 4])] == \
        [frozenset({0, 1}), frozenset({2, 3, 4})]
    assert [c for _, c in device_shares(cpu, 3, {}, [4, 5])] == \
        [frozenset({4}), frozenset({5}), frozenset({4})]
    from vllm_actors.config import EngineConfig, ParallelConfig
    gpu = EngineConfig(device=DeviceConfig(backend="cuda"),
                     parallel=ParallelConfig(tensor_parallel_size=2, executor_backend="mp",
                                             data_parallel_size=2))
    shares = device_shares(gpu, 2, {"CUDA_VISIBLE_DEVICES": "3,4,5,6"})
    assert shares == [({"CUDA_VISIBLE_DEVICES": "3,4"}, None),
                      ({"CUDA_VISIBLE_DEVICES": "5,6"}, None)]
    assert device_shares(gpu, 2, {})[1][0] == {"CUDA_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(ValidationError, match="needs 4 GPUs"):
        device_shares(gpu, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2"})
