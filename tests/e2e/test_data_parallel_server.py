"""`serve --data-parallel-size 2`: per-engine metrics; a SIGKILLed engine core fails only its
own streams (within 2 s), /health says "degraded" while the other core keeps serving, and a
replacement core starts and rejoins; nothing is left running after SIGTERM."""

import json
import os
import re
import signal
import threading
import time

import httpx
import psutil
from server_process import ServerProcess

STREAM = {"prompt": "Count:", "max_tokens": 300, "ignore_eos": True, "temperature": 0,
          "stream": True}


def core_pids(server: ServerProcess) -> list[int]:
    return [p.pid for p in psutil.Process(server.proc.pid).children()
            if "enginecore" in " ".join(p.cmdline())]


def stream(url: str, result: dict) -> threading.Thread:
    """Stream STREAM in a thread; `result["events"]` gets (monotonic time, data) pairs."""
    def run():
        result["events"] = []
        with httpx.stream("POST", url + "/v1/completions", json=STREAM, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    result["events"].append((time.monotonic(), line[6:]))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def per_engine(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    found: dict[str, float] = {}
    for engine, value in re.findall(rf'^{re.escape(name)}\{{engine="(\d+)"[^}}]*\}} (\S+)$',
                                    text, re.M):
        found[engine] = found.get(engine, 0.0) + float(value)
    return found


def plain(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_dead_core_is_routed_around_and_replaced(smollm2_path):
    server = ServerProcess(str(smollm2_path), "--data-parallel-size", "2")
    url = server.url
    cores, new_cores = [], []
    try:
        cores = core_pids(server)
        assert len(cores) == 2
        assert set(per_engine(url, "vllm:num_requests_running")) == {"0", "1"}
        results = [{} for _ in range(4)]
        threads = [stream(url, r) for r in results]
        wait_for(lambda: all(len(r.get("events", [])) > 3 for r in results), 60,
                 "four streams")
        assert per_engine(url, "vllm:num_requests_running") == {"0": 2.0, "1": 2.0}
        killed_at = time.monotonic()
        os.kill(cores[1], signal.SIGKILL)
        health = wait_for(lambda: (r := httpx.get(url + "/health", timeout=5)).content and r,
                          2.0, "a degraded /health")
        assert health.status_code == 200
        assert health.json() == {"status": "degraded", "engines_alive": 1,
                                 "data_parallel_size": 2}
        # the other core serves new requests meanwhile
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        for thread in threads:
            thread.join(120)
        failed = [r for r in results if "error" in r["events"][-2][1]]
        finished = [r for r in results if '"finish_reason":"length"' in r["events"][-2][1]]
        assert len(failed) == 2 and len(finished) == 2
        for r in failed:
            when, data = r["events"][-2]
            assert json.loads(data)["error"]["code"] == "engine_dead"
            assert when - killed_at < 2.0, when - killed_at
        assert plain(url, "vllm_actors:engine_deaths_total") == 1.0

        # the replacement starts and rejoins
        wait_for(lambda: (r := httpx.get(url + "/health", timeout=5)).status_code == 200
                 and not r.content, 120, "the restarted core")
        assert plain(url, "vllm_actors:engine_restarts_total") == 1.0
        assert plain(url, "vllm_actors:engines_alive") == 2.0
        new_cores = core_pids(server)
        assert len(new_cores) == 2 and cores[0] in new_cores and cores[1] not in new_cores
        before = per_engine(url, "vllm:request_success_total")
        bodies = [{"prompt": f"Item {i}:", "max_tokens": 30} for i in range(4)]
        responses = [None] * 4

        def post(i):
            responses[i] = httpx.post(url + "/v1/completions", json=bodies[i], timeout=60)
        posting = [threading.Thread(target=post, args=(i,)) for i in range(4)]
        for t in posting:
            t.start()
        for t in posting:
            t.join(60)
        assert all(r.status_code == 200 for r in responses)
        after = per_engine(url, "vllm:request_success_total")
        assert after["1"] > before.get("1", 0.0)
    finally:
        assert server.stop() == 0, server.log()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                   for p in cores + new_cores)
