"""EngineGroup: the engine cores behind one frontend (`--data-parallel-size N`).

Each core is a `CoreClient` with its own process, workers (`--tensor-parallel-size` each) and
KV cache. On the CPU every core gets its own share of the CPUs (its process and workers are
pinned to it, so BLAS and kernel thread pools size themselves to it); on GPUs its own
`CUDA_VISIBLE_DEVICES` slice. The group keeps which core serves which engine request, each
core's load (its unfinished requests) and the prefix router (`router.py`), and replaces a
core that died. The asyncio side (reading outputs, noticing deaths) stays in AsyncLLM.

With `--data-parallel-backend ray` the cores are Ray actors spread over the cluster's nodes
(`RayCoreClient`): the group connects to the cluster in RAY_ADDRESS, or starts a local one
and stops it at shutdown; Ray decides each core's node and CPUs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Any

from vllm_actors.config import EngineConfig
from vllm_actors.errors import EngineDeadError, ValidationError
from vllm_actors.frontend.core_client import CoreClient
from vllm_actors.frontend.router import PrefixRouter, prompt_block_hashes
from vllm_actors.protocol.engine import FrontendMessage

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3     # per engine core; then it stays down (a crash loop is not served)


def _uses_gpus(device: str) -> bool:
    return device == "cuda" or (device == "auto" and os.path.exists("/dev/nvidiactl"))


def device_shares(config: EngineConfig, size: int, environ: dict[str, str] | None = None,
                  cpus: list[int] | None = None
                  ) -> list[tuple[dict[str, str], frozenset[int] | None]]:
    """(environment, CPU set) of each of `size` engine cores. CPU devices: the CPUs this
    process may use, split into `size` contiguous parts (cores share CPUs only when there
    are fewer CPUs than cores). GPUs: core i sees the i-th `tensor_parallel_size` devices of
    CUDA_VISIBLE_DEVICES (or of 0..N-1).

    Raises:
        ValidationError: fewer visible GPUs than data x tensor parallel ranks.
    """
    if size == 1:
        return [({}, None)]
    environ = dict(os.environ if environ is None else environ)
    if _uses_gpus(config.device.backend):
        tp = config.parallel.tensor_parallel_size
        listed = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                  if d.strip()]
        visible = listed or [str(i) for i in range(size * tp)]
        if len(visible) < size * tp:
            raise ValidationError(f"--data-parallel-size {size} x --tensor-parallel-size {tp} "
                                  f"needs {size * tp} GPUs; CUDA_VISIBLE_DEVICES lists "
                                  f"{len(visible)}", "data_parallel_size")
        return [({"CUDA_VISIBLE_DEVICES": ",".join(visible[i * tp:(i + 1) * tp])}, None)
                for i in range(size)]
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    n = len(cpus)
    if n < size:
        return [({}, frozenset({cpus[i % n]})) for i in range(size)]
    return [({}, frozenset(cpus[i * n // size:(i + 1) * n // size])) for i in range(size)]


class EngineGroup:
    """Starts `config.parallel.data_parallel_size` engine cores (in parallel) and routes to
    them. Raises the first core's startup error (the others are stopped)."""

    def __init__(self, config: EngineConfig, use_process: bool = True) -> None:
        self.config = config
        self.use_process = use_process
        self.size = config.parallel.data_parallel_size
        self.ray: Any = None
        self.started_ray = False
        self.closed = False
        if config.parallel.data_parallel_backend == "ray":
            self.shares = [({}, None)] * self.size
            self._connect_ray()
        else:
            self.shares = device_shares(config, self.size)
        try:
            self.clients = self._start_all()
        except BaseException:
            self._disconnect_ray()
            raise
        self.ready = self.clients[0].ready
        self.alive = [True] * self.size
        self.loads = [0] * self.size
        self.restarts = [0] * self.size
        self.placement: dict[str, int] = {}     # engine request id -> engine core
        self.router = PrefixRouter(self.size, self.ready.num_kv_blocks)

    def start_client(self, engine: int) -> Any:
        """A new core for slot `engine` (blocks until it has loaded the model)."""
        if self.ray is not None:
            from vllm_actors.frontend.ray_core_client import RayCoreClient
            parallel = self.config.parallel
            return RayCoreClient(self.config, self.ray, parallel.data_parallel_address,
                                 parallel.data_parallel_rpc_port)
        env, cpus = self.shares[engine]
        return CoreClient(self.config, self.use_process, env, cpus)

    def _connect_ray(self) -> None:
        import ray
        self.ray = ray
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     **({} if address else {"num_cpus": max(self.size, os.cpu_count() or 1)}))
            self.started_ray = address is None

    def _disconnect_ray(self) -> None:
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False

    def _start_all(self) -> list[CoreClient]:
        if self.size == 1:
            return [self.start_client(0)]
        with concurrent.futures.ThreadPoolExecutor(self.size) as pool:
            futures = [pool.submit(self.start_client, i) for i in range(self.size)]
            concurrent.futures.wait(futures)
        started = [f.result() for f in futures if f.exception() is None]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for client in started:
                client.shutdown()
            raise errors[0]
        return started

    # -- routing -------------------------------------------------------------------------
    @property
    def num_alive(self) -> int:
        return sum(self.alive)

    def live(self) -> list[int]:
        return [e for e in range(self.size) if self.alive[e]]

    def route(self, prompt_token_ids: list[int], cache_salt: str | None) -> int:
        """The core for a new prompt (by load and cached prefix, see router.py); the prompt's
        blocks are then expected in that core's cache."""
        if self.size == 1:
            return 0
        hashes = prompt_block_hashes(prompt_token_ids, self.ready.block_size, cache_salt)
        engine = self.router.choose(hashes, self.loads, self.alive)
        self.router.record(engine, hashes)
        return engine

    def assign(self, engine: int, engine_ids: list[str]) -> None:
        for engine_id in engine_ids:
            self.placement[engine_id] = engine
        self.loads[engine] += len(engine_ids)

    def release(self, engine_ids: list[str]) -> None:
        """These engine requests finished (or were aborted)."""
        for engine_id in engine_ids:
            engine = self.placement.pop(engine_id, None)
            if engine is not None:
                self.loads[engine] -= 1

    def engine_of(self, engine_id: str) -> int | None:
        return self.placement.get(engine_id)

    def send(self, engine: int, message: FrontendMessage) -> None:
        self.clients[engine].send(message)

    # -- deaths and restarts ---------------------------------------------------------------
    def mark_dead(self, engine: int) -> None:
        """Core `engine` is gone: route around it; its requests were failed by the caller."""
        self.alive[engine] = False
        self.loads[engine] = 0
        self.placement = {i: e for i, e in self.placement.items() if e != engine}
        self.router.forget(engine)

    def can_restart(self, engine: int) -> bool:
        return self.size > 1 and self.restarts[engine] < MAX_RESTARTS

    def restart(self, engine: int) -> Any:
        """Release the dead core's sockets and start a new one in its slot (blocking: run it
        off the event loop); `rejoin` puts it in service. A group shut down meanwhile stops
        the new core at once (EngineDeadError)."""
        self.restarts[engine] += 1
        self.clients[engine].shutdown()
        logger.warning("restarting engine core %d (restart %d of %d)", engine,
                       self.restarts[engine], MAX_RESTARTS)
        client = self.start_client(engine)
        if self.closed:
            client.shutdown()
            raise EngineDeadError("the engine was shut down while a core restarted")
        self.clients[engine] = client      # shut down with the group from now on
        return client

    def rejoin(self, engine: int) -> None:
        self.alive[engine] = True

    def shutdown(self) -> None:
        self.closed = True
        for client in self.clients:
            client.shutdown()
        self._disconnect_ray()
