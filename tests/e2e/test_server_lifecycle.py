"""Server start and stop: a dead engine answers 503, SIGTERM drains, flags are checked."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from server_process import ServerProcess, wait_metric

LONG = {"prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
        "stream": True}


def stream_in_thread(url: str, body: dict, result: dict) -> threading.Thread:
    def run():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                result["status"] = r.status_code
                result["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]
        except httpx.HTTPError as e:
            result["error"] = repr(e)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def core_pid(server: ServerProcess) -> int:
    (child,) = [p for p in psutil.Process(server.proc.pid).children()
                if "enginecore" in " ".join(p.cmdline())]
    return child.pid


def test_dead_engine_answers_503(smollm2_path):
    server = ServerProcess(str(smollm2_path))
    try:
        os.kill(core_pid(server), signal.SIGKILL)
        time.sleep(0.5)
        r = httpx.get(server.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                       json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and "exited unexpectedly" in r.json()["error"]["message"]
    finally:
        assert server.stop() == 0


def test_sigterm_drains_running_requests(smollm2_path):
    server = ServerProcess(str(smollm2_path), "--drain-timeout", "60")
    core = core_pid(server)
    result: dict = {}
    thread = stream_in_thread(server.url, LONG, result)
    wait_metric(server.url, "vllm:num_requests_running", lambda v: v >= 1, timeout=30)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):   # no longer accepting connections
        httpx.get(server.url + "/health", timeout=5)
    thread.join(120)
    assert server.proc.wait(60) == 0
    final = json.loads(result["events"][-2][6:])
    assert result["events"][-1] == "data: [DONE]"
    assert final["choices"][0]["finish_reason"] == "length"     # finished, not cut off
    assert not psutil.pid_exists(core) or psutil.Process(core).status() == "zombie"


def test_sigterm_aborts_what_outlives_the_drain(smollm2_path):
    server = ServerProcess(str(smollm2_path), "--drain-timeout", "1")
    result: dict = {}
    thread = stream_in_thread(server.url, {**LONG, "max_tokens": 5000}, result)
    time.sleep(2.0)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert server.proc.wait(60) == 0 and time.monotonic() - start < 20
    final = json.loads(result["events"][-2][6:])
    assert final["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize("flags, message", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not implemented yet"),
    (["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"],
     "--distributed-executor-backend ray is not supported yet"),
    (["--tensor-parallel-size", "2", "--distributed-executor-backend", "uni"],
     "--distributed-executor-backend uni runs one worker"),
    (["--device", "tpu"], "--device tpu is not implemented yet"),
    (["--allowed-origins", "*"], "--allowed-origins must be a JSON list"),
])
def test_bad_flags_fail_clearly(flags, message):
    r = subprocess.run([sys.executable, "-m", "vllm_actors", "serve", *flags],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
