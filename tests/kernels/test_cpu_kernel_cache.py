"""The CPU backend's compiled kernels are cached on disk even where the package directory is
read-only (a system-wide install): numba falls back to a per-user cache directory, and a
second process loads the kernel from there instead of compiling it.

Tests run as root here, which can write anywhere, so the in-tree location is made to fail the
way numba's own writability probe fails on a read-only directory (OSError)."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
from numba.core import caching

def read_only(self):
    raise PermissionError("read-only package directory")

in_tree = getattr(caching, "InTreeCacheLocator", None) or caching._InTreeCacheLocator
in_tree.ensure_cache_path = read_only
import numpy as np
from vllm_actors.kernels.cpu import elementwise
x = np.ones((2, 64), np.float32)
out = elementwise.rms_norm(x, np.ones(64, np.float32), 1e-6)
stats = elementwise._rms_norm_serial.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values()),
                  "ok": bool(np.allclose(out, 1.0))}))
"""


def run(env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_cache_in_the_user_directory_when_the_package_is_read_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)      # numba's per-user cache: $XDG_CACHE_HOME/numba
    first = run(env)
    assert first["ok"] and first["misses"] >= 1 and first["hits"] == 0
    cached = list((tmp_path / "numba").rglob("*.nbi"))
    assert any("elementwise" in p.name for p in cached)
    second = run(env)
    assert second["ok"] and second["hits"] >= 1 and second["misses"] == 0
