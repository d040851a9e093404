"""Engine core <-> worker process messages (multi-process executor).

Startup, on each worker's own PAIR socket: WorkerInit ->, <- WorkerReady (or the protocol's
EngineStartupError). Then the core broadcasts `WorkerCall`s to every rank through the
shared-memory ring; rank 0 answers each ExecuteStep with the StepOutput on its socket, and
every rank answers a CallMethod with its RpcDone. A worker that fails sends WorkerFailed on
its socket and exits.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_actors.protocol.engine import EngineReady, EngineStartupError
from vllm_actors.protocol.step import StepInput, StepOutput


class WorkerInit(msgspec.Struct, array_like=True, gc=False, tag=30):
    """What a worker needs to start.

    Attributes:
        config: the msgpack-encoded EngineConfig (protocol/ imports no config).
        ring_name / ring_bytes: the broadcast ring's shared-memory segment.
        comm_name / comm_slot_bytes: the tensor-parallel communicator's segment (of this
            rank's pipeline stage).
        pipeline_parallel_size: stages; rank r is stage r // (world_size / stages), rank
            r % (world_size / stages) within its stage's tensor-parallel group.
    """

    rank: int
    world_size: int
    config: bytes
    ring_name: str
    ring_slots: int
    ring_slot_bytes: int
    comm_name: str
    comm_slot_bytes: int
    pipeline_parallel_size: int = 1


class WorkerReady(msgspec.Struct, array_like=True, gc=False, tag=31):
    """A rank has loaded its shard; `ready.num_kv_blocks` is what its own memory allows."""

    rank: int
    ready: EngineReady


class InitKVCache(msgspec.Struct, array_like=True, gc=False, tag=32):
    """Allocate the KV cache: the smallest block count any rank reported."""

    num_blocks: int


class ExecuteStep(msgspec.Struct, array_like=True, gc=False, tag=33):
    step: StepInput


class WorkerShutdown(msgspec.Struct, array_like=True, gc=False, tag=34):
    """Leave the loop and exit 0."""


class StepDone(msgspec.Struct, array_like=True, gc=False, tag=36):
    """Rank 0's answer to an ExecuteStep."""

    output: StepOutput


class WorkerFailed(msgspec.Struct, array_like=True, gc=False, tag=35):
    """A fatal error in a worker; the engine core dies with this reason."""

    rank: int
    reason: str


class CallMethod(msgspec.Struct, array_like=True, gc=False, tag=37):
    """collective_rpc: every rank runs `RankHost.call(method, args)` and answers RpcDone."""

    method: str
    args: list[Any] = []


class RpcDone(msgspec.Struct, array_like=True, gc=False, tag=38):
    """One rank's answer to a CallMethod: the result, or the error it raised."""

    rank: int
    result: Any = None
    error: str | None = None


WorkerCall = InitKVCache | ExecuteStep | WorkerShutdown | CallMethod
WorkerStartupReply = WorkerReady | EngineStartupError
WorkerReply = StepDone | WorkerFailed | RpcDone
