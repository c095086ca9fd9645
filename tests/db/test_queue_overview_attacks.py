"""The queue overview (/dashboard/queues/, GET /api/queues) against large backlogs: its waiting and
blocked counts stop at COUNT_CAP by reading an index in order, never by a scan of the table, whatever
share of the table a backlog is (tasks/queues.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection

from tasks.queues import queue_overview
from tests.db.test_page_plans import seq_scans_of_tasks

pytestmark = pytest.mark.django_db(transaction=True)

# Rows as enqueue writes them: a keyed row enters BLOCKED (the insert trigger) and each key admits
# its one slot (the statement's admission), so 'keyed' ends with 10 READY tasks and the rest BLOCKED.
ROWS_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, finished_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, concurrency_key, concurrency_limit)
SELECT %(queue)s, 0, 'app.jobs.x', '[]', '{}', %(status)s, now(), now(),
       CASE WHEN %(status)s = 'SUCCESSFUL' THEN now() END, 0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false,
       CASE WHEN %(keyed)s THEN %(queue)s || ':k' || (g %% 10) END, CASE WHEN %(keyed)s THEN 1 END
FROM generate_series(1, %(n)s) AS g
"""


def add_rows(queue: str, status: str, n: int, *, keyed: bool = False) -> None:
    with connection.cursor() as cursor:
        cursor.execute(ROWS_SQL, {"queue": queue, "status": status, "n": n, "keyed": keyed})


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


def test_the_overview_counts_a_backlog_that_is_most_of_the_table_from_an_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """History first, then a burst not yet vacuumed: a READY backlog and a BLOCKED backlog appended
    after the finished rows, in two queues. The planner, expecting far more matches per queue than the
    cap, took a sequential scan with a LIMIT for each capped count (ordered by id: a backward scan of
    the primary key), and that scan stepped over every finished row and the other backlog before it
    found the first row it counts: the page's cost grew with the table. Every node must read at most
    about ``cap`` rows per loop. (The cap is scaled down with the table: what decides the plan is
    backlog / cap.)"""
    cap = 100
    monkeypatch.setattr("tasks.queues.COUNT_CAP", cap)
    add_rows("bulk", "SUCCESSFUL", 6_000)
    add_rows("bulk", "READY", 6_000)
    add_rows("keyed", "READY", 6_000, keyed=True)
    add_rows("other", "READY", 6_000, keyed=True)  # another queue's BLOCKED backlog, after this one's
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")  # no VACUUM: a fresh burst has no visibility map yet
    statements: list[tuple[str, Any]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        if "tasks_task" in sql:
            statements.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        entries = {e["name"]: e for e in queue_overview()}
    assert set(entries) == {"bulk", "keyed", "other"}
    assert (entries["bulk"]["waiting"], entries["bulk"]["waiting_capped"], entries["bulk"]["blocked"]) == (cap, True, 0)
    for name in ("keyed", "other"):
        assert (entries[name]["waiting"], entries[name]["blocked"], entries[name]["blocked_capped"]) == (10, cap, True)
    assert len(statements) >= 4
    problems = []
    with connection.cursor() as cursor:
        for sql, params in statements:
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
            explained = cursor.fetchone()[0]
            plan = (json.loads(explained) if isinstance(explained, str) else explained)[0]["Plan"]
            problems += [f"Seq Scan on tasks_task, filter {c}\n  {sql[:300]}" for c in seq_scans_of_tasks(plan)]
            problems += [
                f"{node} read {read:.0f} rows per loop\n  {sql[:300]}"
                for node, read in rows_read(plan)
                if read > 2 * cap
            ]
    assert not problems, "\n".join(problems)


def test_the_blocked_count_of_a_queue_is_exact_below_the_cap_beside_neighbouring_queues(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The BLOCKED count reads from its queue on in name order (the next queues' rows follow in the
    same scan): only its own rows count, exact below the cap, capped at it."""
    monkeypatch.setattr("tasks.queues.COUNT_CAP", 50)
    add_rows("a", "READY", 30, keyed=True)  # 10 admitted, 20 blocked
    add_rows("a-b", "READY", 200, keyed=True)  # sorts right after "a": 190 blocked
    add_rows("b", "READY", 15, keyed=True)  # 10 admitted, 5 blocked
    entries = {e["name"]: e for e in queue_overview()}
    assert {name: (e["waiting"], e["blocked"], e["blocked_capped"]) for name, e in entries.items()} == {
        "a": (10, 20, False),
        "a-b": (10, 50, True),
        "b": (10, 5, False),
    }
