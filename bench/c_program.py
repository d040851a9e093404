"""A C source built with the system's compiler, for the probes that time single instructions
(`amx_probe.py`, `vector_ports.py`)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def built(source: str, flags: list[str]) -> Iterator[Path | None]:
    """The executable built from `source` with `flags` (in a temporary folder, removed on
    exit), or None, the reason printed, where there is no compiler or it refuses the flags."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        print("no C compiler here", file=sys.stderr)
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        path, binary = Path(tmp) / "probe.c", Path(tmp) / "probe"
        path.write_text(source)
        done = subprocess.run([cc, *flags, str(path), "-o", str(binary)], capture_output=True,
                              text=True)
        if done.returncode:
            print(done.stderr, file=sys.stderr)
            yield None
            return
        yield binary
