"""A failed or timed-out attempt is recorded with its real start and its end (issue 56: both showed
"Duration 0.000 s", start equal to end).

A short attempt's start marker rides on the statement that records its end (tasks/lifecycle/finish.py);
the fail statement used to stamp that start with its own clock, so the attempt's error entry said it
began when it ended. A real worker runs each handler; the handler reads the database clock itself, so
the checks are orderings on that clock, not durations against a threshold of the machine's speed.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pytest
from django.test import Client

from tasks.models import Task
from tasks.web import attempts
from tasks.worker import dispatcher
from tasks.worker.process import Worker
from tests.helpers import wait_until, worker_in_thread
from tests.testapp import handlers

pytestmark = pytest.mark.django_db(transaction=True)

#: The task's timeout, in seconds.
TIMEOUT = 1


@pytest.fixture(params=["marker-on-the-end", "marker-first"])
def worker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Worker]:
    """A worker in a thread. "marker-on-the-end": its start markers wait longer than any attempt here
    lasts, so each attempt's start rides on the statement that records its end (as a short attempt's
    does, and one whose marker waited behind the dispatcher's poll); "marker-first": as configured."""
    if request.param == "marker-on-the-end":
        monkeypatch.setattr(dispatcher, "MARKER_DELAY", 600.0)
    with worker_in_thread(
        Worker(concurrency=2, ttl=5, recovery_interval=0.1, install_signal_handlers=False)
    ) as running:
        yield running


def ended(task_id: int) -> Task:
    return wait_until(
        lambda: Task.objects.filter(pk=task_id, status="FAILED").first(), 30, what=f"task {task_id} to fail"
    )


def durations_shown(page: str) -> list[str]:
    table = page.split('<table id="attempts">', 1)[1].split("</table>", 1)[0]
    return re.findall(r"<td>([0-9.]+) s</td>", table)


def test_a_failed_attempt_records_the_start_before_its_work_and_the_end_after(worker: Worker, staff: Client) -> None:
    key = "fails-after-work"
    task_id = Task.objects.enqueue(
        "tests.testapp.handlers.work_then_fail", kwargs={"key": key, "work": 0.05}, max_attempts=1
    ).id
    task = ended(task_id)
    began_work, finished_work = handlers.CLOCK_READINGS.pop(key)

    [attempt] = attempts.history(task).attempts
    assert attempt.outcome == "Failed"
    assert attempt.started_at is not None and attempt.ended_at is not None
    assert attempt.started_at <= began_work < finished_work <= attempt.ended_at
    assert task.last_attempted_at == attempt.started_at  # the entry's start is the attempt's start
    assert durations_shown(staff.get(f"/dashboard/tasks/{task_id}/").content.decode()) != ["0.000"]


def test_a_timed_out_attempt_records_the_start_before_the_handler_ran(worker: Worker, staff: Client) -> None:
    key = "overruns"
    handlers.RELEASES[key] = threading.Event()
    try:
        task_id = Task.objects.enqueue(
            "tests.testapp.handlers.read_clock_then_overrun", kwargs={"key": key}, timeout=TIMEOUT, max_attempts=1
        ).id
        task = ended(task_id)
    finally:
        handlers.RELEASES.pop(key).set()  # the abandoned handler's thread ends
    [began] = handlers.CLOCK_READINGS.pop(key)

    [attempt] = attempts.history(task).attempts
    assert attempt.error is not None and attempt.error["exception_class_path"] == "tasks.exceptions.TaskTimeout"
    assert attempt.started_at is not None and attempt.ended_at is not None
    assert attempt.started_at <= began <= attempt.ended_at
    # The worker gave the handler its whole timeout before recording the end.
    assert attempt.duration is not None and attempt.duration >= TIMEOUT
    shown = durations_shown(staff.get(f"/dashboard/tasks/{task_id}/").content.decode())
    assert len(shown) == 1 and float(shown[0]) >= TIMEOUT
