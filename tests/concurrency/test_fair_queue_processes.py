"""Fairness between keys with real worker processes: 10,000 tasks of one tenant queued before 100 of
another in a fair queue (LEASING_TASKS["FAIR_QUEUES"]): the second tenant's tasks start within the
first few claims, and all of them long before the first tenant's backlog is drained. Start times
are the rows' own (``started_at``, the attempts' start on the database clock)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.models import Task, Worker
from tests.helpers import start_manage, stop_process, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

NOOP = "tests.testapp.handlers.noop"
BATCH = 16


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[bytes]] = []

    def start(worker_id: str, *, fair: bool) -> subprocess.Popen[bytes]:
        env = {"LEASING_TEST_FAIR_QUEUES": "tenants" if fair else ""}
        args = ["--queues", "tenants", "--concurrency", "4", "--batch-size", str(BATCH), "--poll-interval", "0.2"]
        proc = start_manage(tmp_path / f"{worker_id}.log", "run_worker", "--worker-id", worker_id, *args, **env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_process(proc)


def start_order(fair: bool, workers: Any) -> tuple[list[str | None], int]:
    """Enqueue the two tenants, run two worker processes until the small tenant is done (or the
    big one, which comes first when the queue is not fair), and return the tenants in the order
    their tasks started, and the big tenant's backlog."""
    big = Task.objects.bulk_enqueue(NOOP, [{}] * 10_000, queue="tenants", fair_key="big")
    small = Task.objects.bulk_enqueue(NOOP, [{}] * 100, queue="tenants", fair_key="small")
    for name in ("fair-1", "fair-2"):
        workers(name, fair=fair)
    wait_until(lambda: Worker.objects.filter(name__startswith="fair-").count() == 2, 30, what="the workers up")
    wait_until(
        lambda: Task.objects.filter(pk__in=small, status="SUCCESSFUL").count() == len(small), 180, what="small done"
    )
    rows = Task.objects.filter(queue="tenants", started_at__isnull=False).order_by("started_at", "id")
    return list(rows.values_list("fair_key", flat=True)), len(big)


def test_a_second_tenant_starts_within_the_first_claims_not_after_the_first_tenants_backlog(workers: Any) -> None:
    order, backlog = start_order(fair=True, workers=workers)
    first_small = order.index("small")
    last_small = len(order) - 1 - order[::-1].index("small")
    # The first claims of the two workers take turns between the tenants: half of each claim.
    assert first_small < BATCH, (first_small, order[:40])
    # Half and half until the small tenant is done: its 100 tasks among the first ~200 starts,
    # not after the 10,000 (a few claims' slack for the two workers' interleaving).
    assert last_small < 200 + 4 * BATCH, (last_small, backlog)


def test_the_same_queue_not_fair_drains_the_first_tenant_first(workers: Any) -> None:
    """The case shows what it measures: without FAIR_QUEUES the same rows are claimed oldest first,
    and the assertions above fail."""
    order, backlog = start_order(fair=False, workers=workers)
    assert order.index("small") > backlog - 4 * BATCH
