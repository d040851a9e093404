"""A real `vllm-actors serve` subprocess for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts the server on a free port and waits for /health; `log()` shows its output."""

    def __init__(self, *args: str, startup_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_actors", "serve", "--host", "127.0.0.1",
             "--port", str(self.port), *args],
            stdout=self.log_file, stderr=subprocess.STDOUT, env={**os.environ})
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        self.log_file.flush()
        with open(self.log_file.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def metric(url: str, name: str) -> float:
    """A gauge or counter value from the server's /metrics (first series of that name)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    if match is None:
        raise AssertionError(f"{name} not in /metrics")
    return float(match.group(1))


def wait_metric(url: str, name: str, predicate, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = metric(url, name)
        if predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} stayed at {value}")
        time.sleep(0.1)
