"""The time each lane of the suite took (docs/CONTRIBUTING.md): the tests' own durations (setup, call,
teardown) summed per directory under tests/, printed at the end of every run, so that the lanes'
figures in the docs can be read off any run, CI's included."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

_SPENT: dict[str, float] = defaultdict(float)
_COUNT: dict[str, int] = defaultdict(int)


def _lane(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    lane = _lane(report.nodeid)
    _SPENT[lane] += report.duration
    if report.when == "call":
        _COUNT[lane] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _SPENT:
        return
    lanes = sorted(_SPENT, key=lambda lane: -_SPENT[lane])
    terminalreporter.write_sep("-", "time per lane (tests/<lane>/: tests run, seconds spent in them)")
    for lane in lanes:
        terminalreporter.write_line(f"{lane:<14} {_COUNT[lane]:>5} tests {_SPENT[lane]:>8.1f} s")
