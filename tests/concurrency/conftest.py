from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import stop_process
from tests.helpers.workers import Workers


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    """Worker processes started by the test, stopped after it (modules with their own ``workers``
    fixture keep it)."""
    started = Workers(tmp_path)
    yield started
    for name, proc in started.procs.items():
        stop_process(proc)
        # Shown by pytest for a failing test only: what each worker said.
        print(f"----- {name} (exit {proc.returncode}) -----\n{started.log(name)[-20_000:]}")
