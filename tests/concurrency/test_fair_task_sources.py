"""Every way a task enters a fair queue takes part in the turns, under a real worker that
also runs the scheduler and the recovery leader (keyless adoption): scheduled tasks, a depends_on
child released by its parent, a workflow's steps, and keyless rows an older replica inserts while a
noisy tenant's backlog is being drained. Each must start before the noisy tenant's backlog ends.

Found by breaker 33 (the bug hunt on fair queues, unique windows and debounce)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.db import connection

from tasks.models import Task
from tasks.workflows import chain, step
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

QUEUE = "sources33"
SCHEDULES = {"tick33": {"task": NOOP, "interval": 1, "queue": QUEUE, "catch_up": "skip", "kwargs": {"from": "tick"}}}
#: Enough that the drain outlasts the test: since keys with nothing due take no turn, the worker
#: drains the backlog here at 750 to 1,000 a second (320 to 390 before; 6,000 ran out once).
BACKLOG = 15000


def database_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


def test_scheduled_dependant_workflow_and_keyless_tasks_take_turns_beside_a_noisy_backlog(
    workers: Workers, settings: Any
) -> None:
    settings.LEASING_TASKS = {**getattr(settings, "LEASING_TASKS", {}), "FAIR_QUEUES": [QUEUE]}
    Task.objects.bulk_enqueue(NOOP, [{}] * BACKLOG, queue=QUEUE, fair_key="a-noisy")
    parent = Task.objects.enqueue(NOOP, queue=QUEUE, fair_key="parent", kwargs={"role": "parent"})
    child = Task.objects.enqueue(NOOP, queue=QUEUE, depends_on=[parent.id], kwargs={"role": "child"})
    first, second = (step(NOOP, role=role).options(queue=QUEUE) for role in ("s1", "s2"))
    flow_id = chain(first, second, pipe=False).enqueue().id
    workers.start(
        "sources",
        *("--queues", QUEUE, "--concurrency", "4", "--batch-size", "4"),
        LEASING_TEST_FAIR_QUEUES=QUEUE,
        LEASING_TEST_SCHEDULES=json.dumps(SCHEDULES),
    )
    noisy = Task.objects.filter(queue=QUEUE, fair_key="a-noisy")
    wait_until(lambda: noisy.filter(started_at__isnull=False).count() >= 200, 60, what="the drain under way")
    # An older replica's enqueues (no key) in the middle of the drain.
    keyless = Task.objects.bulk_enqueue(NOOP, [{"role": "keyless"}] * 10, queue=QUEUE)
    Task.objects.filter(pk__in=keyless).update(fair_key=None)
    # A keyless row takes turns from its adoption on: the time it is first seen adopted (a poll's
    # length late at most, which only loosens the count), not a fixed round after the insert (CI's
    # loaded 6.1 leg once adopted them a couple of seconds late: 1,651 noisy starts counted).
    wait_until(
        lambda: not Task.objects.filter(pk__in=keyless, fair_key__isnull=True, started_at__isnull=True).exists(),
        60,
        what="the keyless rows adopted (or started)",
    )
    adopted_at = database_now()
    special = Task.objects.filter(queue=QUEUE).exclude(fair_key="a-noisy")
    wait_until(
        lambda: not special.exclude(status="SUCCESSFUL").exists() and special.filter(kwargs__from="tick").count() >= 3,
        240,
        what="every special task done, three ticks among them",
    )
    # the ticks the scheduler enqueues from now on are not looked at
    done = Task.objects.filter(pk__in=list(special.filter(status="SUCCESSFUL").values_list("pk", flat=True)))
    # Each was served while the noisy backlog still waited: not one waited behind it. (How many noisy
    # starts came between a task's due time and its start is a share of a drain's speed and of the
    # worker's rescan interval, printed here; bench/fair_claims.py measures the claims' shares.)
    assert noisy.exclude(status="SUCCESSFUL").exists(), "the backlog was drained: nothing proven"
    worst = 0
    for task in done.order_by("id"):
        due = task.enqueued_at
        if task.id == child.id:
            due = Task.objects.get(pk=parent.id).finished_at
        elif task.workflow_id == flow_id and task.kwargs.get("role") == "s2":
            due = Task.objects.get(workflow_id=flow_id, kwargs__role="s1").finished_at
        elif task.kwargs.get("role") == "keyless":
            due = adopted_at
        passed = noisy.filter(started_at__gt=max(due, task.run_after), started_at__lt=task.started_at)
        worst = max(worst, passed.count())
    print(f"{done.count()} tasks beside the backlog; at most {worst} noisy starts between one's due time and start")
    # the ticks, the child and the steps were written with a key (the shared one); a keyless row
    # may have been claimed by a claim's fill before its adoption
    keyed = done.exclude(kwargs__role="keyless").exclude(pk=parent.id)
    assert set(keyed.values_list("fair_key", flat=True)) == {""}
