"""EngineWatch: AsyncLLM's watch over its engine cores: one output task per core, its exit
noticed (a pidfd reader, else polling), and what a death means: without data parallel the
engine is dead; with it the core's requests fail, the others keep serving, and a replacement
starts (`EngineGroup.restart`) and rejoins.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
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

    async def _on_message(self, engine: int, client: CoreClient, message: object) -> bool:
        raise NotImplementedError

    def _watch(self, engine: int) -> None:
        """Read engine core `engine`'s outputs and notice its exit, on the current loop. The
        loop holds the engine only weakly (`_read_outputs`, `_exited`), so one dropped
        without `shutdown()` is collected and its finalizer stops the cores, as vLLM's."""
        assert self._loop is not None
        client, ref = self.group.clients[engine], weakref.ref(self)
        tasks = [self._loop.create_task(_read_outputs(ref, engine, client))]
        if client.exit_fd is not None:
            self._loop.add_reader(client.exit_fd, _exited, ref, engine, client)
        else:
            tasks.append(self._loop.create_task(_poll_exit(ref, engine, client)))
        self._tasks[engine] = tasks

    def _unwatch(self, engine: int, client: CoreClient) -> None:
        if client.exit_fd is not None and self._loop is not None:
            self._loop.remove_reader(client.exit_fd)
        current = asyncio.current_task() if running_loop() is self._loop else None
        for task in self._tasks.pop(engine, []):
            if task is not current:
                task.cancel()

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


async def _read_outputs(ref: "weakref.ref[EngineWatch]", engine: int,
                        client: CoreClient) -> None:
    """Engine core `engine`'s messages to the engine behind `ref`, held only while one is
    handled; ends when the engine is gone or the core's outputs end."""
    while True:
        try:
            message: object = await client.recv()
        except Exception as e:      # handed over: the engine fails with it
            message = e
        watch = ref()
        if watch is None or not await watch._on_message(engine, client, message):
            return
        del watch


async def _poll_exit(ref: "weakref.ref[EngineWatch]", engine: int, client: CoreClient) -> None:
    """Liveness by polling, where no exit file descriptor exists."""
    while client.is_alive():
        await asyncio.sleep(LIVENESS_POLL_S)
    _exited(ref, engine, client)


def _exited(ref: "weakref.ref[EngineWatch]", engine: int, client: CoreClient) -> None:
    watch = ref()
    if watch is not None:
        watch._on_core_exit(engine, client)


def release_on_collect(loop_box: list[asyncio.AbstractEventLoop | None],
                       group: "EngineGroup", tasks: dict[int, list[asyncio.Task]]) -> None:
    """An engine's finalizer (it must not hold the engine): its tasks cancelled, its exit
    readers removed from its loop (`loop_box[0]`), and its cores stopped."""
    loop = loop_box[0]
    for engine, engine_tasks in list(tasks.items()):
        for task in engine_tasks:
            task.cancel()
        fd = group.clients[engine].exit_fd
        if loop is not None and not loop.is_closed() and fd is not None:
            loop.remove_reader(fd)
    tasks.clear()
    if not group.closed:
        group.shutdown()


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

