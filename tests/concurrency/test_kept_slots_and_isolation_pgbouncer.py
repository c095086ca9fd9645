"""Kept key slots and the isolation reservation through PgBouncer in transaction
pooling (a small pool shared by the workers and recovery).

Found by breaker 20 (the bug hunt on issue 20: concurrency keys and worker identity at scale)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from leasing.models import Lease
from tasks.models import ConcurrencyHold, Task, TaskStatus
from tests.concurrency.test_concurrency_keys import SPAN, all_finished, max_overlap
from tests.helpers import wait_until
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.workers import Workers
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def pooled(bouncer: Bouncer) -> dict[str, Any]:
    return {"DATABASE_URL": bouncer.url(connection.settings_dict["NAME"]), "DATABASE_POOLED": "true"}


def test_timed_out_handlers_of_a_serial_key_through_pgbouncer(bouncer_pool_of_3: Bouncer, workers: Workers) -> None:
    options: dict[str, Any] = {"concurrency_key": "serial", "concurrency_limit": 1, "timeout": 0.5, "max_attempts": 1}
    ids = [Task.objects.enqueue(SPAN, kwargs={"seconds": 1.0}, **options).id for _ in range(3)]
    for name in ("p1", "p2"):
        workers.start(name, "--concurrency", "3", **pooled(bouncer_pool_of_3))
    wait_until(
        lambda: all_finished(ids) and Effect.objects.filter(task_id__in=ids, phase="ended").count() == 3,
        60,
        0.1,
        what="every handler to return",
    )
    assert max_overlap("serial") == 1
    wait_until(lambda: not ConcurrencyHold.objects.exists(), 10, what="the kept slots to be given back")


def test_an_isolated_task_gets_its_turn_through_pgbouncer(bouncer_pool_of_3: Bouncer, workers: Workers) -> None:
    Task.objects.bulk_enqueue("tests.testapp.handlers.work", [{"seconds": 0.1}] * 600)
    for name in ("b1", "b2"):
        workers.start(name, "--concurrency", "2", "--batch-size", "2", **pooled(bouncer_pool_of_3))
    for worker_id in workers.ids.values():
        held = Task.objects.filter(holder=worker_id, status=TaskStatus.RUNNING)
        wait_until(lambda: held.count() >= 2, 30, what=f"{worker_id} busy")  # noqa: B023
    with transaction.atomic():  # isolated from its first sight: no worker may claim it as a normal task
        suspect = Task.objects.enqueue("tests.testapp.handlers.record", priority=10)
        Task.objects.filter(pk=suspect.id).update(shared_crashes=2)
    wait_until(lambda: Task.objects.filter(pk=suspect.id, status=TaskStatus.SUCCESSFUL).exists(), 30, what="its turn")
    assert Task.objects.filter(status=TaskStatus.READY).count() > 100
    wait_until(
        lambda: not Lease.objects.active().filter(resource="tasks:isolation:default").exists(), 10, what="release"
    )
