"""Server start and stop: a dead engine answers 503, SIGTERM drains, flags are checked."""

import json
import os
import re
import signal
import statistics
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


def test_dead_engine_answers_503_when_kept_up(smollm2_path):
    server = ServerProcess(str(smollm2_path), "--no-exit-on-engine-death")
    try:
        os.kill(core_pid(server), signal.SIGKILL)
        time.sleep(0.5)
        r = httpx.get(server.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                       json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and "killed by signal SIGKILL" in \
            r.json()["error"]["message"]
        with httpx.stream("POST", server.url + "/v1/completions", timeout=10,
                          json={"prompt": "x", "stream": True}) as r:   # 503 before any 200
            assert r.status_code == 503
        time.sleep(2)
        assert server.proc.poll() is None
        assert re.search(r"ERROR .*killed by signal SIGKILL.*until the server is restarted",
                         server.log())
    finally:
        assert server.stop() == 0


def test_engine_death_fails_streams_and_exits_1(smollm2_path):
    """The core dies under a running stream: the stream gets an error event, one ERROR line
    names the cause, and the server exits with status 1 (systemd's Restart=on-failure)."""
    server = ServerProcess(str(smollm2_path))
    result: dict = {}
    thread = stream_in_thread(server.url, {**LONG, "max_tokens": 3000}, result)
    wait_metric(server.url, "vllm:num_requests_running", lambda v: v >= 1, timeout=30)
    os.kill(core_pid(server), signal.SIGKILL)
    thread.join(30)
    assert server.proc.wait(30) == 1
    error = json.loads(result["events"][-2][6:])["error"]
    assert error["code"] == "engine_dead" and result["events"][-1] == "data: [DONE]"
    errors = [line for line in server.log().splitlines() if " ERROR " in f" {line} "
              or line.startswith("ERROR")]
    assert len(errors) == 1 and "killed by signal SIGKILL" in errors[0] and \
        "exits in" in errors[0], server.log()


def test_hostile_template_then_a_dropped_stream_and_a_quick_sigterm(smollm2_path):
    """One server (trusting request templates) for two checks, the second ending it:
    - a trusted request template that loops for 10 s renders off the event loop: /health
      keeps answering (median under 50 ms, every probe under 1 s: a render on the loop would
      hold a probe for the whole 10 s, while CI on 2 cores has seen a single probe of 82 take
      0.4 s as the rendering thread ran), then the request gets a 400 from the render limit;
    - a client that drops its stream (the chat page's Stop button) is gone from the
      in-flight set at once: SIGTERM then exits in under 2 s instead of draining for it."""
    server = ServerProcess(str(smollm2_path), "--trust-request-chat-template")
    try:
        hostile_template_renders_off_the_loop(server)
        dropped_stream_leaves_nothing_and_sigterm_is_quick(server)
    finally:
        assert server.stop() == 0


def dropped_stream_leaves_nothing_and_sigterm_is_quick(server: ServerProcess) -> None:
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**LONG, "max_tokens": 3000}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    wait_metric(server.url, "vllm:num_requests_running", lambda v: v == 0, timeout=10)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    elapsed = time.monotonic() - start
    print(f"SIGTERM to exit: {elapsed:.2f}s")
    assert elapsed < 2.0, server.log()
    assert "draining: 0 request(s)" in server.log()


def hostile_template_renders_off_the_loop(server: ServerProcess) -> None:
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    result: dict = {}

    def hostile():
        result["r"] = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "chat_template": loop})
    thread = threading.Thread(target=hostile)
    thread.start()
    time.sleep(0.5)
    latencies = []
    with httpx.Client(timeout=5) as probe:   # one connection: time the server, not setup
        while thread.is_alive():
            start = time.monotonic()
            assert probe.get(server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.1)
    thread.join()
    median = statistics.median(latencies)
    print(f"/health during the render: {len(latencies)} probes, median {median * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms")
    assert len(latencies) > 20 and median < 0.05
    assert max(latencies) < 1.0
    r = result["r"]
    assert r.status_code == 400 and "longer than 10s" in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    assert ok.status_code == 200, ok.text


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


# each set catches its own check: argparse's own refusal, the kv dtype list, the executor
# choices, uni with several workers, an unimplemented device, pipeline stages without
# processes, a Ray-only address, a JSON flag
BAD_FLAGS = [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype 'int3' is not one of auto"),
    (["--tensor-parallel-size", "2", "--distributed-executor-backend", "slurm"],
     "argument --distributed-executor-backend: invalid choice: 'slurm'"),
    (["--tensor-parallel-size", "2", "--distributed-executor-backend", "uni"],
     "--distributed-executor-backend uni runs one worker"),
    (["--device", "tpu"], "--device tpu is not implemented yet"),
    (["-pp", "2", "--distributed-executor-backend", "uni"],
     "--pipeline-parallel-size 2 runs its stages as worker processes"),
    (["-dp", "2", "--data-parallel-address", "10.0.0.2"],
     "--data-parallel-address: only with --data-parallel-backend ray"),
    (["--allowed-origins", "*"], "--allowed-origins must be a JSON list"),
]
# `vllm-actors serve` (the command's own entry point, `python -m vllm_actors` = cli.main) on
# each flag set in one interpreter: its exit status and what it wrote to stderr
SERVE_EACH = """
import contextlib, io, json, sys
from vllm_actors.cli import main
results = []
for flags in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["serve", *flags])
        except SystemExit as e:
            code = e.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def test_bad_flags_fail_clearly():
    r = subprocess.run([sys.executable, "-c", SERVE_EACH, json.dumps([f for f, _ in BAD_FLAGS])],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    for (flags, message), (code, stderr) in zip(BAD_FLAGS, json.loads(r.stdout), strict=True):
        assert code == 2 and message in stderr, (flags, code, stderr)
