"""The isolation reservation with a long attempt in the reserving worker.

Found by breaker 20, item 8 (the bug hunt on issue 20: concurrency keys and worker identity at scale)."""

from __future__ import annotations

import pytest
from django.db import transaction

from leasing.models import Lease
from tasks.models import Task, TaskStatus
from tests.helpers import wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."


def test_a_reservation_behind_a_long_attempt_hands_the_turn_over(workers: Workers) -> None:
    """One busy worker also runs a long attempt (no timeout: a report, an import) beside a stream of
    short ones; the other runs short ones only. Before, whichever reserved kept the queue's isolation
    lease for as long as its attempts ran: with the long attempt, for ever (the isolated task never
    ran, and that worker's other executor idled all along). Now a reservation has a term (the TTL):
    a worker not idle by then hands the turn over, and resumes claiming."""
    Gate.objects.create(key="long")
    long_job = Task.objects.enqueue(H + "block", kwargs={"gate": "long"}, priority=20, queue="slow").id
    Task.objects.bulk_enqueue(H + "work", [{"seconds": 0.05}] * 3000)
    workers.start("long", "--concurrency", "2", "--batch-size", "2", "--queues", "slow,default")
    wait_until(lambda: Task.objects.filter(pk=long_job, attempt_started=True).exists(), 30, what="the long job")
    # It looks for isolated tasks every 2 s, the long job's worker every 0.2 s: the latter reserves first.
    workers.start("short", "--concurrency", "2", "--batch-size", "2", "--poll-interval", "2")
    for worker_id in workers.ids.values():  # both busy with short tasks
        held = Task.objects.filter(holder=worker_id, status=TaskStatus.RUNNING)
        wait_until(lambda: held.count() >= 2, 30, what=f"{worker_id} busy")  # noqa: B023 (called at once)
    with transaction.atomic():  # isolated from its first sight: no worker may claim it as a normal task
        suspect = Task.objects.enqueue(H + "record", priority=10)
        Task.objects.filter(pk=suspect.id).update(shared_crashes=2)  # ISOLATE_AFTER: it must run alone
    try:
        done = wait_until(
            lambda: Task.objects.filter(pk=suspect.id, status=TaskStatus.SUCCESSFUL).first(),
            15,
            0.2,
            what="the isolated task's turn",
        )
        assert done.worker_ids == [workers.ids["short"]]  # the long one cannot be idle
        # The long job's worker goes on claiming short tasks (it handed its turn over, if it had it).
        finished = Task.objects.filter(status=TaskStatus.SUCCESSFUL, worker_ids__contains=[workers.ids["long"]])
        later = finished.count() + 20
        wait_until(lambda: finished.count() >= later, 30, 0.1, what="the long job's worker to keep claiming")
        wait_until(
            lambda: not Lease.objects.active().filter(resource="tasks:isolation:default").exists(), 10, what="release"
        )
    finally:
        Gate.objects.filter(key="long").update(open=True)
