"""The dashboard's and /metrics' per-state counts (tasks/queries.py ``state_counts``) against a table
whose newest rows are a burst of one status: each count reads at most about ``cap`` index entries,
whatever lies before or after its own rows."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection

from tasks.queries import state_counts
from tests.db.test_queue_overview_attacks import add_rows, rows_read

pytestmark = pytest.mark.django_db(transaction=True)


def test_each_state_count_reads_at_most_its_cap_after_a_burst() -> None:
    """History (succeeded, failed, cancelled) first, then a burst of waiting and blocked tasks, not yet
    vacuumed. A count ordered by id alone was planned as a backward scan of the primary key that
    filtered on the status, and counting the succeeded tasks stepped over the whole burst first: the
    overview page and every scrape grew with the table."""
    cap = 100
    add_rows("bulk", "SUCCESSFUL", 6_000)
    add_rows("bulk", "FAILED", 500)
    add_rows("bulk", "CANCELLED", 500)
    add_rows("bulk", "READY", 6_000)
    add_rows("keyed", "READY", 6_000, keyed=True)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")  # no VACUUM: a fresh burst has no visibility map yet
    statements: list[tuple[str, Any]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        statements.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        counts = state_counts(cap)
    assert {name: (c.value, c.capped) for name, c in counts.items()} == {
        "pending": (cap, True),
        "retrying": (0, False),
        "blocked": (cap, True),
        "running": (0, False),
        "stuck": (0, False),
        "succeeded": (cap, True),
        "failed": (cap, True),
        "cancelled": (cap, True),
    }
    problems = []
    with connection.cursor() as cursor:
        for sql, params in statements:
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
            explained = cursor.fetchone()[0]
            plan = (json.loads(explained) if isinstance(explained, str) else explained)[0]["Plan"]
            problems += [
                f"{node} read {read:.0f} rows\n  {sql[:300]} {params}"
                for node, read in rows_read(plan)
                if read > 2 * cap
            ]
    assert not problems, "\n".join(problems)
