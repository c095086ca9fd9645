"""Durable steps, sleeps and events through a real PgBouncer in transaction pooling (issue 58): two
workers poll through a pool of three server connections, one of them SIGKILLed while tasks sleep and
wait. Each step's write commits exactly once (its fenced transaction is one pooled transaction),
every wait gets the payload sent to its task, every sleeper wakes and finishes, and no server
connection of the pool is left with a setting of ours."""

from __future__ import annotations

import os
import signal
from collections import Counter
from typing import Any

import pytest
from django.db import connection

from tasks.models import Task, TaskStep
from tasks.steps import send_event
from tests.concurrency.test_pgbouncer import settings_of_every_server_connection
from tests.helpers import wait_until
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.workers import Workers
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."
WAITERS, SLEEPERS = 30, 20


def suspended_on_the_event(ids: list[int]) -> set[int]:
    """The tasks whose wait has begun (its deadline step stored) and has not got its event."""
    waiting = set(TaskStep.objects.filter(task_id__in=ids, name="wait:go").values_list("task_id", flat=True))
    resolved = set(TaskStep.objects.filter(task_id__in=ids, name="event:go").values_list("task_id", flat=True))
    return waiting - resolved


def test_steps_sleeps_and_events_through_pgbouncer_with_a_kill(bouncer_pool_of_3: Bouncer, workers: Workers) -> None:
    dbname = connection.settings_dict["NAME"]
    pooled: dict[str, Any] = {"DATABASE_URL": bouncer_pool_of_3.url(dbname), "DATABASE_POOLED": "true"}
    waiters = [Task.objects.enqueue(H + "event_waiter", kwargs={"event": "go"}).id for _ in range(WAITERS)]
    sleepers = [Task.objects.enqueue(H + "sleeper", kwargs={"seconds": 1.0}).id for _ in range(SLEEPERS)]
    workers.start("sw-0", "--concurrency", "4", **pooled)
    workers.start("sw-1", "--concurrency", "4", **pooled)
    # Half the waiters suspended: their events go now, the rest after the kill.
    wait_until(lambda: len(suspended_on_the_event(waiters)) >= WAITERS // 2, 120, what="half the waits to begin")
    first = sorted(suspended_on_the_event(waiters))
    for task_id in first:
        assert send_event(task_id, "go", {"to": task_id})
    os.kill(workers.procs["sw-0"].pid, signal.SIGKILL)
    workers.procs["sw-0"].wait(30)
    workers.start("sw-2", "--concurrency", "4", **pooled)
    wait_until(
        lambda: len(suspended_on_the_event(waiters)) + len(first) >= WAITERS, 120, what="every other wait to begin"
    )
    for task_id in sorted(set(waiters) - set(first)):
        assert send_event(task_id, "go", {"to": task_id})
    every = [*waiters, *sleepers]
    wait_until(
        lambda: not Task.objects.filter(pk__in=every).exclude(status="SUCCESSFUL").exists(),
        180,
        what="every task to finish",
    )

    # Each step's write committed once, whatever attempt, kill or wake came between.
    runs = Counter(Effect.objects.filter(task_id__in=every).values_list("task_id", "phase"))
    expected = {(t, phase): 1 for t in waiters for phase in ("before-event", "after-event")}
    expected |= {(t, phase): 1 for t in sleepers for phase in ("before-sleep", "after-sleep")}
    assert dict(runs) == expected
    for task in Task.objects.filter(pk__in=waiters):
        assert task.return_value == {"payload": {"to": task.id}}, (task.id, task.return_value)
    steps = Counter(TaskStep.objects.filter(task_id__in=every).values_list("name", flat=True))
    assert steps == {
        "before": WAITERS + SLEEPERS, "wait:go": WAITERS, "event:go": WAITERS, "after": WAITERS + SLEEPERS,
        "nap": SLEEPERS,
    }  # fmt: skip

    for proc in workers.procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in workers.procs.values():
        proc.wait(60)
    # Every server connection of the pool, each read in a transaction of its own.
    assert set(settings_of_every_server_connection(bouncer_pool_of_3, dbname).values()) == {("0", "0")}
