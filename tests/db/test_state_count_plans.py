"""The dashboard's and /metrics' per-state counts (tasks/web/queries.py ``state_counts``) against a table
whose newest rows are a burst of one status: each count reads at most about ``cap`` index entries,
whatever lies before or after its own rows."""

from __future__ import annotations

import pytest
from django.db import connection

from tasks.web.queries import state_counts
from tests.helpers.plans import add_rows, overreads, recorded

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
    with recorded() as statements:
        counts = state_counts(cap)
    assert {name: (c.value, c.capped) for name, c in counts.items()} == {
        "pending": (cap, True),
        "retrying": (0, False),
        "snoozed": (0, False),
        "awaiting": (0, False),  # a burst of them: tests/db/test_workflow_metrics.py
        "blocked": (cap, True),
        "running": (0, False),
        "stuck": (0, False),
        "succeeded": (cap, True),
        "failed": (cap, True),
        "cancelled": (cap, True),
    }
    problems = overreads(statements, 2 * cap)
    assert not problems, "\n".join(problems)
