"""The claim beside deferred higher-priority rows: every claiming statement (the claim, the worker's
finish-and-claim and finish-start-claim rounds; one queue and several) reads about as much as on an
empty table, on every PostgreSQL major.

The claim orders by ``priority DESC, run_after, id`` among due rows, through tasks_task_claim_idx
(queue, priority DESC, run_after, id, shared_crashes). A plain ordered scan of it meets a higher
priority's deferred rows before a lower priority's due ones and steps over every one of them:
PostgreSQL 18's skip scan jumps over them, 13-17 have none (a claim beside 300,000 deferred rows cost
x32 on PostgreSQL 15). The claim walks the priorities itself (tasks/lifecycle/statements.py, ``_PICK_ONE``)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from tasks.models import Task
from tests.helpers.plans import recorded
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db

# Deferred rows of a higher priority in the claimed queue, and a due backlog in another queue.
BACKLOG_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts,
    max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes, unstarted_returns,
    attempt_started, attempt_isolated)
SELECT CASE WHEN g %% 2 = 0 THEN 'elsewhere' ELSE %(queue)s END, CASE WHEN g %% 2 = 0 THEN 5 ELSE 10 END,
       %(path)s, '[]', '{}', 'READY', CASE WHEN g %% 2 = 0 THEN now() ELSE now() + interval '1 day' END, now(),
       0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false
FROM generate_series(1, %(n)s) AS g
"""


def _buffers_and_locks(sql: str, params: Any) -> tuple[int, int]:
    """The statement run again under EXPLAIN (ANALYZE, BUFFERS), rolled back: the blocks it touched and
    the rows its LockRows nodes passed on (each one a row it locked)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0][0]["Plan"]
        transaction.set_rollback(True)

    def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]

    locked = sum(n["Actual Rows"] * n["Actual Loops"] for n in nodes(plan) if n["Node Type"] == "LockRows")
    return plan["Shared Hit Blocks"] + plan["Shared Read Blocks"], locked


# A queue of its own per case: a case's rows are rolled back, not vacuumed, and the walk from one
# priority to the next must find a live row, so it would step over the aborted entries of a case
# that used the same queue before (vacuum's to clear; PostgreSQL 18's skip scan jumps over them).
@pytest.mark.parametrize("queues", [["alone"], ["shared", "idle"]], ids=["one queue", "several queues"])
def test_claims_beside_deferred_higher_priority_rows_read_no_more_than_on_an_empty_table(queues: list[str]) -> None:
    home = queues[0]
    with connection.cursor() as cursor:
        cursor.execute(BACKLOG_SQL, {"queue": home, "path": NOOP, "n": 100_000})
        cursor.execute("ANALYZE tasks_task")
    # Due rows on two priorities below the deferred ones: a claim of 4 takes both of priority 5 and
    # the two oldest of priority 0, and locks nothing more.
    due = [Task.objects.enqueue(NOOP, queue=home, priority=p).id for p in (5, 5, 0, 0, 0)]
    with transaction.atomic():  # run once to record the statements, then undone
        with recorded() as statements:
            claimed = Task.objects.claim("plans", limit=2, queues=queues)
            _done, _started, more = Task.objects.finish_start_claim("plans", [], limit=1, queues=queues)
            _done, _started, last = Task.objects.finish_start_claim(
                "plans", [], [(claimed[0].id, claimed[0].token, None)], limit=1, queues=queues
            )
        assert [c.id for c in [*claimed, *more, *last]] == due[:4]
        transaction.set_rollback(True)
    assert len(statements) == 3
    problems = []
    for sql, params in statements:  # each from the same starting point
        touched, locked = _buffers_and_locks(sql, params)
        if touched > 150 or locked > params["limit"]:
            problems.append(f"{touched} blocks, {locked} rows locked for {params['limit']}\n  {sql[:400]}")
    assert not problems, "\n".join(problems)


KEYED_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts,
    max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes, unstarted_returns,
    attempt_started, attempt_isolated, concurrency_key, concurrency_limit)
SELECT 'default', %(priority)s, %(path)s, '[]', '{}', 'BLOCKED', now() + make_interval(secs => %(delay)s), now(),
       0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false, 'smtp', 1
FROM generate_series(1, %(n)s) AS g
"""


def test_an_admission_beside_deferred_higher_priority_waiting_tasks_reads_no_more_than_without_them() -> None:
    """The admission of a concurrency key (migration 0011) picks in the claim's order among the key's
    due BLOCKED tasks; a retry backing off waits BLOCKED, so a key's deferred rows can be many. It read
    every one of them (1,571 blocks beside 50,000 on PostgreSQL 15, 198 beside one)."""
    with connection.cursor() as cursor:
        cursor.execute(KEYED_SQL, {"priority": 10, "path": NOOP, "delay": 86_400, "n": 50_000})
        cursor.execute(KEYED_SQL, {"priority": 0, "path": NOOP, "delay": 0, "n": 3})  # its statement admits 1
        cursor.execute("UPDATE tasks_concurrencykey SET max_running = 10 WHERE key = 'smtp'")
        cursor.execute("ANALYZE tasks_task")
        # The key's row exists, so the function does not look its limit up. Twice: the second time, the
        # function's statements are planned warm, as in a running system.
        for _ in range(2):
            with transaction.atomic():
                cursor.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT tasks_concurrency_admit('smtp', NULL, NULL)"
                )
                plan = cursor.fetchone()[0][0]["Plan"]  # the function's reads are counted in its node
                cursor.execute("SELECT count(*) FROM tasks_task WHERE concurrency_key = 'smtp' AND status = 'READY'")
                assert cursor.fetchone()[0] == 3
                transaction.set_rollback(True)
    touched = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    assert touched < 300, touched
