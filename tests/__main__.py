"""The whole suite as the README's test command runs it: ``.venv/bin/python -m tests [pytest args]``.

One pass of pytest on ``LEASING_TEST_WORKERS`` pytest-xdist workers (3 unless set), a file per worker
at a time, each worker with its own test database (made by pytest-django) on one throwaway
PostgreSQL (tests/settings.py). No test's verdict depends on the machine's speed: rates, shares and
deadlines are benchmarks (bench/, docs/explanation/benchmarks.md), so nothing needs a quiet machine
and nothing runs alone. ``pytest`` alone still runs everything in one process (docs/CONTRIBUTING.md).
"""

from __future__ import annotations

import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    workers = os.environ.get("LEASING_TEST_WORKERS", "3")
    # The 30 slowest tests close the output: where the CI's minutes go.
    report = ["-rfE", "--durations=30", "--durations-min=5"]
    command = [sys.executable, "-m", "pytest", "-n", workers, "--dist", "loadfile", *report, *argv]
    print(f"== {' '.join(command[1:])}", flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
