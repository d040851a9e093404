"""Ending an engine process once its work is done, without the interpreter's teardown.

After `atexit` handlers ran, CPython still clears every module and frees every object one by
one; in an engine core or worker that holds a model, numba's dispatchers and llvmlite's JIT
that took 0.25-0.3 s per process (docs/BENCHMARKS.md, "Engine shutdown"), which every
`shutdown()` waited for. The process's own resources go back to the system either way.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_process(code: int) -> None:
    """Run the atexit handlers (logging's flush among them), flush stdio, and exit with
    `code` at once. Call only from a process's main function, after its cleanup."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # closed or broken: nothing left to lose
            pass
    os._exit(code)
