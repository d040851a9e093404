"""Time from `vllm-actors serve` to the first `/health` 200 (cold start: a new process that
imports, loads the model in the engine core and opens the port). Median of --runs.
`--cold`: each run with its own empty kernel cache (`NUMBA_CACHE_DIR`), as a fresh install
starts; without it the runs share the user's cache (warm after the first).

    python bench/serve_startup.py [--runs 3] [--cold] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_process import free_port  # noqa: E402


def one_start(model: list[str], cold: bool) -> float:
    if cold:
        cache = tempfile.mkdtemp(prefix="kernels-")
        try:
            return _start(model, dict(os.environ, NUMBA_CACHE_DIR=cache))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return _start(model, None)


def _start(model: list[str], env: dict[str, str] | None) -> float:
    port = free_port()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "vllm_actors", "serve", *model, "--port",
                             str(port), "--host", "127.0.0.1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:       # a socket until the port opens (cheap: the server compiles on
            if _port_open(port):      # both cores meanwhile), then /health
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health",
                                 timeout=1).status_code == 200:
                        return time.perf_counter() - start
                except httpx.HTTPError:
                    pass
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold", action="store_true",
                        help="each run with its own empty kernel cache")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    times = [one_start([args.model] if args.model else [], args.cold)
             for _ in range(args.runs)]
    what = "cold (empty kernel cache)" if args.cold else "with the user's kernel cache"
    print("| metric | median | runs |\n|---|---|---|")
    print(f"| `vllm-actors serve` to first /health 200, {what} | "
          f"{statistics.median(times):.2f} s | {', '.join(f'{t:.2f}' for t in times)} |")


if __name__ == "__main__":
    main()
