"""The worker's record of a failed attempt that will be retried says when the retry is due (issue 38,
item 7): the delay the fail statement set (its ``run_after`` minus the database clock), beside the
attempt's own run time. It used to print the run time where the delay belonged ("failed, will retry in
0.048s" for a retry 0.86 s later)."""

from __future__ import annotations

import logging
import re

import pytest

from tasks.models import Task
from tasks.worker.process import Worker
from tests.helpers import wait_until, worker_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "retrylog"
RECORD = re.compile(r"failed in (?P<ran>\d+\.\d{3})s \(attempt 1\), will retry in (?P<delay>\d+\.\d{3})s: ")


def test_a_retried_attempt_is_logged_with_its_run_time_and_the_delay_until_its_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Its retry policy backs off 1000 + attempt seconds: the retry is due 1001 s after the failure.
    task_id = Task.objects.enqueue("tests.testapp.outcome_handlers.slow_backoff", queue=QUEUE, max_attempts=3).id
    caplog.set_level(logging.WARNING, logger="tasks.worker")
    worker = Worker(queues=[QUEUE], install_signal_handlers=False, recovery=False, scheduler=False, poll_interval=0.05)
    with worker_in_thread(worker):
        wait_until(lambda: Task.objects.filter(pk=task_id, status="READY", failures=1).exists(), 30, what="the failure")
        [record] = wait_until(
            lambda: [r for r in caplog.records if getattr(r, "task_id", None) == task_id], 30, what="its record"
        )
    message = record.getMessage()
    assert record.outcome == "retried" and record.levelname == "WARNING", message
    found = RECORD.search(message)
    assert found is not None, message
    ran, delay = float(found["ran"]), float(found["delay"])
    assert ran < 10.0, message
    # The delay the statement set: run_after minus the clock it read when it failed the attempt
    # (released_at, the same statement's clock), give or take the statement's own microseconds.
    row = Task.objects.get(pk=task_id)
    assert row.released_at is not None
    stored = (row.run_after - row.released_at).total_seconds()
    assert 1000.9 < stored < 1001.01, stored
    assert abs(delay - stored) < 0.01, (delay, stored, message)
