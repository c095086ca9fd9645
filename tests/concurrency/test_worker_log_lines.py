"""A worker in a project made by ``django-admin startproject`` (DEBUG on, no LOGGING: Django's
DEFAULT_LOGGING alone) prints each task's state change once (issue 56: on Django 6 every one was
printed twice, with its traceback twice, once by Django's DEBUG console handler and once by the
handler ``run_worker`` puts on the root logger).

Django 6 logs a django.tasks Task's start and end under ``django.tasks``; DEFAULT_LOGGING's console
handler (DEBUG only) on the ``django`` logger prints them, and the record goes on to the root logger.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import django
import pytest

from tasks.models import FINISHED, Task
from tests.helpers import start_manage, stop_process, wait_until
from tests.testapp import handlers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

QUEUE = "loglines"


def test_each_state_change_is_printed_once_under_startproject_defaults(tmp_path: Path, settings: Any) -> None:
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "MAX_ATTEMPTS": 1}  # one attempt each
    ok = handlers.add.using(queue_name=QUEUE).enqueue(2, 3).id
    bad = handlers.explode.using(queue_name=QUEUE).enqueue().id
    ids = {int(ok), int(bad)}
    log = tmp_path / "worker.log"
    proc = start_manage(
        log,
        "run_worker",
        *("--queues", QUEUE, "--worker-id", "loglines", "--max-tasks", "2", "--no-recovery", "--no-scheduler"),
        DEBUG="true",
        LEASING_TEST_NO_LOGGING="1",
    )
    try:
        wait_until(lambda: Task.objects.filter(pk__in=ids, status__in=FINISHED).count() == 2, 60, what="both tasks")
        assert proc.wait(60) == 0
    finally:
        stop_process(proc)
    text = log.read_text()
    lines = text.splitlines()
    for task_id, end in ((ok, "SUCCESSFUL"), (bad, "FAILED")):
        for state in ("RUNNING", end):
            said = [line for line in lines if f"Task id={task_id} " in line and line.endswith(f"state={state}")]
            # Django 6 logs each state change (django.tasks); the 5.2 backport may not: never twice.
            if django.VERSION >= (6, 0):
                assert len(said) == 1, f"task {task_id} {state}: {said}\n{text}"
            else:
                assert len(said) <= 1, f"task {task_id} {state}: {said}\n{text}"
    # The worker's own line for each attempt's end, once; the failure's traceback, once.
    assert sum(f"task {ok} tests.testapp.handlers.add succeeded" in line for line in lines) == 1, text
    assert sum(f"task {bad} tests.testapp.handlers.explode FAILED for good" in line for line in lines) == 1, text
    assert text.count("Traceback (most recent call last)") == 1, text
