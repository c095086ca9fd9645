"""An operator's requeue of a workflow member inside a transaction held open, beside a worker that
finishes another member of the same workflow (issue 38, found by the attack on PostgreSQL 15 +
PgBouncer): the finish waits for the operator's commit (the workflow's settle is serialised on it),
and meanwhile

- the worker keeps claiming and running everything else (the waiting write goes in a round of its
  own, backed off, never in the round that claims);
- the finished attempt's lease is kept by the heartbeat for as long as the write waits, several TTLs
  here: it is not recovered, charged as a crash and run a second time;

and once the operator commits, every member and the callback end SUCCESSFUL, the held member's
handler having run once. The hold lasts a few TTLs by the database clock: that is the fault, not a
synchronisation; every wait polls the database.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import transaction

from tasks.lifecycle.states import TaskStatus
from tasks.models import Repair, Task
from tasks.models import Workflow as WorkflowRow
from tasks.workflows import group, step
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection
from tests.helpers.workers import Workers
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

#: Long enough that a loaded machine's late heartbeat still renews in time: what is proven is that the
#: heartbeat keeps a waiting finish's lease at all (it lapsed before the fix), not how promptly.
TTL = 6.0
HOLD_TTLS = 2
OTHERS = 40


def test_a_finish_behind_a_held_requeue_waits_without_losing_its_lease_or_the_worker(workers: Workers) -> None:
    Gate.objects.create(key="held", open=False)
    flow = group(
        [
            step("tests.testapp.handlers.record").options(queue="held-flow"),
            step("tests.testapp.handlers.block", gate="held").options(queue="held-flow"),
        ],
        then=step("tests.testapp.handlers.record").options(queue="held-flow"),
    ).enqueue()
    quick, blocked, callback = flow.task_ids
    workers.start("held", "--queues", "held-flow,held-other", "--concurrency", "4", "--ttl", str(int(TTL)))
    wait_until(
        lambda: (
            Task.objects.filter(pk=quick, status=TaskStatus.SUCCESSFUL).exists()
            and Effect.objects.filter(task_id=blocked, phase="started").exists()
        ),
        30,
        what="the quick member done and the blocked one running",
    )

    requeued, release = threading.Event(), threading.Event()

    def operator() -> int:
        with transaction.atomic():
            n = Task.objects.filter(pk=quick).requeue()
            requeued.set()
            assert release.wait(120)
        return n

    held = OnItsOwnConnection(operator)
    held.start()
    wait_until(requeued.is_set, 30, what="the requeue, uncommitted")
    Gate.objects.filter(key="held").update(open=True)
    wait_until(
        lambda: Effect.objects.filter(task_id=blocked, phase="finished").exists(), 30, what="the blocked handler to end"
    )
    ended = time.monotonic()

    # While the requeue is held: other work goes on, and the finished member stays RUNNING, leased.
    others = Task.objects.bulk_enqueue("tests.testapp.handlers.record", [{}] * OTHERS, queue="held-other")
    wait_until(
        lambda: Task.objects.filter(pk__in=others, status=TaskStatus.SUCCESSFUL).count() == OTHERS,
        60,
        what="the worker to run other tasks while one of its writes waits for the operator",
    )
    wait_until(lambda: time.monotonic() - ended > HOLD_TTLS * TTL, 60, what="the hold to outlast the TTL")
    row = Task.objects.get(pk=blocked)
    assert row.status == TaskStatus.RUNNING and row.crashes == 0, (row.status, row.crashes, row.errors)
    assert Task.objects.filter(pk=blocked, expires_at__gt=_db_now()).exists(), "its lease lapsed during the hold"

    release.set()
    assert held.outcome() == 1
    wait_until(
        lambda: not Task.objects.filter(pk__in=flow.task_ids).exclude(status=TaskStatus.SUCCESSFUL).exists(),
        60,
        what="every member and the callback to succeed after the commit",
    )
    row = Task.objects.get(pk=blocked)
    assert (row.attempts, row.crashes, row.errors) == (1, 0, []), (row.attempts, row.crashes, row.errors)
    assert Effect.objects.filter(task_id=blocked, phase="finished").count() == 1, "the held member ran twice"
    assert Effect.objects.filter(task_id=callback).count() == 1
    assert WorkflowRow.objects.get(pk=flow.id).status == "SUCCESSFUL"
    assert not Repair.objects.exists()


def _db_now() -> object:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]
