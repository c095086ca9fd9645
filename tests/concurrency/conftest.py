"""Fixtures shared by the tests with real processes, threads and connections."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import start_manage, stop_process
from tests.helpers.workers import Workers


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    """Worker processes started by the test, stopped after it."""
    started = Workers(tmp_path)
    yield started
    for name, proc in started.procs.items():
        stop_process(proc)
        # Shown by pytest for a failing test only: what each worker said.
        print(f"----- {name} (exit {proc.returncode}) -----\n{started.log(name)[-20_000:]}")


@pytest.fixture
def tenant_workers(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts ``run_worker`` processes of the queue "tenants" (fair unless ``fair=False``; 4 threads,
    claims of ``batch``, a poll every 0.2 s, the default lease and recovery: what they measure is the
    share each tenant gets, not a fault), stopped after the test."""
    started: list[subprocess.Popen[bytes]] = []

    def start(worker_id: str, *, batch: int, fair: bool = True) -> subprocess.Popen[bytes]:
        env = {"LEASING_TEST_FAIR_QUEUES": "tenants" if fair else ""}
        args = ["--queues", "tenants", "--concurrency", "4", "--batch-size", str(batch), "--poll-interval", "0.2"]
        proc = start_manage(tmp_path / f"{worker_id}.log", "run_worker", "--worker-id", worker_id, *args, **env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_process(proc)


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    """Processes the test starts itself and appends here; stopped after it."""
    started: list[Any] = []
    yield started
    for proc in started:
        stop_process(proc)
