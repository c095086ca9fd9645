"""Fairness with four worker processes of a fair queue: one tenant's backlog of 5,000 tasks queued
before 100 tenants of 3 tasks each. The workers' claims collide (each walks keys the others hold
locked); what a collided claim cannot take from its turns goes to the fill, which takes the oldest
backlog. The small tenants must all be served before the backlog tenant's backlog ends."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.models import Task, Worker
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]


def test_four_workers_start_every_small_tenant_before_the_backlog_tenant_takes_most_starts(tenant_workers: Any) -> None:
    Task.objects.bulk_enqueue(NOOP, [{}] * 5_000, queue="tenants", fair_key="backlog")
    small: list[int] = []
    for tenant in range(100):
        small += Task.objects.bulk_enqueue(NOOP, [{}] * 3, queue="tenants", fair_key=f"t-{tenant:03d}")
    for name in ("share-1", "share-2", "share-3", "share-4"):
        tenant_workers(name, batch=16)
    wait_until(lambda: Worker.objects.filter(name__startswith="share-").count() == 4, 30, what="the workers up")
    wait_until(lambda: Task.objects.filter(pk__in=small, status="SUCCESSFUL").count() == len(small), 600, what="small")
    # Every small tenant was served before the backlog tenant's backlog ended, at any speed: claims
    # take turns, so the small tenants' 300 tasks cannot wait behind the 5,000. (How few of the
    # backlog's starts came first is a share: bench/fair_claims.py's "shares" case measures the claims'.)
    rows = Task.objects.filter(queue="tenants", started_at__isnull=False).order_by("started_at", "id")
    order = list(rows.values_list("fair_key", flat=True))
    last_small = max(index for index, key in enumerate(order) if key != "backlog")
    backlog_before = order[:last_small].count("backlog")
    print(f"every small tenant's task started within {last_small} starts, {backlog_before} of them the backlog's")
    assert backlog_before < 5_000, (last_small, backlog_before)
