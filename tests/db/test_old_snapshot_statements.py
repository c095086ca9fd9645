"""Beside an old snapshot the worker's own statements keep a flat cost: the finish (with its claim)
and the heartbeat find the attempts they name by primary key, never through an index that holds every
row version the worker ever held RUNNING: a holder index (until migration 0045) or the running set's
(tasks/lifecycle/fragments.py, ``HELD``)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import connection, transaction

from tasks.lifecycle.values import ClaimPosition
from tasks.models import Task
from tests.helpers.plans import recorded
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # statements commit, as a worker's do


def _plan(sql: str, params: Any) -> dict[str, Any]:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0][0]["Plan"]
        transaction.set_rollback(True)
    return plan


def _indexes(plan: dict[str, Any]) -> set[str]:
    here = {plan["Index Name"]} if "Index Name" in plan else set()
    return here.union(*(_indexes(child) for child in plan.get("Plans", [])))


def test_finish_and_heartbeat_read_by_primary_key_beside_an_old_snapshot(old_snapshot: None) -> None:
    Task.objects.bulk_enqueue(NOOP, [{}] * 6000, queue="held")
    positions: dict[tuple[str, int], ClaimPosition] = {}
    claimed = Task.objects.claim("w", limit=200, queues=["held"], ttl=60)
    while claimed:  # a worker's rounds: finish what it holds, claim the next batch
        positions.update(ClaimPosition.last_per_level(claimed))
        results = [(c.id, c.token, "null", time.time()) for c in claimed]
        _done, _started, claimed = Task.objects.finish_start_claim(
            "w", results, limit=200, queues=["held"], ttl=60, after=list(positions.values())
        )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")  # what autovacuum tells the planner: next to nothing RUNNING
    Task.objects.bulk_enqueue(NOOP, [{}] * 40, queue="held")
    held = Task.objects.claim("w", limit=40, queues=["held"], ttl=60, after=list(positions.values()))
    assert len(held) == 40
    with recorded() as statements:
        Task.objects.heartbeat_detail("w", [(c.id, c.token) for c in held[20:]], ttl=60, stats={}, running=20)
        Task.objects.finish_start_claim(
            "w", [(c.id, c.token, "null", None) for c in held[:20]], limit=0, queues=["held"]
        )
    problems = []
    for sql, params in statements:
        plan = _plan(sql, params)
        blocks = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
        if _indexes(plan) & {"tasks_task_holder_state_idx", "tasks_task_running_exp_idx"} or blocks > 1500:
            problems.append(f"{blocks} blocks through {sorted(_indexes(plan))}: {sql[:120]!r}")
    assert len(statements) == 2
    assert not problems, "\n".join(problems)
