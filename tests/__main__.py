"""The whole suite as the README's test command runs it: ``.venv/bin/python -m tests [pytest args]``.

Two passes of pytest, each on its own throwaway PostgreSQL (tests/settings.py):

1. every test not marked ``serial``, on ``LEASING_TEST_WORKERS`` pytest-xdist workers (3 unless
   set; each with its own test database, made by pytest-django), a file per worker at a time;
2. the tests marked ``serial``, one at a time: they measure a rate, a share or a deadline (20
   starts a second, a tenant's proportion of the starts, a demo that keeps up), which a machine
   loaded by the other workers would bend without anything being wrong.

``LEASING_TEST_PASSES=parallel`` runs the first pass only. The exit status is the first pass's
failure, else the second's; a pass that collected nothing (pytest's 5: the arguments named no test
of that kind) is not one. ``pytest`` alone still runs everything in one process
(docs/CONTRIBUTING.md)."""

from __future__ import annotations

import os
import subprocess
import sys

NO_TESTS_COLLECTED = 5


def main(argv: list[str]) -> int:
    workers = os.environ.get("LEASING_TEST_WORKERS", "3")
    # The 30 slowest tests of each pass close its output: where the CI's minutes go.
    report = ["-rfE", "--durations=30", "--durations-min=5"]
    parallel = [sys.executable, "-m", "pytest", "-n", workers, "--dist", "loadfile", *report, "-m", "not serial", *argv]
    alone = [sys.executable, "-m", "pytest", *report, "-m", "serial", *argv]
    # LEASING_TEST_PASSES=parallel runs the first pass only (.ci/run's second stack: what the serial
    # pass measures, rates and shares, is measured once, on the README's stack).
    passes = (parallel,) if os.environ.get("LEASING_TEST_PASSES") == "parallel" else (parallel, alone)
    codes = []
    for command in passes:
        print(f"== {' '.join(command[1:])}", flush=True)
        codes.append(subprocess.call(command))
    if all(code == NO_TESTS_COLLECTED for code in codes):
        return NO_TESTS_COLLECTED
    return next((code for code in codes if code not in (0, NO_TESTS_COLLECTED)), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
