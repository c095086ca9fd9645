"""The state listings behind the dashboard pages, the admin and the API lists (tasks/web/listings.py
``Listing``) against a table whose newest rows are a burst of other statuses: a page reads about a
page of index entries (or its scan window, for a condition no index covers), whatever lies after
its own rows."""

from __future__ import annotations

import pytest
from django.db import connection

from tasks.web.listings import SCAN_WINDOW, state_listing
from tests.helpers.plans import add_rows, overreads, recorded

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = 50
BURST = 4 * SCAN_WINDOW


def test_a_state_page_reads_its_own_index_entries_not_a_newer_burst_of_others() -> None:
    """History (succeeded, failed, cancelled) first, then a burst of waiting and blocked tasks, not yet
    vacuumed. Each branch of a listing was ``WHERE status = … ORDER BY id DESC LIMIT n``, which the
    planner (assuming a status's rows are spread evenly over the ids) ran as a backward scan of the
    primary key filtering on the status: the succeeded page stepped over the whole burst before its
    first row, and every list page grew with the burst."""
    add_rows("bulk", "SUCCESSFUL", 6_000)
    add_rows("bulk", "FAILED", 3_000)
    add_rows("bulk", "CANCELLED", 3_000)
    add_rows("bulk", "READY", BURST)
    add_rows("keyed", "READY", BURST, keyed=True)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")  # no VACUUM: a fresh burst has no visibility map yet
    pages = {
        ("succeeded", None, ""): LIMIT,
        ("failed", None, ""): LIMIT,
        ("cancelled", None, ""): LIMIT,
        ("succeeded", "bulk", ""): LIMIT,
        ("succeeded", None, "app.jobs.x"): LIMIT,
        ("failed", "bulk", "app.jobs.x"): LIMIT,
    }
    with recorded() as statements:
        for (state, queue, search), expected in pages.items():
            page = state_listing(state, queue=queue, search=search).page(limit=LIMIT)
            assert len(page.tasks) == expected, (state, queue, search)
            assert [t.pk for t in page.tasks] == sorted((t.pk for t in page.tasks), reverse=True)
    problems = overreads(statements, SCAN_WINDOW + 1)
    assert not problems, "\n".join(problems)
