"""Kill a process under a streaming engine and time when each stream learns of it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Callable

from vllm_actors import AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True,
                      output_kind=RequestOutputKind.DELTA)


async def kill_while_streaming(llm: AsyncLLM, pid: int | Callable[[], None],
                               num_requests: int) -> tuple[float, dict[str, tuple[float, str]]]:
    """Start `num_requests` long streams, SIGKILL `pid` (or call it: take a node away) once
    all are streaming, and return (kill time, {request id: (time of its EngineDeadError,
    message)}) on time.monotonic()."""
    results: dict = {}

    async def consume(name: str) -> None:
        try:
            async for _ in llm.generate("Count:", LONG, name):
                results.setdefault(name, "streaming")
        except EngineDeadError as e:
            results[name] = (time.monotonic(), str(e))

    tasks = [asyncio.create_task(consume(f"r{i}")) for i in range(num_requests)]
    while len(results) < num_requests:
        await asyncio.sleep(0.01)
    killed_at = time.monotonic()
    if callable(pid):
        pid()
    else:
        os.kill(pid, signal.SIGKILL)
    await asyncio.gather(*tasks)
    return killed_at, results
