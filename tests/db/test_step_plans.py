"""The durable steps' statements at scale (issue 58): beside 100,000 suspended tasks with 200,000
stored steps and 100,000 events sent, each statement a step, a sleep, a wait, a send or the recovery
round's wake sends reads the rows of its one task (or its batch), never a table: no sequential scan
of tasks_task, tasks_taskstep or tasks_taskevent, and no node reading more than a few dozen rows per
loop. The wake's batch walks past the undelivered events of RUNNING tasks (they are woken once they
stop running): bounded by what the running tasks were sent, not by the tables (here 1,000 of them).

Each statement runs under EXPLAIN ANALYZE inside a transaction that is rolled back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from tasks.lifecycle import statements as sql
from tasks.maintenance.recovery import EVENTS_BATCH

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SUSPENDED = 100_000
RUNNING_WITH_EVENTS = 1_000
TABLES = ("tasks_task", "tasks_taskstep", "tasks_taskevent")

FILL_SQL = """
WITH tasks AS (
    INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,
        attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
        unstarted_returns, attempt_started, attempt_isolated, errors_dropped, snoozes)
    SELECT 'steps', 0, 'app.jobs.flow', '[]', '{}', 'READY', now() + interval '1 day', now(),
           0, 3, '[]', '["w"]', 0, 0, 0, 0, 0, 0, false, false, 0, 1
    FROM generate_series(1, %(n)s)
    RETURNING id
), steps AS (
    INSERT INTO tasks_taskstep (task_id, position, name, attempt, token, result, started_at, completed_at)
    SELECT t.id, s.position, s.name, 1, 1, 'null'::jsonb, now(), now()
    FROM tasks AS t CROSS JOIN (VALUES (0, 'before'), (1, 'wait:go')) AS s(position, name)
)
INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)
SELECT id, 'earlier', '{}'::jsonb, now(), true FROM tasks
"""

RUNNING_SQL = """
WITH tasks AS (
    INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,
        attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
        unstarted_returns, attempt_started, attempt_isolated, errors_dropped, holder, token, expires_at)
    SELECT 'steps', 0, 'app.jobs.flow', '[]', '{}', 'RUNNING', now(), now(),
           1, 3, '[]', '["w"]', 0, 0, 0, 0, 0, 0, true, false, 0, 'w', g, now() + interval '1 hour'
    FROM generate_series(1, %(n)s) AS g
    RETURNING id
)
INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)
SELECT id, 'go', '{}'::jsonb, now(), false FROM tasks
"""


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += nodes(child)
    return found


def problems(label: str, statement: str, params: dict[str, Any], most: int) -> list[str]:
    """What the statement's plan read beyond ``most`` rows per node (or by a sequential scan) of the
    three tables, run under EXPLAIN ANALYZE and rolled back."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params)
            raw = cursor.fetchone()[0]
        transaction.set_rollback(True)
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    found = []
    for node in nodes(plan):
        relation = node.get("Relation Name") or ""
        index = node.get("Index Name") or ""
        if not any(relation == t or index.startswith(t) for t in TABLES):
            continue
        read = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        read += node.get("Rows Removed by Index Recheck", 0)
        if node["Node Type"] == "Seq Scan" or read > most:
            found.append(f"{label}: {node['Node Type']} {relation or index} read {read:.0f} rows per loop")
    return found


def test_every_step_statement_reads_its_task_not_the_tables() -> None:
    with connection.cursor() as cursor:
        cursor.execute(FILL_SQL, {"n": SUSPENDED})
        cursor.execute(RUNNING_SQL, {"n": RUNNING_WITH_EVENTS})
        # Five tasks suspended on "go", sent it while they waited: what the wake finds past the rest.
        cursor.execute(
            "INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)"
            " SELECT id, 'go', '1'::jsonb, now(), false FROM tasks_task WHERE status = 'READY' ORDER BY id LIMIT 5"
        )
        cursor.execute("ANALYZE tasks_task; ANALYZE tasks_taskstep; ANALYZE tasks_taskevent")
        cursor.execute("SELECT max(id) FROM tasks_task WHERE status = 'READY'")
        (waiting,) = cursor.fetchone()
        cursor.execute("SELECT id, holder, token FROM tasks_task WHERE status = 'RUNNING' ORDER BY id LIMIT 1")
        running, holder, token = cursor.fetchone()
    record = {"id": running, "worker": holder, "token": token, "attempt": 1, "position": 0, "name": "charge"}
    record |= {"result": "{}", "started_at": timezone.now()}
    checks = [
        ("steps read", sql.STEPS_READ_SQL, {"id": waiting}, 10),
        ("step record", sql.STEP_RECORD_SQL, record, 10),
        ("event lock", sql.EVENT_LOCK_SQL, {"id": waiting}, 10),
        ("event send", sql.EVENT_SEND_SQL, {"ids": [waiting], "name": "go", "payload": "{}"}, 10),
        ("event check", sql.EVENT_CHECK_SQL, {"id": waiting, "name": "go", "deadline": None}, 10),
        ("spawn bind", sql.SPAWN_BIND_SQL, {"child": waiting, "parent": running}, 10),
        # The round's batch: every undelivered event of a RUNNING task is walked past (not delivered
        # while it runs), then the batch of the others.
        ("events wake", sql.EVENTS_WAKE_SQL, {"limit": EVENTS_BATCH}, RUNNING_WITH_EVENTS + EVENTS_BATCH + 10),
    ]
    found = [p for label, statement, params, most in checks for p in problems(label, statement, params, most)]
    assert found == []
    with connection.cursor() as cursor:  # what the wake did is rolled back: the five still wait
        cursor.execute("SELECT count(*) FROM tasks_taskevent WHERE NOT delivered")
        assert cursor.fetchone()[0] == RUNNING_WITH_EVENTS + 5
