"""The parallel part of the configuration: vLLM's flags for tensor, pipeline and data
parallelism and the executor backends, their validation, and the frozen `ParallelConfig`.

Like `config`, this module imports nothing else from the package but `errors`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from vllm_actors.errors import ValidationError

DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "uni", "ray")
DATA_PARALLEL_BACKENDS = ("mp", "ray")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """tensor_parallel_size: worker processes (one per device) the model is split over;
    executor_backend: "uni" (one worker, in the engine core's process), "mp" (one process per
    rank on this machine) or "ray" (ranks as Ray actors).
    data_parallel_size: engine cores (each with its own workers and KV cache) behind one
    frontend, which routes every request to one of them (`frontend/engine_group.py`);
    data_parallel_backend: how those cores are started ("mp": processes on this machine;
    "ray": Ray actors spread over the cluster's nodes, reaching the frontend over tcp at
    data_parallel_address / data_parallel_rpc_port, default this node's address, any port).
    pipeline_parallel_size: stages the layers are split over (each with
    tensor_parallel_size ranks, executor "mp" or "ray"); the core keeps that many steps in
    flight."""

    tensor_parallel_size: int = 1
    executor_backend: str = "uni"
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    pipeline_parallel_size: int = 1
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None


def parallel_config(args: Any) -> ParallelConfig:
    """Validate the parallel fields of `args` (an EngineArgs). Raises ValidationError naming
    the flag."""
    size, backend = args.tensor_parallel_size, args.distributed_executor_backend
    pp = args.pipeline_parallel_size
    if size < 1:
        raise ValidationError(f"tensor_parallel_size must be positive, got {size}",
                              "tensor_parallel_size")
    if pp < 1:
        raise ValidationError(f"pipeline_parallel_size must be positive, got {pp}",
                              "pipeline_parallel_size")
    if backend is None:
        backend = "mp" if size * pp > 1 else "uni"
    if pp > 1 and backend == "uni":
        raise ValidationError(f"--pipeline-parallel-size {pp} runs its stages as worker "
                              f"processes (--distributed-executor-backend mp, or ray); not "
                              f"inside the engine core (uni)", "distributed_executor_backend")
    if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise ValidationError(f"--distributed-executor-backend must be one of "
                              f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {backend!r}",
                              "distributed_executor_backend")
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ValidationError("--distributed-executor-backend ray needs Ray: pip install "
                              "'vllm-actors[ray]'", "distributed_executor_backend")
    if backend == "uni" and size > 1:
        raise ValidationError(f"--distributed-executor-backend uni runs one worker; "
                              f"--tensor-parallel-size {size} needs mp",
                              "distributed_executor_backend")
    dp, dp_backend = _data_parallel(args)
    return ParallelConfig(tensor_parallel_size=size, executor_backend=backend,
                          data_parallel_size=dp, data_parallel_backend=dp_backend,
                          pipeline_parallel_size=pp,
                          data_parallel_address=args.data_parallel_address,
                          data_parallel_rpc_port=args.data_parallel_rpc_port)


def _data_parallel(args: Any) -> tuple[int, str]:
    dp, dp_backend = args.data_parallel_size, args.data_parallel_backend
    if dp < 1:
        raise ValidationError(f"data_parallel_size must be positive, got {dp}",
                              "data_parallel_size")
    if dp_backend not in DATA_PARALLEL_BACKENDS:
        raise ValidationError(f"--data-parallel-backend must be one of "
                              f"{', '.join(DATA_PARALLEL_BACKENDS)}, got {dp_backend!r}",
                              "data_parallel_backend")
    local = args.data_parallel_size_local
    if dp_backend == "ray":
        if importlib.util.find_spec("ray") is None:
            raise ValidationError("--data-parallel-backend ray needs Ray: pip install "
                                  "'vllm-actors[ray]'", "data_parallel_backend")
        if local is not None:
            raise ValidationError("--data-parallel-size-local: with --data-parallel-backend "
                                  "ray, Ray places the engine cores on the cluster's nodes; "
                                  "leave it unset", "data_parallel_size_local")
        return dp, dp_backend
    if local is not None and local != dp:
        raise ValidationError(f"--data-parallel-size-local {local}: with "
                              f"--data-parallel-backend mp every engine core runs on this "
                              f"machine, so it must equal --data-parallel-size {dp} (use "
                              f"--data-parallel-backend ray for several machines)",
                              "data_parallel_size_local")
    for name in ("data_parallel_address", "data_parallel_rpc_port"):
        if getattr(args, name) is not None:
            raise ValidationError(f"--{name.replace('_', '-')}: only with "
                                  "--data-parallel-backend ray (the engine cores of this "
                                  "machine talk to the frontend over ipc sockets)", name)
    if dp > 1 and not args.multiprocessing:
        raise ValidationError("--data-parallel-size > 1 runs one engine core process each; "
                              "it needs --multiprocessing", "data_parallel_size")
    return dp, dp_backend
