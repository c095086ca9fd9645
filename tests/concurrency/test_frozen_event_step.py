"""Real processes: a worker frozen (SIGSTOP) inside the wait's event step, after it read an event
that was sent while the task ran. Its task is recovered, and the recovery leader's round goes on for
every other task: nothing of the frozen step (no lock on the event's row) holds it up. (The event step
once marked the event delivered inside its transaction: the round waited on that row for as long as
the worker stayed frozen.)"""

from __future__ import annotations

import os
import signal

import pytest
from django.db import connection

from tasks.models import QueueControl, Task
from tasks.steps import send_event
from tests.helpers import wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def waiting_on_the_event_row() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT left(query, 120) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query ILIKE '%%tasks_taskevent%%' AND pid <> pg_backend_pid()"
        )
        return [row[0] for row in cursor.fetchall()]


def test_a_frozen_worker_inside_the_event_step_does_not_stall_recovery_of_other_tasks(workers: Workers) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.event_taken_then_frozen", queue="zq", max_attempts=5).id
    stale = workers.start("stale", "--queues", "zq", "--concurrency", "1", "--no-recovery", "--no-scheduler")
    wait_until(Task.objects.filter(pk=task_id, status="RUNNING").exists, 60, what="the first attempt")
    assert send_event(task_id, "go", {"v": 1})  # RUNNING: undelivered
    Gate.objects.create(key="sent", open=True)
    wait_until(Effect.objects.filter(task_id=task_id, phase="taken").exists, 60, what="the event taken")
    [token] = Effect.objects.filter(task_id=task_id, phase="taken").values_list("token", flat=True)
    os.kill(stale.pid, signal.SIGSTOP)
    # Its queue is paused (or every worker busy): once recovered, the task waits READY, unclaimed.
    QueueControl.objects.pause("zq")
    try:
        workers.start("fresh", "--queues", "zq", "--concurrency", "2", "--no-scheduler")
        # Its lease lapses: the fresh worker's recovery leader requeues it (paused: it stays READY).
        wait_until(Task.objects.filter(pk=task_id, status="READY").exists, 60, what="the frozen task's recovery")
        # A canary that needs recovery: its worker dies inside it; recovery must requeue it.
        workers.start(
            "crasher", "--queues", "crash", "--concurrency", "1", "--no-recovery", "--no-scheduler", may_die=True
        )
        canary = Task.objects.enqueue("tests.testapp.handlers.exit_after_start", queue="crash", max_attempts=3).id
        wait_until(lambda: workers.procs["crasher"].poll() is not None, 60, what="the crasher to die")
        workers.start("finisher", "--queues", "crash", "--concurrency", "1", "--no-recovery", "--no-scheduler")
        try:
            wait_until(Task.objects.filter(pk=canary, status="SUCCESSFUL").exists, 60, what="the canary's recovery")
        except AssertionError:
            raise AssertionError(
                f"recovery of an unrelated task stalled beside a frozen step: {waiting_on_the_event_row()}"
            ) from None
        assert waiting_on_the_event_row() == []
    finally:
        os.kill(stale.pid, signal.SIGCONT)
        Gate.objects.create(key=f"never:{token}", open=True)
        QueueControl.objects.resume("zq")
    wait_until(Task.objects.filter(pk=task_id, status="SUCCESSFUL").exists, 90, what="the waiting task")
