"""The recovery's record about each task it recovers carries the task fields of every record about a
task (tasks.runtime.LOG_FIELDS): the task, its queue, the attempt, the worker that lost it, and how the
lost attempt ended (docs/howto/production.md, "Structured logs")."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tasks.maintenance.recovery import recover_once
from tasks.models import Task
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db

LOST = "lost-worker:0badc0de"


def test_each_recovered_task_is_logged_with_its_fields(caplog: pytest.LogCaptureFixture) -> None:
    started = Task.objects.enqueue("tests.testapp.handlers.noop", queue="recovered").id
    unstarted = Task.objects.enqueue("tests.testapp.handlers.noop", queue="recovered").id
    claimed = {c.id: c for c in Task.objects.claim(LOST, limit=2, queues=["recovered"], ttl=0.05)}
    assert Task.objects.start(started, LOST, claimed[started].token) is not None
    caplog.set_level(logging.INFO, logger="tasks.recovery")
    wait_until(lambda: recover_once(repair=False).requeued or None, 10, what="the leases to expire")

    records: dict[int, Any] = {
        r.task_id: r for r in caplog.records if r.name == "tasks.recovery" and hasattr(r, "task_id")
    }
    assert set(records) == {started, unstarted}
    ran, returned = records[started], records[unstarted]
    assert (ran.queue, ran.attempt, ran.worker_id, ran.outcome) == ("recovered", 1, LOST, "vanished")
    assert (returned.queue, returned.attempt, returned.worker_id, returned.outcome) == (
        "recovered",
        0,
        LOST,
        "returned",
    )
    assert ran.getMessage() == f"task {started}: lease of worker {LOST} expired (vanished); READY again"


def test_a_task_out_of_crashes_is_logged_failed(caplog: pytest.LogCaptureFixture, settings: Any) -> None:
    settings.LEASING_TASKS = {"MAX_CRASHES": 1}
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue="recovered").id
    (claimed,) = Task.objects.claim(LOST, queues=["recovered"], ttl=0.05)
    # Started alone in its process: its crash is its own (charged), and MAX_CRASHES is 1.
    assert Task.objects.start(task_id, LOST, claimed.token, isolated=True) is not None
    caplog.set_level(logging.INFO, logger="tasks.recovery")
    wait_until(lambda: recover_once(repair=False).failed or None, 10, what="the lease to expire")
    (record,) = [r for r in caplog.records if getattr(r, "task_id", None) == task_id]
    fields = record.__dict__
    assert (fields["outcome"], fields["attempt"], record.levelname) == ("failed", 1, "INFO")
    assert record.getMessage().endswith("FAILED for good")
