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


def test_the_running_and_stuck_counts_read_the_running_set_not_a_backlog() -> None:
    """A never-claimed backlog (no lease: ``expires_at`` NULL) and, beside it, more live running tasks
    than the cap, none stuck. No index of status holds the RUNNING rows (migration 0044), and the
    planner, taking a status and a NULL expiry for independent, expects thousands of stuck rows: the
    stuck count ordered by id was a backward scan of the primary key through the whole backlog (found
    by helper-24 on PostgreSQL 15: 29,806 buffers beside 1,000,000 waiting tasks, on every dashboard
    page and scrape). Ordered by lease expiry, each count reads the running index, at most the running
    rows."""
    cap = 1_000
    add_rows("backlog", "READY", 200_000)
    add_rows("busy", "RUNNING", 3_000)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET holder = 'w', token = id,"
            " expires_at = now() + interval '5 minutes' + random() * interval '1 minute' WHERE status = 'RUNNING'"
        )  # leases renewed at different moments: their expiry is not in the rows' order
        cursor.execute("VACUUM (FREEZE, ANALYZE) tasks_task")
    with recorded() as statements:
        counts = state_counts(cap)
    assert (counts["running"].value, counts["running"].capped) == (cap, True)
    assert (counts["stuck"].value, counts["stuck"].capped) == (0, False)
    problems = overreads(statements, 4_000)
    assert not problems, "\n".join(problems)
