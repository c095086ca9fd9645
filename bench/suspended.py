#!/usr/bin/env python
"""What suspended tasks cost the hot path and the pages: shared buffers each statement and page
touches beside 10,000 and beside 1,000,000 tasks asleep or waiting for an event (issue 58).

    python bench/suspended.py [--sizes 10000,1000000]
    DATABASE_URL=postgres://... python bench/suspended.py    # another server (e.g. PostgreSQL 15); it is emptied

A suspended task is what ``sleep()`` and ``wait_for_event()`` leave (tasks/steps.py): READY, its
``run_after`` at the wake or the wait's deadline (an hour to a year ahead), a snooze counted, and its
steps stored (``sleep``, or ``wait:<event>``). Half sleep, half wait for an event of their own. Beside
them, the same at every size: 1,000 due tasks in the same queue, 200 running under live leases,
20 undelivered events of running tasks, 100 succeeded tasks. After the build: VACUUM (FREEZE,
ANALYZE), the state autovacuum leaves.

Counted, for each size, with EXPLAIN (ANALYZE, BUFFERS) of the exact text each sends (shared hit +
read; a count, not a time, so a busy machine does not bend it; statements that write run in a
transaction rolled back after):

- the worker's claim of 16 from the queue the sleepers are in, and the same from four queues;
- the recovery round's scan of expired leases, the whole round (``recover_once``: the dead workers,
  the sweeps, the keys' admissions, the chart's open minute) and its event wake (``wake_for_events``);
- an event sent to one waiting task (``send_event``), and the wait's look at its event;
- the pages an operator opens: the overview, the pending list, the task page of a sleeper, the
  queues page, ``/api/tasks?status=READY``, ``/api/queues``, ``/metrics``.

The last column is the ratio of the two sizes (goal: about 1x for the statements: a sleeper costs
the claim nothing; at most 3x for pages, bench/pages.py's bound). The figures are in
docs/explanation/benchmarks.md, "Suspended tasks".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: this folder would shadow the apps; import from the root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import prepare_database

QUEUE = "default"
_JIT_OFF = "SELECT set_config('jit', 'off', true); "

# n suspended tasks; every other one sleeps (its ``sleep`` step holds the wake), the rest wait for
# the event ``order-<g>`` (their ``wait:order-<g>`` step holds the deadline, or null: no deadline).
SUSPENDED_SQL = """
INSERT INTO tasks_task (
    queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at, last_attempted_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, snoozes, released_at)
SELECT %(queue)s, 0, 'app.jobs.checkout', '[]', jsonb_build_object('order', g), 'READY',
       now() + interval '1 hour' + make_interval(days => g %% 365), now() - interval '1 hour',
       now() - interval '1 hour', now() - interval '1 hour', 1, 3, '[]', '["worker-1"]', 0, 2, 0, 0, 0, 0,
       false, false, 1, now() - interval '1 hour'
FROM generate_series(1, %(n)s) AS g
"""

STEPS_SQL = """
INSERT INTO tasks_taskstep (task_id, position, name, attempt, token, result, started_at, completed_at)
SELECT t.id, 0, CASE WHEN mod(t.id, 2) = 0 THEN 'sleep' ELSE 'wait:order-' || t.id END, 1, t.id,
       CASE WHEN mod(t.id, 2) = 0 THEN to_jsonb(t.run_after::text) WHEN mod(t.id, 4) = 1 THEN 'null'::jsonb
            ELSE to_jsonb(t.run_after::text) END,
       t.started_at, t.started_at
FROM tasks_task AS t WHERE t.status = 'READY' AND t.snoozes = 1
"""

DUE_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts,
    max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes, unstarted_returns,
    attempt_started, attempt_isolated)
SELECT CASE WHEN g %% 4 = 0 THEN 'mail' ELSE %(queue)s END, 0, 'app.jobs.job_' || (g %% 10), '[]', '{}', 'READY',
       now() - interval '1 minute', now() - interval '1 minute', 0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false
FROM generate_series(1, 1000) AS g
"""

RUNNING_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at,
    last_attempted_at, attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes,
    shared_crashes, unstarted_returns, attempt_started, attempt_isolated, holder, token, acquired_at, renewed_at,
    expires_at)
SELECT %(queue)s, 0, 'app.jobs.job_' || (g %% 10), '[]', '{}', 'RUNNING', now() - interval '10 seconds',
       now() - interval '10 seconds', now() - interval '5 seconds', now() - interval '5 seconds', 1, 3, '[]',
       jsonb_build_array('worker-' || (g %% 20)), 1, 1, 0, 0, 0, 0, true, false, 'worker-' || (g %% 20),
       nextval('leasing_fence_token_seq'), now() - interval '5 seconds', now(), now() + interval '1 hour'
FROM generate_series(1, 200) AS g
"""

FINISHED_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at,
    last_attempted_at, finished_at, attempts, max_attempts, return_value, errors, worker_ids, renewals, transitions,
    failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated)
SELECT %(queue)s, 0, 'app.jobs.job_' || (g %% 10), '[]', '{}', 'SUCCESSFUL', now() - interval '2 minutes',
       now() - interval '2 minutes', now() - interval '2 minutes', now() - interval '2 minutes',
       now() - interval '1 minute', 1, 3, '{"ok": true}', '[]', '["worker-1"]', 0, 2, 0, 0, 0, 0, false, false
FROM generate_series(1, 100) AS g
"""

# Events sent to running tasks while they ran (undelivered: the recovery round's wake looks at them).
EVENTS_SQL = """
INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)
SELECT t.id, 'poke', '{}', now(), false FROM tasks_task AS t WHERE t.status = 'RUNNING' ORDER BY t.id LIMIT 20
"""


def build(n: int) -> dict[str, Any]:
    """Empty the tables, fill them; returns a sleeper's id and a waiter's (and its event's name)."""
    from django.db import connection

    from tasks.lifecycle.activity import roll_up
    from tasks.models import Worker

    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE tasks_task, tasks_taskstep, tasks_taskevent, tasks_worker, tasks_finished")
        cursor.execute(SUSPENDED_SQL, {"n": n, "queue": QUEUE})
        cursor.execute(STEPS_SQL)
        cursor.execute(DUE_SQL, {"queue": QUEUE})
        cursor.execute(RUNNING_SQL, {"queue": QUEUE})
        cursor.execute(FINISHED_SQL, {"queue": QUEUE})
        cursor.execute(EVENTS_SQL)
    Worker.objects.bulk_create(
        Worker(id=f"worker-{k}", hostname="bench", pid=k, concurrency=10, running=10) for k in range(20)
    )
    connection.close()  # VACUUM cannot run inside the transaction Django may hold
    with connection.cursor() as cursor:
        for table in ("tasks_task", "tasks_taskstep", "tasks_taskevent", "tasks_worker"):
            cursor.execute(f"VACUUM (FREEZE, ANALYZE) {table}")
        cursor.execute(
            "SELECT min(id) FILTER (WHERE mod(id, 2) = 0), min(id) FILTER (WHERE mod(id, 2) = 1) FROM tasks_task"
            " WHERE status = 'READY' AND snoozes = 1 AND id > (SELECT max(id) / 2 FROM tasks_task)"
        )
        sleeper, waiter = cursor.fetchone()
    roll_up()  # the chart's closed minutes counted once here, as the running system has them
    print(f"# built {n:,} suspended tasks (+ 1,300 others) in {time.perf_counter() - started:.1f} s", flush=True)
    return {"sleeper": sleeper, "waiter": waiter, "event": f"order-{waiter}"}


def explained_buffers(run: Callable[[], Any]) -> int:
    """Shared buffers (hit + read) of the statements ``run`` sends, each EXPLAIN (ANALYZE, BUFFERS)ed
    in a transaction rolled back (``run`` itself too): the same rows, whatever it writes."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    class _Undo(Exception):
        pass

    try:
        with transaction.atomic(), CaptureQueriesContext(connection) as captured:
            run()
            raise _Undo
    except _Undo:
        pass
    total = 0
    for query in captured.captured_queries:
        text = query["sql"].removeprefix(_JIT_OFF)  # what tasks.maintenance's statements go with
        if not text.lstrip().upper().startswith(("SELECT", "WITH", "UPDATE", "INSERT", "DELETE")):
            continue  # savepoints, SET
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SET LOCAL jit = off")
                cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text)
                plan = cursor.fetchone()[0]
                raise _Undo
        except _Undo:
            pass
        top = (json.loads(plan) if isinstance(plan, str) else plan)[0]
        total += _buffers(top["Plan"])
    return total


def _buffers(plan: dict[str, Any]) -> int:
    """The top node's buffers: they include its children's (CTEs and InitPlans among them)."""
    return int(plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0))


def statements(keys: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    from django.db import connection

    from tasks.lifecycle import statements as sql
    from tasks.maintenance.recovery import recover_once, wake_for_events
    from tasks.models import Task
    from tasks.steps import send_event

    def look() -> None:  # what _look_for sends inside the wait's step (tasks/steps.py)
        with connection.cursor() as cursor:
            cursor.execute(sql.EVENT_CHECK_SQL, {"id": keys["waiter"], "name": keys["event"], "deadline": None})

    return [
        ("claim 16, one queue", lambda: Task.objects.claim("bench", limit=16, queues=[QUEUE])),
        ("claim 16, four queues", lambda: Task.objects.claim("bench", limit=16, queues=[QUEUE, "mail", "a", "b"])),
        ("recovery: the expired-lease scan", lambda: Task.objects.recover_expired(limit=1000)),
        ("recovery round (full scan)", lambda: recover_once(batch=1000)),
        ("recovery: event wake", wake_for_events),
        ("send_event to a waiting task", lambda: send_event(keys["waiter"], keys["event"], {"paid": True})),
        ("the wait's look at its event", look),
    ]


def pages(keys: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        ("dashboard overview", "/dashboard/"),
        ("dashboard pending", "/dashboard/tasks/pending/"),
        ("dashboard sleeper's task page", f"/dashboard/tasks/{keys['sleeper']}/"),
        ("dashboard queues", "/dashboard/queues/"),
        ("api tasks ?status=READY", "/api/tasks?status=READY"),
        ("api queues", "/api/queues"),
        ("metrics", "/metrics"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,1000000", help="comma-separated counts of suspended tasks")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    server = prepare_database()
    try:
        from django.contrib.auth import get_user_model
        from django.db import connection
        from django.test import Client

        from bench.pages import page_buffers, print_ratios

        user_model = get_user_model()
        user = user_model.objects.filter(username="bench").first() or user_model.objects.create_superuser(
            "bench", "bench@example.com", "bench-password"
        )
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            print(f"# PostgreSQL {cursor.fetchone()[0]}", flush=True)
        results: dict[int, dict[str, float]] = {}
        labels: list[str] = []
        for size in sizes:
            keys = build(size)
            found: dict[str, float] = {}
            for label, run in statements(keys):
                explained_buffers(run)  # warm: the same plans and pages as the counted run
                found[label] = float(explained_buffers(run))
                print(f"  {label:<44} {found[label]:>9,.0f} buffers", flush=True)
            client = Client()
            client.force_login(user)
            found |= page_buffers(client, pages(keys))
            results[size] = found
            labels = list(found)
        print_ratios(results, sizes, labels, what="suspended (buffers)", goal=3.0)
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
