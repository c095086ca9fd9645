#!/usr/bin/env python
"""Page cost against the finished history kept in ``tasks_finished`` (issue 43): every page of
bench/pages.py, with the same live table, beside 10,000 retained finished tasks and beside millions.

    python bench/finished_pages.py [--sizes 10000,10000000] [--hot 10000] [--repeat 5] [--only TEXT]

For each size, ``tasks_finished`` is emptied and filled with that many finished tasks (``INSERT ...
SELECT generate_series``, the mover's layout: one partition per final status and UTC day, created by
the product's own ``create_day``), finished over the last seven days and at least 70 minutes ago
(what the mover may take), ids below the live table's (they were enqueued before it): 94 % succeeded,
3.5 % failed, 2.5 % cancelled, the four common queues and ten task paths of bench/pages.py, dedup
keys on 10 %, twenty workers. None is in the rare queue or of the rare task path, so a page filtered
on them shows the same rows at every size: the database must find that the history holds none. Then
``tasks_task`` is built by bench/pages.py's ``build`` at ``--hot`` tasks (the same at every size: live
work and the last hour's finished tasks), and both tables are vacuumed (FREEZE, ANALYZE).

Every page of bench/pages.py is then timed as there (Django's test client as a superuser, one
warm-up request, the median of ``--repeat``); the last column is the ratio to the first size (the
issue's goal: at most 1.5x). The claim and the finish never read ``tasks_finished`` (no statement of
theirs names it), so what the history holds cannot change them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: this folder would shadow the apps; import from the root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import prepare_database
from bench.pages import build, page_buffers, pages, print_ratios, time_pages

#: Days of history (and partitions per status: one more, today's).
DAYS = 7

FILL_FINISHED_SQL = """
INSERT INTO tasks_finished (
    id, queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at, last_attempted_at,
    finished_at, attempts, max_attempts, dedup_key, return_value, errors, worker_ids, renewals, transitions,
    failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, holder, token,
    acquired_at, renewed_at, released_at, expires_at, errors_dropped, snoozes, rate_refusals, api_origin,
    finish_waited, waiting_on)
SELECT nextval('tasks_task_id_seq'),
       CASE WHEN r.q < 7000 THEN 'default' WHEN r.q < 9000 THEN 'mail' WHEN r.q < 9800 THEN 'reports'
            ELSE 'billing' END,
       0,
       'app.jobs.job_' || (r.p %% 10),
       '[]'::jsonb,
       jsonb_build_object('n', g, 'customer', g %% 1000),
       s.status,
       t.at, t.at, t.at, t.at, t.at + interval '2 seconds',
       1 + (s.status = 'FAILED')::int, 3,
       CASE WHEN r.d < 1000 THEN 'old-key-' || g END,
       CASE WHEN s.status = 'SUCCESSFUL' THEN '{"ok": true}'::jsonb END,
       CASE WHEN s.status = 'FAILED' THEN jsonb_build_array(jsonb_build_object(
                'attempt', 1, 'worker', 'worker-' || (g %% 20), 'kind', 'failure', 'at', t.at,
                'exception_class_path', 'builtins.ValueError', 'message', 'bad input ' || g,
                'traceback', repeat('Traceback line\n', 30)))
            ELSE '[]'::jsonb END,
       jsonb_build_array('worker-' || (g %% 20)),
       0, 1, (s.status = 'FAILED')::int, 0, 0, 0, false, false,
       'worker-' || (g %% 20), g, t.at, NULL, t.at + interval '2 seconds', t.at + interval '30 seconds',
       0, 0, 0, false, false, 0
FROM generate_series(1, %(n)s) AS g
CROSS JOIN LATERAL (
    SELECT abs(hashint4(g)) %% 10000 AS st, abs(hashint4(g + 7919)) %% 10000 AS q,
           abs(hashint4(g + 104729)) %% 10000 AS p, abs(hashint4(g + 1299709)) %% 10000 AS d
) AS r
CROSS JOIN LATERAL (
    SELECT CASE WHEN r.st < 9400 THEN 'SUCCESSFUL' WHEN r.st < 9750 THEN 'FAILED' ELSE 'CANCELLED' END AS status
) AS s
CROSS JOIN LATERAL (
    -- ids follow time: the oldest first, the newest 70 minutes before now
    SELECT %(newest)s::timestamptz - make_interval(secs => (%(n)s - g) * %(span)s / %(n)s) AS at
) AS t
"""


def fill_finished(n: int) -> None:
    """Empty tasks_finished (its day partitions dropped) and fill it with ``n`` finished tasks."""
    from django.db import connection

    from tasks.maintenance.partitions import create_day, partitions

    started = time.perf_counter()
    with connection.cursor() as cursor:
        for partition in partitions():
            cursor.execute(f'DROP TABLE "{partition.name}"')
        cursor.execute("SELECT statement_timestamp()")
        now: dt.datetime = cursor.fetchone()[0]
    newest = now - dt.timedelta(minutes=70)
    oldest = newest - dt.timedelta(days=DAYS) + dt.timedelta(seconds=1)
    day = oldest.astimezone(dt.timezone.utc).date()
    while day <= now.astimezone(dt.timezone.utc).date() + dt.timedelta(days=1):
        for status in ("SUCCESSFUL", "FAILED", "CANCELLED"):
            create_day(status, day)
        day += dt.timedelta(days=1)
    with connection.cursor() as cursor:
        cursor.execute(FILL_FINISHED_SQL, {"n": n, "newest": newest, "span": (newest - oldest).total_seconds()})
    connection.close()  # VACUUM cannot run inside the transaction Django may hold
    with connection.cursor() as cursor:
        cursor.execute("VACUUM (FREEZE, ANALYZE) tasks_finished")
        cursor.execute(
            "SELECT pg_size_pretty(sum(pg_total_relation_size(inhrelid))) FROM pg_inherits"
            " JOIN pg_class c ON c.oid = inhrelid WHERE c.relname LIKE 'tasks_finished_%%_2%%'"
        )
        size = cursor.fetchone()[0]
    print(
        f"# {n:,} finished tasks in tasks_finished ({len(partitions())} day partitions, {size})"
        f" in {time.perf_counter() - started:.1f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,10000000", help="finished tasks retained (first is the base)")
    parser.add_argument("--hot", type=int, default=10000, help="tasks in tasks_task at every size")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default="", help="time only the pages whose label contains this text")
    parser.add_argument(
        "--buffers", action="store_true", help="also count each page's shared buffers (EXPLAIN ANALYZE, BUFFERS)"
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
        buffers: dict[int, dict[str, float]] = {}
        labels: list[str] = []
        for size in sizes:
            fill_finished(size)
            keys: dict[str, Any] = build(args.hot)
            client = Client()
            client.force_login(user)
            urls = [(label, url) for label, url in pages(keys) if args.only in label]
            labels = [label for label, _ in urls]
            print(f"# {size:,} finished tasks retained, {args.hot:,} in tasks_task: median of {args.repeat} (ms)")
            results[size] = time_pages(client, urls, args.repeat)
            if args.buffers:
                print(f"# {size:,} finished tasks retained: shared buffers of each page's reads (EXPLAIN)")
                buffers[size] = page_buffers(client, urls)
        print_ratios(results, sizes, labels, what="retained", goal=1.5)
        if args.buffers:
            print("\nShared buffers (hit + read) of each page's read statements:")
            print_ratios(buffers, sizes, labels, what="retained", goal=1.5)
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
