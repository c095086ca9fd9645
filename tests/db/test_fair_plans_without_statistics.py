"""A fair claim's plan before the table has statistics (a fresh table, a burst of new keys before
autovacuum's ANALYZE): each key's scans go through tasks_task_fair_idx, never through
tasks_task_claim_idx filtered by the key, which reads the whole queue for each key's row.

Found by ``bench/tasks.py --only-keys``: 100,000 tasks over 100,000 keys drained by 4 processes at
2,900 tasks/s on PostgreSQL 15 (77,266 rows filtered per key's turn) against 7,600 with statistics.
Without statistics both indexes are estimated at one row, and the turn's ``fair_key IS NOT NULL``
(the fair index's predicate, written out) was one more index condition of the fair index only: the
cheaper estimate went to the claim index (tasks/lifecycle/statements.py, ``_FAIR_ROWS``)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from tasks.lifecycle import statements as sql
from tests.helpers.plans import rows_read

# Committed rows, removed by the flush's TRUNCATE after the test: 100,000 rows inserted and rolled back
# would leave their dead entries in tasks_task_fair_idx, which the walks of later tests' claims step
# over (test_fair_claims' bounded walk read 2,995 blocks after it on PostgreSQL 15, against 800).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fair_queues")]

ROWS_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, fair_key)
SELECT 'fair', 0, 'tests.testapp.handlers.noop', '[]', '{}', 'READY', now() - interval '1 minute', now(),
       0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false, 'k' || g
FROM generate_series(1, %(n)s) AS g
"""


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += _nodes(child)
    return found


@pytest.mark.parametrize("statement", ["claim", "finish and claim"])
def test_each_keys_scans_use_the_fair_index_before_the_table_has_statistics(statement: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        assert cursor.fetchone()[0], "the test server's role removes the table's statistics: a superuser"
        cursor.execute(ROWS_SQL, {"n": 100_000})
    params = {
        "worker": "plan",
        "ttl": 30.0,
        "limit": 64,
        "start": False,
        "isolate_after": 2,
        "ids": [],
        "tokens": [],
        "values": [],
        "started": [],
        "hand": False,
        "handed": "{}",
        "release": 0,
        "rated_queues": [],
        **sql.claim_params(["fair"], busy=False, isolate_after=2, fair_after="k5000"),
    }
    text = sql.FAIR_CLAIM_SQL if statement == "claim" else sql.FAIR_FINISH_AND_CLAIM_SQL
    with transaction.atomic(), connection.cursor() as cursor:
        # As before autovacuum's first ANALYZE (rolled back with the claim: later tests keep theirs).
        cursor.execute("DELETE FROM pg_statistic WHERE starelid = 'tasks_task'::regclass")
        # And as a fresh table, whatever the tests before this one left in pg_class (sizes a VACUUM of
        # theirs recorded, for the table and each index): once, in the 5.2 leg, a history of them
        # made the claim's last join a merge over the whole primary key (100,000 entries read).
        cursor.execute(
            "UPDATE pg_class SET relpages = 0, reltuples = -1, relallvisible = 0"
            " WHERE oid = 'tasks_task'::regclass"
            " OR oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'tasks_task'::regclass)"
        )
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + text, params)
        plan = cursor.fetchone()[0][0]["Plan"]
        transaction.set_rollback(True)
    assert plan["Actual Rows"] >= 64
    filtered_by_key = [
        node.get("Filter", "")
        for node in _nodes(plan)
        if node.get("Index Name") == "tasks_task_claim_idx" and "fair_key" in node.get("Filter", "")
    ]
    assert not filtered_by_key, filtered_by_key
    assert max(read for _node, read in rows_read(plan)) < 1_000, rows_read(plan)
