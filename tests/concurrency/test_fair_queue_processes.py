"""Fairness between keys with real worker processes: 10,000 tasks of one tenant queued before 100 of
another in a fair queue (LEASING_TASKS["FAIR_QUEUES"]): the second tenant's tasks start within the
first few claims, and all of them long before the first tenant's backlog is drained. Start times
are the rows' own (``started_at``, the attempts' start on the database clock)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import pytest

from tasks.models import Task, Worker
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

BATCH = 16


def start_order(fair: bool, workers: Any) -> tuple[list[str | None], int]:
    """Enqueue the two tenants, run two worker processes until the small tenant is done (or the
    big one, which comes first when the queue is not fair), and return the tenants in the order
    their tasks started, and the big tenant's backlog."""
    big = Task.objects.bulk_enqueue(NOOP, [{}] * 10_000, queue="tenants", fair_key="big")
    small = Task.objects.bulk_enqueue(NOOP, [{}] * 100, queue="tenants", fair_key="small")
    for name in ("fair-1", "fair-2"):
        workers(name, fair=fair, batch=BATCH)
    wait_until(lambda: Worker.objects.filter(name__startswith="fair-").count() == 2, 30, what="the workers up")
    wait_until(
        lambda: Task.objects.filter(pk__in=small, status="SUCCESSFUL").count() == len(small), 180, what="small done"
    )
    rows = Task.objects.filter(queue="tenants", started_at__isnull=False).order_by("started_at", "id")
    return list(rows.values_list("fair_key", flat=True)), len(big)


def test_a_second_tenant_starts_within_the_first_claims_not_after_the_first_tenants_backlog(
    tenant_workers: Any,
) -> None:
    order, backlog = start_order(fair=True, workers=tenant_workers)
    first_small = order.index("small")
    last_small = len(order) - 1 - order[::-1].index("small")
    # The first claims of the two workers take turns between the tenants: half of each claim.
    assert first_small < BATCH, (first_small, order[:40])
    # Half and half until the small tenant is done: its 100 tasks among the first ~200 starts,
    # not after the 10,000 (a few claims' slack for the two workers' interleaving).
    assert last_small < 200 + 4 * BATCH, (last_small, backlog)


def test_the_same_queue_not_fair_drains_the_first_tenant_first(tenant_workers: Any) -> None:
    """The case shows what it measures: without FAIR_QUEUES the same rows are claimed oldest first,
    and the assertions above fail."""
    order, backlog = start_order(fair=False, workers=tenant_workers)
    assert order.index("small") > backlog - 4 * BATCH


def starts() -> list[str | None]:
    rows = Task.objects.filter(queue="tenants", started_at__isnull=False).order_by("started_at", "id")
    return list(rows.values_list("fair_key", flat=True))


def test_keys_after_one_with_nothing_due_are_served(tenant_workers: Any) -> None:
    """Breaker 32's starvation with a real worker: tenant a (a backlog, oldest), eight tenants whose
    tasks are all deferred, then tenant c. Claims of at most 4 visit deferred tenants that give
    nothing, and the room they leave is filled from a; the turns must go on past them to c, not
    back to a (c then waited for a's whole backlog)."""
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    Task.objects.bulk_enqueue(NOOP, [{}] * 2000, queue="tenants", fair_key="a")
    for k in range(8):
        Task.objects.bulk_enqueue(NOOP, [{}] * 3, queue="tenants", fair_key=f"b-{k}", run_after=later)
    small = Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue="tenants", fair_key="c")
    tenant_workers("fair-1", fair=True, batch=4)
    wait_until(lambda: Task.objects.filter(pk__in=small, status="SUCCESSFUL").count() == len(small), 180, what="c done")
    order = starts()
    last_c = len(order) - 1 - order[::-1].index("c")
    # a claim every three turns or so reaches c: its 20 tasks among the first few hundred starts
    assert last_c < 400, (last_c, len(order))
    assert not {key for key in order if key and key.startswith("b-")}  # deferred: never taken early


def test_equal_tenants_take_equal_turns_lap_after_lap(tenant_workers: Any) -> None:
    """Breaker 32's wrap-around with a real worker: five equal tenants, claims of at most 4 (the
    walk wraps every other claim) were served 50/50/50/25/25. After every lap of five starts each
    tenant has started its lap count of tasks, give or take one (a claim's tasks start in any order
    among themselves)."""
    names = [f"tenant-{k}" for k in range(5)]
    for name in names:
        Task.objects.bulk_enqueue(NOOP, [{}] * 120, queue="tenants", fair_key=name)
    tenant_workers("fair-1", fair=True, batch=4)
    wait_until(lambda: Task.objects.filter(queue="tenants", status="SUCCESSFUL").count() >= 400, 180, what="400 done")
    order = starts()[:400]
    worst = 0
    for lap in range(1, len(order) // 5 + 1):
        counts = Counter(order[: 5 * lap])
        worst = max(worst, *(abs(counts[name] - lap) for name in names))
    assert worst <= 1, (worst, Counter(order))
