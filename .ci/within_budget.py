"""Run a test command, print its wall time, and fail when it takes longer than the budget.

    python .ci/within_budget.py python -m pytest -q --durations=10

The budget is CI_TEST_BUDGET_S seconds (default 1500: 25 minutes, the bound on the 20-minute
target of a 2-core machine). Over the budget the exit status is 1 even if every test passed,
and the message names the slowest tests from pytest's `--durations` table. Otherwise the exit
status is the command's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

DEFAULT_BUDGET_S = 1500.0


def slowest_lines(lines: list[str], count: int = 10) -> list[str]:
    """The rows of pytest's last "slowest N durations" table (at most `count`)."""
    starts = [i for i, line in enumerate(lines) if "slowest" in line and "durations" in line]
    if not starts:
        return []
    rows = []
    for line in lines[starts[-1] + 1:]:
        parts = line.split()
        if len(parts) >= 3 and parts[0].endswith("s") and parts[1] in ("setup", "call",
                                                                        "teardown"):
            rows.append(line.rstrip())
        elif rows or line.startswith("="):
            break
    return rows[:count]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    budget = float(os.environ.get("CI_TEST_BUDGET_S", DEFAULT_BUDGET_S))
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    status = proc.wait()
    elapsed = time.monotonic() - start
    print(f"\ntest suite wall time: {elapsed:.0f} s ({elapsed / 60:.1f} min; budget "
          f"{budget:.0f} s)", flush=True)
    if elapsed > budget:
        print(f"FAILED: the test run took {elapsed:.0f} s, over its budget of {budget:.0f} s "
              f"(CI_TEST_BUDGET_S). The slowest tests:", file=sys.stderr)
        for row in slowest_lines(lines) or ["(no --durations table in the output)"]:
            print(f"  {row}", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
