"""The README's "Three examples", run as written against the real database (only the names they leave
to the reader, ``chunks``, ``process`` and ``run_due_jobs``, are given here)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tasks.compat import FRAMEWORK, TaskResultStatus
from tasks.worker import Worker
from tests.helpers import wait_until, worker_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks() -> list[tuple[str, str]]:
    text = README.read_text()
    section = text.split("## Three examples", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def test_the_section_has_three_python_examples_and_a_worker_command() -> None:
    langs = [lang for lang, _ in blocks()]
    assert langs == ["python", "python", "sh", "python"]
    assert blocks()[2][1].startswith("python manage.py run_worker ")


def test_the_lease_example_processes_each_chunk_under_one_fencing_token() -> None:
    done: list[tuple[str, int]] = []
    namespace: dict[str, Any] = {"chunks": ["a", "b"], "process": lambda chunk, fence: done.append((chunk, fence))}
    exec(blocks()[0][1], namespace)
    tokens = {fence for _chunk, fence in done}
    assert [chunk for chunk, _ in done] == ["a", "b"] and len(tokens) == 1 and tokens.pop() > 0


def test_the_task_example_runs_once_on_a_worker(settings: Any) -> None:
    # A module of its own, as the example would be in an app (django.tasks wants an importable path).
    module = types.ModuleType("readme_task_example")
    sys.modules[module.__name__] = module
    try:
        # On Django 5.2 the README has you write ``from django_tasks import task`` (the backport).
        exec(blocks()[1][1].replace("from django.tasks import", f"from {FRAMEWORK} import"), module.__dict__)
        result = module.result
        assert result.status == TaskResultStatus.READY
        args = blocks()[2][1].split()
        queues = args[args.index("--queues") + 1].split(",")
        worker = Worker(queues=queues, max_tasks=1, install_signal_handlers=False, recovery=False, worker_id="readme")
        with worker_in_thread(worker):  # stopped on the way out, should the task never reach it
            wait_until(
                lambda: (result.refresh(), result.status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED))[1],
                what="the example's task to finish",
            )
        assert result.status == TaskResultStatus.SUCCESSFUL and result.attempts == 1
    finally:
        del sys.modules[module.__name__]


def test_the_election_example_leads_with_a_token_and_hands_over_on_stop() -> None:
    led: list[int] = []
    namespace: dict[str, Any] = {}

    def run_due_jobs(fence: int) -> None:
        led.append(fence)
        namespace["election"].stop()  # the one leader steps down: run() returns

    namespace["run_due_jobs"] = run_due_jobs
    exec(blocks()[3][1], namespace)
    assert len(led) >= 1 and led[0] > 0
