"""Installed size of the runtime: a fresh virtualenv, `pip install .` (no extras, no CUDA),
then the size of site-packages, largest packages listed.

    python bench/install_size.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        empty = size(venv)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(ROOT)], check=True)
        site = next(venv.glob("lib/python*/site-packages"))
        total = size(venv) - empty
        tooling = {"pip", "setuptools", "_distutils_hack", "pkg_resources"}
        packages = sorted(((size(p), p.name) for p in site.iterdir() if p.is_dir()
                           and p.name not in tooling
                           and not p.name.endswith((".dist-info", "__pycache__"))), reverse=True)
    print(f"| runtime install (fresh venv, `pip install .`) | {total / 2**20:.0f} MiB |")
    print("|---|---|")
    for nbytes, name in packages[:8]:
        print(f"| {name} | {nbytes / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
