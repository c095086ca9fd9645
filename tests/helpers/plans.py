"""Plans of the statements a page sends: record them, EXPLAIN them, and say which read too much.

Used by the tests that pin page costs (tests/db/test_page_plans.py, test_listing_plans.py,
test_state_count_plans.py, test_queue_overview_attacks.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection

# Rows as enqueue writes them: a keyed row enters BLOCKED (the insert trigger) and each key admits
# its one slot (the statement's admission), so a keyed queue ends with 10 READY tasks and the rest
# BLOCKED.
ROWS_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, finished_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, concurrency_key, concurrency_limit)
SELECT %(queue)s, 0, 'app.jobs.x', '[]', '{}', %(status)s, now() + make_interval(secs => %(ahead)s), now(),
       CASE WHEN %(status)s = 'SUCCESSFUL' THEN now() END, 0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false,
       CASE WHEN %(keyed)s THEN %(queue)s || ':k' || (g %% 10) END, CASE WHEN %(keyed)s THEN 1 END
FROM generate_series(1, %(n)s) AS g
"""


def add_rows(queue: str, status: str, n: int, *, keyed: bool = False, ahead: float = 0) -> None:
    """``n`` rows of ``status`` in ``queue``, due ``ahead`` seconds from now (a READY row with a
    later ``run_after`` is what a sleeping or waiting task is)."""
    with connection.cursor() as cursor:
        cursor.execute(ROWS_SQL, {"queue": queue, "status": status, "n": n, "keyed": keyed, "ahead": ahead})


def seq_scans_of_tasks(plan: dict[str, Any]) -> list[str]:
    """The filters of every sequential scan of tasks_task in a plan."""
    found = []
    if plan.get("Node Type") == "Seq Scan" and plan.get("Relation Name") == "tasks_task":
        found.append(plan.get("Filter", "(no filter)"))
    for child in plan.get("Plans", []):
        found += seq_scans_of_tasks(child)
    return found


def rows_read(plan: dict[str, Any]) -> list[tuple[str, float]]:
    """Per node reading tasks_task or one of its indexes: the rows it read per loop (returned plus
    removed by its filter or recheck)."""
    found = []
    if plan.get("Relation Name") == "tasks_task" or plan.get("Node Type") == "Bitmap Index Scan":
        read = (
            plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0) + plan.get("Rows Removed by Index Recheck", 0)
        )
        found.append((f"{plan['Node Type']} {plan.get('Index Name', '')}".strip(), read))
    for child in plan.get("Plans", []):
        found += rows_read(child)
    return found


def total_rows_read(plan: dict[str, Any]) -> float:
    """Rows every node reading tasks_task or one of its indexes read, over all its loops: a read
    repeated for each row of an outer node counts each time."""
    read = 0.0
    if plan.get("Relation Name") == "tasks_task" or plan.get("Node Type") == "Bitmap Index Scan":
        per_loop = (
            plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0) + plan.get("Rows Removed by Index Recheck", 0)
        )
        read = per_loop * plan["Actual Loops"]
    return read + sum(total_rows_read(child) for child in plan.get("Plans", []))


@contextmanager
def recorded() -> Iterator[list[tuple[str, Any]]]:
    """The statements touching tasks_task sent on this thread's default connection within the block."""
    statements: list[tuple[str, Any]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        if "tasks_task" in sql:
            statements.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        yield statements


def explained(sql: str, params: Any, *, analyze: bool = True) -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN ({'ANALYZE, ' if analyze else ''}FORMAT JSON) " + sql, params)
        raw = cursor.fetchone()[0]
    plan: dict[str, Any] = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    return plan


def overreads(statements: list[tuple[str, Any]], limit: float) -> list[str]:
    """Each statement run again under EXPLAIN ANALYZE: every sequential scan of tasks_task, and every
    node that read more than ``limit`` rows per loop."""
    problems = []
    for sql, params in statements:
        plan = explained(sql, params)
        problems += [f"Seq Scan on tasks_task, filter {c}\n  {sql[:300]} {params}" for c in seq_scans_of_tasks(plan)]
        problems += [
            f"{node} read {read:.0f} rows per loop\n  {sql[:300]} {params}"
            for node, read in rows_read(plan)
            if read > limit
        ]
    return problems
