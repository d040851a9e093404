"""EngineWatch: AsyncLLM's watch over its engine cores: one output task per core, its exit
noticed (a pidfd reader, else polling), and what a death means: without data parallel the
engine is dead; with it the core's requests fail, the others keep serving, and a replacement
starts (`EngineGroup.restart`) and rejoins.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from vllm_actors.errors import EngineDeadError
from vllm_actors.frontend.core_client import CoreClient

if TYPE_CHECKING:
    from vllm_actors.frontend.engine_group import EngineGroup
    from vllm_actors.frontend.metrics import FrontendMetrics
    from vllm_actors.frontend.output_processor import OutputProcessor

logger = logging.getLogger(__name__)

LIVENESS_POLL_S = 0.5   # core liveness polling where no pidfd exists


class EngineWatch:
    """Mixed into AsyncLLM, whose state it uses (declared here)."""

    group: "EngineGroup"
    metrics: "FrontendMetrics"
    output_processor: "OutputProcessor"
    _loop: asyncio.AbstractEventLoop | None
    _tasks: dict[int, list[asyncio.Task]]
    _restarting: set[asyncio.Task]
    _calls: dict[int, tuple[int, asyncio.Future]]
    _dead: EngineDeadError | None
    _stopping: bool

    def _fail(self, error: EngineDeadError) -> None:
        raise NotImplementedError

    async def _output_handler(self, engine: int, client: CoreClient) -> None:
        raise NotImplementedError

    def _watch(self, engine: int) -> None:
        """Read engine core `engine`'s outputs and notice its exit, on the current loop."""
        assert self._loop is not None
        client = self.group.clients[engine]
        tasks = [self._loop.create_task(self._output_handler(engine, client))]
        if client.exit_fd is not None:
            self._loop.add_reader(client.exit_fd, self._on_core_exit, engine, client)
        else:
            tasks.append(self._loop.create_task(self._watch_core(engine, client)))
        self._tasks[engine] = tasks

    def _unwatch(self, engine: int, client: CoreClient) -> None:
        if client.exit_fd is not None and self._loop is not None:
            self._loop.remove_reader(client.exit_fd)
        current = asyncio.current_task() if running_loop() is self._loop else None
        for task in self._tasks.pop(engine, []):
            if task is not current:
                task.cancel()

    async def _watch_core(self, engine: int, client: CoreClient) -> None:
        """Liveness by polling, where no exit file descriptor exists."""
        while client.is_alive():
            await asyncio.sleep(LIVENESS_POLL_S)
        self._on_core_exit(engine, client)

    def _on_core_exit(self, engine: int, client: CoreClient) -> None:
        if client.exit_fd is not None and self._loop is not None:
            self._loop.remove_reader(client.exit_fd)
        if not self._stopping and self.group.clients[engine] is client:
            self._engine_died(engine, client, EngineDeadError(
                f"the engine core{self._name(engine)} process exited unexpectedly "
                f"({client.describe_exit()})"))

    def _name(self, engine: int) -> str:
        return f" {engine}" if self.group.size > 1 else ""

    def _engine_died(self, engine: int, client: CoreClient, error: EngineDeadError) -> None:
        """Without data parallel: the engine is dead. With it: fail that core's requests and
        calls only, route around it, and start a replacement (MAX_RESTARTS times)."""
        if self.group.size == 1:
            self._fail(error)
            return
        if not self.group.alive[engine] or self._dead is not None:
            return
        logger.error("%s", error)
        self._unwatch(engine, client)
        self.group.mark_dead(engine)
        self.output_processor.fail_engine(engine, error)
        for call_id, (target, future) in list(self._calls.items()):
            if target == engine:
                del self._calls[call_id]
                if not future.done():
                    future.set_exception(error)
        self.metrics.observe_engine_death(engine, self.group.num_alive)
        if self.group.can_restart(engine):
            assert self._loop is not None
            restart = self._loop.create_task(self._restart(engine))
            self._restarting.add(restart)            # cancelled at shutdown
            restart.add_done_callback(self._restarting.discard)
        elif self.group.num_alive == 0:
            self._fail(EngineDeadError(f"every engine core died; the last: {error}"))

    async def _restart(self, engine: int) -> None:
        assert self._loop is not None
        try:
            await self._loop.run_in_executor(None, self.group.restart, engine)
        except Exception as e:
            logger.error("engine core %d could not be restarted: %s", engine, e)
            if self.group.num_alive == 0:
                self._fail(EngineDeadError(f"every engine core died; restarting {engine} "
                                           f"failed: {e}"))
            return
        if self._stopping or self._dead is not None:
            return                       # the group shuts it down with the others
        self.group.rejoin(engine)
        self._watch(engine)
        self.metrics.observe_engine_restart(self.group.num_alive)
        logger.warning("engine core %d restarted and serving", engine)


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

