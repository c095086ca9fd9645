"""A timeout is noticed when it passes, not at the worker's next poll (issue 56).

The dispatcher sized its wait from the counts it read before the round's claim: right after claiming
an attempt it knew of nothing unstarted and no deadline, and slept the whole poll interval, so an
attempt's timeout (and its start marker) waited for the poll. Here the poll interval is ten minutes
and the timeout one second: the attempt must be recorded as timed out long before any poll, with no
NOTIFY, outcome or other wake-up to rescue the dispatcher (one task, one worker)."""

from __future__ import annotations

import threading

import pytest

from tasks.models import Task
from tasks.models import Worker as WorkerRow
from tasks.web import attempts
from tasks.worker.process import Worker
from tests.helpers import wait_until, worker_in_thread
from tests.testapp import handlers

pytestmark = pytest.mark.django_db(transaction=True)

#: The worker's poll interval: what a timeout noticed at the next poll would wait for.
POLL = 600.0


@pytest.mark.parametrize("enqueued", ["before the worker started", "while it waits"])
def test_a_timeout_is_recorded_long_before_the_next_poll(enqueued: str) -> None:
    key = f"overruns {enqueued}"
    handlers.RELEASES[key] = threading.Event()
    task_id = None

    def enqueue() -> int:
        return Task.objects.enqueue(
            "tests.testapp.handlers.read_clock_then_overrun", kwargs={"key": key}, timeout=1, max_attempts=1
        ).id

    try:
        if enqueued == "before the worker started":
            task_id = enqueue()
        worker = Worker(concurrency=2, ttl=30, poll_interval=POLL, install_signal_handlers=False)
        with worker_in_thread(worker):
            if task_id is None:
                # Registered, the worker claims (nothing) and waits for a NOTIFY or the poll.
                wait_until(WorkerRow.objects.filter(id=worker.id).exists, 60, what="the worker to start")
                task_id = enqueue()
            # A ceiling for a hang, a fifth of the poll: a timeout noticed at the poll misses it.
            task = wait_until(
                lambda: Task.objects.filter(pk=task_id, status="FAILED").first(),
                POLL / 5,
                interval=0.1,
                what=f"task {task_id}'s timeout to be recorded",
            )
    finally:
        handlers.RELEASES.pop(key).set()  # the abandoned handler's thread ends
        handlers.CLOCK_READINGS.pop(key, None)
    [attempt] = attempts.history(task).attempts
    assert attempt.error is not None and attempt.error["exception_class_path"] == "tasks.exceptions.TaskTimeout"
    assert attempt.duration is not None and 1 <= attempt.duration < POLL / 5
