"""A task that must run isolated gets its turn under a steady stream (issue 20, item 8).

Busy workers' claims pass over such a task; before, it waited until the whole backlog had drained
(1,324 tasks in the report), and under a stream that never ends it would never run. Now one busy
worker reserves itself for it (the queue's isolation lease), stops claiming, and takes it once idle.
"""

from __future__ import annotations

import pytest
from django.db import transaction

from leasing.models import Lease
from tasks.models import Task, TaskStatus
from tests.helpers import wait_until, worker_names
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."
BACKLOG = 2000  # 0.1 s each, 2 executors per worker, 2 workers: ~50 s of work


def test_an_isolated_task_runs_long_before_a_busy_queue_drains(workers: Workers) -> None:
    Task.objects.bulk_enqueue(H + "work", [{"seconds": 0.1}] * BACKLOG)
    for name in ("busy-1", "busy-2"):
        workers.start(name, "--concurrency", "2", "--batch-size", "2")
    for worker_id in workers.ids.values():  # each holds tasks (claimed ahead): neither is idle from now on
        held = Task.objects.filter(holder=worker_id, status=TaskStatus.RUNNING)
        wait_until(lambda: held.count() >= 2, 30, what=f"{worker_id} busy")  # noqa: B023 (called at once)

    with transaction.atomic():  # isolated from its first sight: no worker may claim it as a normal task
        suspect = Task.objects.enqueue(H + "record", priority=10)
        Task.objects.filter(pk=suspect.id).update(shared_crashes=2)  # ISOLATE_AFTER: it must run alone

    done = wait_until(
        lambda: Task.objects.filter(pk=suspect.id, status=TaskStatus.SUCCESSFUL).first(), 30, what="its turn"
    )
    assert done.attempts == 1 and worker_names(done.worker_ids)[0] in ("busy-1", "busy-2")
    left = Task.objects.filter(status=TaskStatus.READY).count()
    assert left > BACKLOG // 4, f"only {left} of {BACKLOG} still waiting: it ran near the end, not in turn"
    # Whoever reserved (the queue's isolation lease; or nobody, if a worker happened to be idle for an
    # instant and its claim took the task) holds nothing once the task ran.
    wait_until(
        lambda: not Lease.objects.active().filter(resource="tasks:isolation:default").exists(), 10, what="the release"
    )
