"""The engine core process's life: death noticed within 2 s, no orphans, no leftover ipc
files, clean exits when either side goes away, fatal errors reported."""

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from engine_death import LONG, kill_while_streaming

from vllm_actors import AsyncLLM, EngineDeadError, LLM, RequestOutputKind, SamplingParams
from vllm_actors.enginecore.core import EngineCore



def wait_until(condition, timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - start


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_one_event_loop_after_another_then_sigkill_of_the_core_fails_requests_fast(
        smollm2_path):
    """One AsyncLLM (as a context manager) serves one event loop after another with the same
    tokens; then its core is killed under running streams: every pending request fails
    within 2 s and new ones fail too; leaving the block removes everything."""
    params = SamplingParams(temperature=0.0, max_tokens=4,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    with AsyncLLM(str(smollm2_path)) as llm:
        pid, ipc_dir = llm.client.pid, llm.client.addresses.directory

        async def once():
            return [o async for o in llm.generate("Hi", params)][-1].outputs[0].token_ids

        assert asyncio.run(once()) == asyncio.run(once())

        async def scenario():
            killed_at, results = await kill_while_streaming(llm, pid, 3)
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate("again", LONG):
                    pass
            with pytest.raises(EngineDeadError):
                await llm.check_health()
            return killed_at, results

        killed_at, results = asyncio.run(scenario())
        for when, message in results.values():
            assert when - killed_at < 2.0
            assert "exited unexpectedly" in message
        assert llm.errored
    assert gone(pid) and not os.path.exists(ipc_dir)
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid == pid]


def test_fatal_error_in_the_core_is_reported(smollm2_path, monkeypatch):
    calls = {"n": 0}
    original = EngineCore.step

    def failing_step(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in step")
        return original(self)

    monkeypatch.setattr(EngineCore, "step", failing_step)
    llm = AsyncLLM(str(smollm2_path), multiprocessing=False)   # the core in a thread

    async def scenario():
        with pytest.raises(EngineDeadError, match="RuntimeError: boom in step"):
            async for _ in llm.generate("Hello", LONG):
                pass

    asyncio.run(scenario())
    assert llm.errored
    llm.shutdown()


SCRIPT = textwrap.dedent("""
    import sys, time
    from vllm_actors import LLM
    llm = LLM(sys.argv[1])
    print(llm.engine.client.pid, llm.engine.client.addresses.directory, flush=True)
    if sys.argv[2] == "wait":
        time.sleep(600)
""")


def start_script(tmp_path, model, mode):
    script = tmp_path / "frontend.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(model), mode],
                            stdout=subprocess.PIPE, text=True)
    pid, ipc_dir = proc.stdout.readline().split()
    return proc, int(pid), ipc_dir


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_core_exits_when_the_frontend_is_killed(tmp_path, smollm2_path, sig):
    """No handler runs in the LLM's process either way: the core sees its parent go, exits
    and removes the ipc directory."""
    proc, core_pid, ipc_dir = start_script(tmp_path, smollm2_path, "wait")
    assert psutil.pid_exists(core_pid) and os.path.isdir(ipc_dir)
    proc.send_signal(sig)
    proc.wait()
    print(f"core exited {wait_until(lambda: gone(core_pid), 5):.2f}s after the frontend")
    wait_until(lambda: not os.path.exists(ipc_dir), 5)


def test_interpreter_exit_without_shutdown_leaves_nothing(tmp_path, smollm2_path):
    proc, core_pid, ipc_dir = start_script(tmp_path, smollm2_path, "exit")
    assert proc.wait(timeout=60) == 0
    wait_until(lambda: gone(core_pid), 5)
    assert not os.path.exists(ipc_dir)


def test_context_manager_and_repeated_shutdown(smollm2_path):
    with LLM(str(smollm2_path)) as llm:
        pid, ipc_dir = llm.engine.client.pid, llm.engine.client.addresses.directory
        out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=3))[0]
        assert len(out.outputs[0].token_ids) == 3
    assert gone(pid) and not os.path.exists(ipc_dir)
    llm.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate("Hi", SamplingParams(max_tokens=3))
    # dropped without shutdown, once used: collected, it ends its core and loop thread
    dropped = LLM(str(smollm2_path))
    dropped.generate("Hi", SamplingParams(max_tokens=2))
    pid, thread = dropped.engine.client.pid, dropped._thread
    del dropped
    gc.collect()
    wait_until(lambda: gone(pid) and not thread.is_alive(), 10)
    # an AsyncLLM dropped inside a loop that goes on running: its core is ended as soon as
    # it is collected (its output task had held it, and its core, until the loop closed)

    async def drop_inside_the_loop():
        engine = AsyncLLM(str(smollm2_path))
        async for _ in engine.generate("Hi", SamplingParams(max_tokens=2), "r"):
            pass
        pid = engine.client.pid
        del engine
        gc.collect()
        await asyncio.sleep(0)
        wait_until(lambda: gone(pid), 10)
    asyncio.run(drop_inside_the_loop())


def test_thread_mode_gives_the_same_tokens(smollm2_path, smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    with LLM(str(smollm2_path), gguf_activations="float32",
             multiprocessing=False) as threaded:
        assert threaded.engine.client.pid is None
        a = threaded.generate("The capital of France is", params)[0].outputs[0].token_ids
    b = smollm2_llm.generate("The capital of France is", params)[0].outputs[0].token_ids
    assert a == b
