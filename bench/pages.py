#!/usr/bin/env python
"""Page cost against table size: every dashboard, lease, admin, API and metrics page, timed at
10,000 and at 1,000,000 tasks.

    python bench/pages.py [--sizes 10000,1000000] [--repeat 5]

Each size is built in the same embedded PostgreSQL (or DATABASE_URL) with ``INSERT ... SELECT
generate_series`` and a realistic mix: 85 % succeeded, 3 % failed, 2 % cancelled, 10 % waiting
(of which some retrying and some deferred), four queues from 70 % to 2 % of the tasks and a rare
one with 60 tasks at every size, ten task paths (and a rare one, 60 tasks), dedup keys on 10 %,
twenty workers. Every finished task finished within the last hour (the
worst case for the per-minute chart: a million finished tasks in its window at the large size),
spread up to a few minutes past the build so that the current minute is busy while the chart pages
are timed. The running set does not grow with the table (200 running, 5 stuck: it is bounded by the
workers, not by the history). After the build: VACUUM (FREEZE, ANALYZE), the state autovacuum leaves.

Every page is requested through Django's test client as a superuser (middleware, view, template):
one warm-up request, then the median of ``--repeat``. The last column is the ratio of the medians
(goal: at most 3x). The first request to the overview after the build also reports the one-time
catch-up of the per-minute chart (minutes closed once, then read from the rollup).

The history page and ``/api/history`` read the hourly rollup: after the build, the hours it filled
are counted by the rollup's own statement (its time is printed: what the leader's round costs for an
hour of that many finishes), and their rows are copied over the 7-day window, so both sizes have the
same 168 hours x keys. ``--only history`` times those pages alone (e.g. ``--sizes 10000,10000000``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: this folder would shadow the apps; import from the root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import prepare_database

# 'rare' (a queue) and 'app.jobs.rare' (a task path) hold 60 tasks at every size: a page filtered on
# them shows the same rows whatever the table holds, and the database must find them among the rest.
QUEUES_SQL = """CASE WHEN g %% %(stride)s = 0 THEN 'rare' WHEN r.q < 7000 THEN 'default' WHEN r.q < 9000 THEN 'mail'
                     WHEN r.q < 9800 THEN 'reports' ELSE 'billing' END"""
#: Minutes past the build over which finished_at is spread (the load goes on while pages are timed).
AHEAD_MINUTES = 5

FILL_SQL = f"""
INSERT INTO tasks_task (
    queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at, last_attempted_at,
    finished_at, attempts, max_attempts, timeout, dedup_key, return_value, errors, worker_ids, renewals,
    transitions, failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated,
    holder, token, acquired_at, renewed_at, released_at, expires_at)
SELECT {QUEUES_SQL},
       0,
       CASE WHEN (g + 7) %% %(stride)s = 0 THEN 'app.jobs.rare' ELSE 'app.jobs.job_' || (r.p %% 10) END,
       '[]'::jsonb,
       -- 'customer': 'rare' on 60 tasks at every size (like the rare queue), else one of 1,000 values (0.1 %%
       -- of the table each): the argument search's two cases.
       jsonb_build_object('n', g, 'customer',
                          CASE WHEN (g + 3) %% %(stride)s = 0 THEN to_jsonb('rare'::text) ELSE to_jsonb(g %% 1000) END),
       s.status,
       CASE WHEN s.status = 'READY' AND r.s %% 100 < 5 THEN t.at + interval '1 day' ELSE t.at END,
       t.at,
       CASE WHEN s.ran THEN t.at END,
       CASE WHEN s.ran THEN t.at END,
       CASE WHEN s.status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED') THEN t.finish END,
       CASE WHEN s.ran THEN 1 + (s.status = 'FAILED')::int ELSE 0 END,
       3, NULL,
       CASE WHEN r.d < 1000 THEN 'key-' || g END,
       CASE WHEN s.status = 'SUCCESSFUL' THEN '{{"ok": true}}'::jsonb END,
       CASE WHEN s.status = 'FAILED' OR (s.status = 'READY' AND s.ran) THEN jsonb_build_array(jsonb_build_object(
                'attempt', 1, 'worker', 'worker-' || (g %% 20), 'kind', 'failure', 'at', t.finish,
                'exception_class_path', 'builtins.ValueError', 'message', 'bad input ' || g,
                'traceback', repeat('Traceback line\n', 30)))
            WHEN r.e < 100 THEN jsonb_build_array(jsonb_build_object(
                'attempt', 1, 'worker', 'worker-' || (g %% 20), 'kind', 'vanished', 'at', t.finish,
                'exception_class_path', 'tasks.exceptions.TaskLeaseLost', 'message', 'lease expired',
                'traceback', '', 'silent_for', 31.5, 'recovery_delay', 1.5))
            ELSE '[]'::jsonb END,
       CASE WHEN s.ran THEN jsonb_build_array('worker-' || (g %% 20)) ELSE '[]'::jsonb END,
       0, CASE WHEN s.ran THEN 1 ELSE 0 END,
       (s.status = 'FAILED' OR (s.status = 'READY' AND s.ran))::int, 0, 0, 0, false, false,
       CASE WHEN s.ran THEN 'worker-' || (g %% 20) END,
       CASE WHEN s.ran THEN g END,
       CASE WHEN s.ran THEN t.at END, NULL,
       CASE WHEN s.ran THEN t.finish END,
       CASE WHEN s.ran THEN t.finish END
FROM generate_series(1, %(n)s) AS g
CROSS JOIN LATERAL (
    SELECT abs(hashint4(g)) %% 10000 AS st, abs(hashint4(g + 7919)) %% 10000 AS q,
           abs(hashint4(g + 104729)) %% 10000 AS p, abs(hashint4(g + 1299709)) %% 10000 AS d,
           abs(hashint4(g + 15485863)) %% 10000 AS e, abs(hashint4(g + 32452843)) %% 10000 AS s
) AS r
CROSS JOIN LATERAL (
    SELECT CASE WHEN r.st < 8500 THEN 'SUCCESSFUL' WHEN r.st < 8800 THEN 'FAILED' WHEN r.st < 9000 THEN 'CANCELLED'
                ELSE 'READY' END AS status,
           -- a waiting task has run before (it is retrying) in 3 of 100 cases; cancelled ones mostly never ran
           (r.st < 8800 OR (r.st >= 9000 AND r.s %% 100 >= 97)) AS ran
) AS s
CROSS JOIN LATERAL (
    -- ids follow time: the newest task was enqueued last; each finished a few seconds after enqueue
    SELECT %(now)s::timestamptz - make_interval(secs => (%(n)s - g) * 3600.0 / %(n)s) AS at,
           %(now)s::timestamptz + make_interval(mins => {AHEAD_MINUTES})
               - make_interval(secs => (%(n)s - g) * 3600.0 / %(n)s) AS finish
) AS t
"""

RUNNING_SQL = """
INSERT INTO tasks_task (
    queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at, last_attempted_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, holder, token, acquired_at, renewed_at, expires_at)
SELECT CASE WHEN g % 4 = 0 THEN 'mail' ELSE 'default' END, 0, 'app.jobs.job_' || (g % 10), '[]', '{}', 'RUNNING',
       now() - interval '10 seconds', now() - interval '10 seconds', now() - interval '5 seconds',
       now() - interval '5 seconds', 1, 3, '[]', jsonb_build_array('worker-' || (g % 20)), 1, 1, 0, 0, 0, 0, true,
       false, 'worker-' || (g % 20), nextval('leasing_fence_token_seq'), now() - interval '5 seconds', now(),
       CASE WHEN g <= 5 THEN now() - interval '3 seconds' ELSE now() + interval '1 hour' END
FROM generate_series(1, 205) AS g
"""


def build(n: int) -> dict[str, Any]:
    """Empty the tables and fill them with ``n`` tasks; returns ids and keys the pages look up."""
    from django.db import connection
    from django.utils import timezone

    from leasing.models import Lease
    from tasks.models import Worker

    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE tasks_task, tasks_worker, leasing_lease")
        for table in (
            "tasks_activityminute",
            "tasks_activityhour",
            "tasks_activityhourmark",
        ):  # rollups, where they exist
            cursor.execute("SELECT to_regclass(%s)", [table])
            if cursor.fetchone()[0]:
                cursor.execute(f"TRUNCATE {table}")
        cursor.execute(FILL_SQL, {"n": n - 205, "stride": (n - 205) // 60, "now": timezone.now()})
        cursor.execute(RUNNING_SQL)
    Worker.objects.bulk_create(
        Worker(id=f"worker-{k}", hostname="bench", pid=k, concurrency=10, running=10, stats={"succeeded": 1000})
        for k in range(20)
    )
    now = timezone.now()
    Lease.objects.bulk_create(
        Lease(
            resource=f"resource-{k}",
            holder=f"holder-{k % 7}",
            token=k + 1,
            created_at=now,
            acquired_at=now,
            expires_at=now + (1 if k % 5 else -1) * dt.timedelta(seconds=60),
            renewals=k % 3,
        )
        for k in range(100)
    )
    connection.close()  # VACUUM cannot run inside the transaction Django may hold
    with connection.cursor() as cursor:
        # FREEZE: a plain VACUUM right after the load left the visibility map unset on PostgreSQL 15
        # (relallvisible 0 of 36,955 pages), so every index-only scan fetched its heap rows (the
        # queues page's capped counts: 10,001 heap fetches a queue). Autovacuum sets it in a
        # running system; freezing gives the bench that state at once.
        cursor.execute("VACUUM (FREEZE, ANALYZE) tasks_task")
        cursor.execute("VACUUM ANALYZE tasks_worker")
        cursor.execute("VACUUM ANALYZE leasing_lease")
        cursor.execute("SELECT max(id), min(id) FROM tasks_task")
        newest, oldest = cursor.fetchone()
        cursor.execute("SELECT id FROM tasks_task WHERE status = 'FAILED' ORDER BY id LIMIT 1 OFFSET 3")
        failed_id = cursor.fetchone()[0]
        cursor.execute("SELECT dedup_key FROM tasks_task WHERE dedup_key IS NOT NULL ORDER BY id LIMIT 1 OFFSET 7")
        dedup = cursor.fetchone()[0]
    from tasks.models import BulkOperation

    BulkOperation.objects.all().delete()
    # A bulk retry half-way through the failed tasks (its pages; the batches are timed by bulk_batches).
    bulk = BulkOperation.objects.request("retry", {"queue": "mail"}, requested_by="bench")
    BulkOperation.objects.filter(pk=bulk.pk).update(status="RUNNING", cursor=(newest + oldest) // 2)
    print(f"# built {n:,} tasks in {time.perf_counter() - started:.1f} s", flush=True)
    history_rollup()
    return {
        "newest": newest,
        "middle": (newest + oldest) // 2,
        "failed": failed_id,
        "dedup": dedup,
        "bulk": bulk.pk,
    }


def bulk_batches(repeat: int) -> float:
    """Median milliseconds of one batch of the build's bulk retry (queue mail, from the middle id: at
    most 1,000 tasks changed and BULK_SPAN ids read), rolled back so that every sample does the same work."""
    from django.db import connection, transaction

    from tasks.maintenance.bulk import BulkRunner

    samples = []
    for _ in range(repeat + 1):
        with transaction.atomic():
            started = time.perf_counter()
            BulkRunner().run_batch()
            samples.append((time.perf_counter() - started) * 1000)
            transaction.set_rollback(True)
    connection.close()
    return statistics.median(samples[1:])


# Seven days of history from the hour the build filled: its rows copied to the other hours of the
# window (the page's cost depends on hours x keys, which this gives at every size, never on tasks).
HISTORY_COPY_SQL = """
INSERT INTO tasks_activityhour (hour, queue, task_path, succeeded, failed, cancelled, attempt_failures, timed,
    wait_sum, wait_max, run_sum, run_max, wait_buckets, run_buckets)
SELECT date_trunc('hour', statement_timestamp()) - make_interval(hours => k), queue, task_path, succeeded, failed,
       cancelled, attempt_failures, timed, wait_sum, wait_max, run_sum, run_max, wait_buckets, run_buckets
FROM tasks_activityhour CROSS JOIN generate_series(1, %(hours)s) AS k
WHERE hour = %(source)s
ON CONFLICT (hour, queue, task_path) DO NOTHING;
INSERT INTO tasks_activityhourmark (hour, counted_at, keys, tasks)
SELECT date_trunc('hour', statement_timestamp()) - make_interval(hours => k), statement_timestamp(), 0, 0
FROM generate_series(1, %(hours)s) AS k
ON CONFLICT (hour) DO NOTHING
"""


def history_rollup() -> None:
    """The history rollup of the built table: the hours the build filled counted by the rollup's own
    statement (timed: what a round costs for an hour of that many finishes), then copied to fill
    the window."""
    from django.db import connection
    from django.utils import timezone

    from tasks.conf import get_settings
    from tasks.maintenance.history import count_hour

    current = timezone.now().replace(minute=0, second=0, microsecond=0)
    counted = {}
    for hour in (current - dt.timedelta(hours=1), current):
        started = time.perf_counter()
        counted[hour] = count_hour(hour)
        print(f"# history: counted {hour:%H:00} ({counted[hour]:,} tasks) in {time.perf_counter() - started:.1f} s")
    source = max(counted, key=lambda hour: counted[hour])
    with connection.cursor() as cursor:
        cursor.execute(HISTORY_COPY_SQL, {"source": source, "hours": get_settings().HISTORY_HOURS})
        cursor.execute("ANALYZE tasks_activityhour")
        cursor.execute("SELECT count(*) FROM tasks_activityhour")
        print(f"# history: {cursor.fetchone()[0]:,} rollup rows", flush=True)


def pages(keys: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, url) of every page, in the order they are timed (the chart pages first)."""
    admin = "/admin/tasks/task/"
    return [
        ("dashboard overview", "/dashboard/"),
        ("metrics", "/metrics"),
        *[(f"dashboard {state}", f"/dashboard/tasks/{state}/") for state in _states()],
        ("dashboard succeeded ?queue=mail", "/dashboard/tasks/succeeded/?queue=mail"),
        ("dashboard failed ?queue=rare", "/dashboard/tasks/failed/?queue=rare"),
        ("dashboard pending ?queue=billing", "/dashboard/tasks/pending/?queue=billing"),
        ("dashboard succeeded ?q=<task path>", "/dashboard/tasks/succeeded/?q=app.jobs.job_3"),
        ("dashboard failed ?q=<rare task path>", "/dashboard/tasks/failed/?q=app.jobs.rare"),
        ("dashboard failed ?q=<id>", f"/dashboard/tasks/failed/?q={keys['failed']}"),
        ("dashboard succeeded ?q=<dedup key>", f"/dashboard/tasks/succeeded/?q={keys['dedup']}"),
        ("dashboard succeeded ?q=<holder>", "/dashboard/tasks/succeeded/?q=worker-7"),
        ("dashboard succeeded ?before=<middle id>", f"/dashboard/tasks/succeeded/?before={keys['middle']}"),
        ("dashboard retrying ?q=<task path>", "/dashboard/tasks/retrying/?q=app.jobs.job_2"),
        ("dashboard task detail", f"/dashboard/tasks/{keys['failed']}/"),
        ("dashboard workers", "/dashboard/workers/"),
        ("dashboard generator", "/dashboard/generator/"),
        ("dashboard queues", "/dashboard/queues/"),
        ("dashboard schedules", "/dashboard/schedules/"),
        ("dashboard history", "/dashboard/history/"),
        ("dashboard history ?queue=mail", "/dashboard/history/?queue=mail"),
        ("dashboard history ?task_path=<rare>&hours=24", "/dashboard/history/?task_path=app.jobs.rare&hours=24"),
        ("dashboard worker detail", "/dashboard/workers/worker-7/"),
        ("lease pages", "/leases/"),
        ("lease pages expired", "/leases/expired/"),
        ("api tasks", "/api/tasks"),
        ("api tasks ?queue=mail", "/api/tasks?queue=mail"),
        ("api tasks ?queue=rare", "/api/tasks?queue=rare"),
        ("api tasks ?status=FAILED", "/api/tasks?status=FAILED"),
        ("api tasks ?status=READY&queue=billing", "/api/tasks?status=READY&queue=billing"),
        ("api tasks ?before=<middle id>", f"/api/tasks?before={keys['middle']}"),
        ("api tasks/processed", "/api/tasks/processed"),
        ("api tasks/started", "/api/tasks/started"),
        ("api tasks/stuck", "/api/tasks/stuck"),
        ("api leases", "/api/leases"),
        ("api queues", "/api/queues"),
        ("api schedules", "/api/schedules"),
        ("api history", "/api/history"),
        ("api history ?queue=rare&hours=24", "/api/history?queue=rare&hours=24"),
        ("task admin", admin),
        ("task admin ?status=FAILED", f"{admin}?status__exact=FAILED"),
        ("task admin ?queue=rare", f"{admin}?queue__exact=rare"),
        ("task admin ?queue=billing", f"{admin}?queue__exact=billing"),
        ("task admin ?queue=mail&status=READY", f"{admin}?queue__exact=mail&status__exact=READY"),
        ("task admin ?lease=stuck", f"{admin}?lease=stuck"),
        ("task admin page 50", f"{admin}?p=50"),
        ("task admin search <task path>", f"{admin}?q=app.jobs.job_4"),
        ("task admin search <id>", f"{admin}?q={keys['failed']}"),
        ("task admin search <holder>", f"{admin}?q=worker-3"),
        ("task admin search <dedup key>", f"{admin}?q={keys['dedup']}"),
        ("task admin change page", f"{admin}{keys['failed']}/change/"),
        # Argument search (tasks/web/argument_search.py): refused without its opt-in index; with it
        # (--argument-index), served by the GIN index: 60 matches at every size, then 0.1 % of the table.
        ("argument search succeeded <60 rows>", '/dashboard/tasks/succeeded/?q=kwargs:{"customer":"rare"}'),
        ("argument search succeeded <0.1 %>", '/dashboard/tasks/succeeded/?q=kwargs:{"customer":7}'),
        ("argument search admin <60 rows>", f'{admin}?q=kwargs:{{"customer":"rare"}}'),
        *(
            [
                ("dashboard bulk", "/dashboard/tasks/bulk/"),
                ("dashboard bulk detail", f"/dashboard/tasks/bulk/{keys['bulk']}/"),
                ("api bulk detail", f"/api/tasks/bulk/{keys['bulk']}"),
            ]
            if "bulk" in keys
            else []
        ),
        ("lease admin", "/admin/leasing/lease/"),
        ("lease admin search", "/admin/leasing/lease/?q=holder-3"),
    ]


def _states() -> list[str]:
    from tasks.web.dashboard import TASK_STATES

    return list(TASK_STATES)


def time_pages(client: Any, urls: list[tuple[str, str]], repeat: int) -> dict[str, float]:
    medians: dict[str, float] = {}
    for label, url in urls:
        started = time.perf_counter()
        response = client.get(url)
        first = (time.perf_counter() - started) * 1000
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.content[:300]!r}")
        samples = []
        for _ in range(repeat):
            started = time.perf_counter()
            client.get(url)
            samples.append((time.perf_counter() - started) * 1000)
        medians[label] = statistics.median(samples)
        note = f" (first request {first:.0f} ms)" if label == "dashboard overview" else ""
        print(f"  {label:<44} {medians[label]:>9.1f} ms{note}", flush=True)
    return medians


#: A statement ``page_buffers`` may run under EXPLAIN ANALYZE (which executes it): a read, not one
#: that writes or locks.
_WRITES = re.compile(r"\b(INSERT|UPDATE|DELETE|MERGE|NOTIFY|nextval|setval|pg_advisory)\b", re.IGNORECASE)
_JIT_OFF = "SELECT set_config('jit', 'off', true); "


def page_buffers(client: Any, urls: list[tuple[str, str]]) -> dict[str, float]:
    """Shared buffers (hit + read) each page's read statements touch, from EXPLAIN (ANALYZE, BUFFERS)
    of every SELECT the page ran (captured through Django, parameters in place): a count, not a
    time, so a busy machine does not bend it. Statements that write or lock (the session's save,
    the chart's catch-up) are left out; so is planning."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    found: dict[str, float] = {}
    for label, url in urls:
        client.get(url)  # warm: the same statements as the timed requests
        with CaptureQueriesContext(connection) as captured:
            client.get(url)
        total = 0
        for query in captured.captured_queries:
            sql = query["sql"]
            if sql.startswith(_JIT_OFF):
                sql = sql[len(_JIT_OFF) :]
            if not sql.lstrip().upper().startswith(("SELECT", "WITH")) or _WRITES.search(sql) or ";" in sql:
                continue
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SET LOCAL jit = off")
                cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql)
                plan = cursor.fetchone()[0]
            top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
            total += top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
        found[label] = float(total)
        print(f"  {label:<44} {total:>9,} buffers", flush=True)
    return found


def print_ratios(
    results: dict[int, dict[str, float]], sizes: list[int], labels: list[str], *, what: str, goal: float
) -> None:
    """The medians as a Markdown table, each size's ratio to the first, and the worst ratio."""
    base, *others = sizes
    print()
    header = " | ".join(f"{size:,} {what}" for size in sizes)
    print(f"| page | {header} | " + " | ".join(f"ratio {s:,} / {base:,}" for s in others) + " |")
    print("| --- |" + " ---: |" * (len(sizes) + len(others)))
    worst = 0.0
    for label in labels:
        cells = " | ".join(f"{results[size][label]:.1f}" for size in sizes)
        ratios = [results[size][label] / results[base][label] for size in others]
        worst = max([worst, *ratios])
        print(f"| {label} | {cells} | " + " | ".join(f"{ratio:.2f}x" for ratio in ratios) + " |")
    print(f"\nworst ratio: {worst:.2f}x (goal: at most {goal:g}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,1000000", help="comma-separated task counts (first is the base)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pages", "--only", default="", help="time only the pages whose label contains this text")
    parser.add_argument(
        "--argument-index", action="store_true", help="build the opt-in argument search index after each fill"
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    server = prepare_database()
    try:
        from django.contrib.auth import get_user_model
        from django.test import Client

        user_model = get_user_model()
        user = user_model.objects.filter(username="bench").first() or user_model.objects.create_superuser(
            "bench", "bench@example.com", "bench-password"
        )
        results: dict[int, dict[str, float]] = {}
        labels: list[str] = []
        for size in sizes:
            keys = build(size)
            if args.argument_index:
                from django.core.management import call_command

                started = time.perf_counter()
                call_command("tasks_search_index", "create")
                print(f"# argument search index built in {time.perf_counter() - started:.1f}s", flush=True)
            client = Client()
            client.force_login(user)
            urls = [(label, url) for label, url in pages(keys) if args.pages in label]
            labels = [label for label, _ in urls]
            print(f"# {size:,} tasks: median of {args.repeat} (ms)", flush=True)
            results[size] = time_pages(client, urls, args.repeat)
            if "bulk" in args.pages:
                results[size]["bulk retry: one batch"] = bulk_batches(args.repeat)
                print(f"  {'bulk retry: one batch':<44} {results[size]['bulk retry: one batch']:>9.1f} ms", flush=True)
                labels = [*labels, "bulk retry: one batch"]
        print_ratios(results, sizes, labels, what="tasks", goal=3.0)
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
