"""Breaker (issue 20, item 8): the isolation reservation with a long attempt in the reserving worker."""

from __future__ import annotations

import pytest

from leasing.models import Lease
from tasks.models import Task, TaskStatus
from tests.helpers import wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."


def test_a_reservation_behind_a_long_attempt_does_not_starve_the_task_nor_idle_its_worker(workers: Workers) -> None:
    """Each busy worker also runs one long attempt (no timeout: a report, an import), beside a stream
    of short ones. The worker that reserves claims nothing until its long attempt ends and renews the
    queue's isolation lease meanwhile, so no other worker may reserve: the isolated task waits as long
    as that attempt (here: for ever), and the reserving worker's other executor stays idle all along,
    while the other worker runs hundreds of short tasks and is never idle."""
    Gate.objects.create(key="long")
    long_jobs = [
        Task.objects.enqueue(H + "block", kwargs={"gate": "long"}, priority=20, queue=queue).id
        for queue in ("default", "slow")
    ]
    Task.objects.bulk_enqueue(H + "work", [{"seconds": 0.05}] * 3000)
    workers.start("first", "--concurrency", "2", "--batch-size", "2")
    workers.start("second", "--concurrency", "2", "--batch-size", "2", "--queues", "default,slow")
    wait_until(
        lambda: Task.objects.filter(pk__in=long_jobs, attempt_started=True).count() == 2, 30, what="the long jobs"
    )
    for worker_id in workers.ids.values():  # both busy with short tasks beside their long one
        held = Task.objects.filter(holder=worker_id, status=TaskStatus.RUNNING)
        wait_until(lambda: held.count() >= 2, 30, what=f"{worker_id} busy")  # noqa: B023 (called at once)
    suspect = Task.objects.enqueue(H + "record", priority=10)
    Task.objects.filter(pk=suspect.id).update(shared_crashes=2)  # ISOLATE_AFTER: it must run alone
    lease = Lease.objects.active().filter(resource="tasks:isolation:default")
    wait_until(lease.exists, 30, 0.05, what="a worker to reserve")
    reserving = lease.get().holder
    done_by = Task.objects.filter(status=TaskStatus.SUCCESSFUL, worker_ids__contains=[reserving])
    before = done_by.count()
    try:
        wait_until(
            lambda: Task.objects.filter(pk=suspect.id, status=TaskStatus.SUCCESSFUL).exists(),
            12,
            0.2,
            what=f"the isolated task's turn ({reserving} reserved, holding a long attempt)",
        )
    finally:
        ran = done_by.count() - before
        Gate.objects.filter(key="long").update(open=True)
    assert ran > 0, "the reserving worker ran nothing beside its long attempt"
