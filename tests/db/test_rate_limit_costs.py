"""Rate limits per key: costs must not grow with the number of keys. With
5,000 keys started within the last hour (none idle), the recovery round's pruning of idle keys
(PRUNE_IDLE_KEYS_SQL, every recovery interval) and a rate start each read a bounded number of key
rows, the same as with 50 keys.

Found by breaker 32 (the bug hunt on issue 24's rate limits per key)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection

from tasks.lifecycle import statements as sql
from tasks.lifecycle.ratelimits import IDLE_KEY_SECONDS, PRUNE_IDLE_KEYS_SQL
from tasks.models import Task
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def add_keys(n: int, offset: int = 0) -> None:
    """``n`` keys started a minute ago (a window of a second: long empty, not idle for an hour)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO tasks_ratelimit (key, max_starts, period, starts, next_due, grants, refusals, retry_at,
                                         decided_at, granted)
            SELECT 'k-' || g, 5, 1.0, ARRAY[clock_timestamp() - interval '1 minute'],
                   clock_timestamp() - interval '1 minute', 1, 0, NULL, clock_timestamp() - interval '1 minute', true
            FROM generate_series(%s, %s) AS g
            """,
            [offset, offset + n - 1],
        )
        cursor.execute("ANALYZE tasks_ratelimit")


def rows_read(statement: str, params: dict[str, Any]) -> int:
    """Rows the plan's scans of tasks_ratelimit read (returned + removed by their filters)."""
    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
        try:
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF, FORMAT JSON) " + statement, params)
            plan = cursor.fetchone()[0]
        finally:
            cursor.execute("ROLLBACK")
    if isinstance(plan, str):
        plan = json.loads(plan)
    total = 0

    def walk(node: dict[str, Any]) -> None:
        nonlocal total
        if node.get("Relation Name") == "tasks_ratelimit" and "Scan" in node.get("Node Type", ""):
            loops = node.get("Actual Loops", 1)
            total += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * loops
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    return total


def test_pruning_idle_keys_reads_no_more_rows_with_5000_live_keys_than_with_50() -> None:
    params = {"idle": IDLE_KEY_SECONDS, "limit": 1000}
    add_keys(50)
    with_50 = rows_read(PRUNE_IDLE_KEYS_SQL, params)
    add_keys(4950, offset=50)
    with_5000 = rows_read(PRUNE_IDLE_KEYS_SQL, params)
    assert with_5000 <= max(2 * with_50, 50), (
        f"the recovery round's prune of idle rate keys read {with_5000} key rows with 5,000 keys"
        f" (none idle), {with_50} with 50: it grows with the number of keys"
    )


def test_a_rate_start_costs_the_same_with_5000_keys() -> None:
    add_keys(5000)
    Task.objects.bulk_enqueue(NOOP, [{}] * 2, rate_key="k-17", rate_limit=(5, 1.0))
    claimed = Task.objects.claim("b32", limit=2, ttl=30)
    params: dict[str, Any] = {
        "worker": "b32",
        "id": claimed[0].id,
        "token": claimed[0].token,
        "isolated": False,
        "key": None,
        "limit": None,
        "period": None,
    }
    assert rows_read(sql.RATE_START_SQL, params) <= 2


def test_a_rate_start_reads_the_task_by_its_primary_key_beside_20000_finished_tasks() -> None:
    # The change's own plan test (test_the_take_reads_one_key_row_by_its_primary_key) sees a Seq Scan
    # on tasks_task on PostgreSQL 15, with two rows in the table. With a table of real size (and its
    # statistics), the rate start must read the task by its primary key, whatever the PostgreSQL.
    Task.objects.bulk_enqueue(NOOP, [{}] * 20_000)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET status = 'SUCCESSFUL', finished_at = clock_timestamp()")
    Task.objects.bulk_enqueue(NOOP, [{}] * 2, rate_key="k-pk", rate_limit=(5, 1.0))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
        cursor.execute("ANALYZE tasks_ratelimit")
    claimed = Task.objects.claim("b32", limit=2, ttl=30)
    assert len(claimed) == 2
    params: dict[str, Any] = {
        "worker": "b32",
        "id": claimed[0].id,
        "token": claimed[0].token,
        "isolated": False,
        "key": None,
        "limit": None,
        "period": None,
    }
    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
        try:
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF) " + sql.RATE_START_SQL, params)
            text = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("ROLLBACK")
    assert "Seq Scan on tasks_task" not in text, text
