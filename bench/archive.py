#!/usr/bin/env python
"""The mover on an upgrade (issue 43): an installation whose ``tasks_task`` keeps ``--size`` finished
tasks turns ``ARCHIVE_AFTER`` on, while its workers go on.

    python bench/archive.py [--size 1000000] [--days 6] [--tasks 20000]

1. ``--size`` finished plain tasks (85 % succeeded, 10 % failed, 5 % cancelled, four queues) spread
   evenly over the last ``--days`` days (within every status's default retention), loaded with
   ``INSERT ... SELECT`` a million at a time, then ``VACUUM ANALYZE``.
2. The history rollup (the product's ``roll_up_hours``) counts every hour of its window: its seconds
   (an installation that ran the product has counted them already); the marks are then aged past
   the mover's ``COUNTED_MARGIN``.
3. ``before``: a drain of ``--tasks`` no-op tasks by one worker process (bench/retained.py's: rate,
   CPU per 1,000 tasks of the worker and of the server, tasks_task buffers per task).
4. ``the move``: the product's ``Archiver`` (``ARCHIVE_AFTER`` "0s", batches of
   ``RETENTION_BATCH_SIZE``), flat out on one connection until nothing is left to move, while the
   same drain runs beside it: rows moved per second, the day partitions it made, the rows left in
   ``tasks_task``, and the drain's figures during the move.
5. ``after``: the drain again, against the hot table the move left (vacuumed: its free space is
   spread over the pages the moved rows held); ``compacted``: once more after ``VACUUM FULL
   tasks_task`` and ``ANALYZE`` (pg_repack does the first online), against a table holding only
   what is live.
6. Retiring the oldest day of successes with the product's ``retire``: ``DETACH PARTITION ...
   CONCURRENTLY`` and ``DROP TABLE``, its seconds and the dead tuples it left (none: no row deleted).

Default durability (fsync on), the embedded PostgreSQL unless DATABASE_URL names another.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: this folder would shadow the apps; import from the root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.peer_settings"

from bench.common import prepare_database

CHUNK = 1_000_000

# Finished plain tasks, evenly over the last %(days)s days up to an hour ago; statuses and queues by
# the row's number.
LOAD_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at,
    last_attempted_at, finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions, failures,
    crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, errors_dropped, return_value)
SELECT 'q' || (g %% 4), 0, 'app.jobs.t' || (g %% 7), '[]', jsonb_build_object('n', g),
       CASE WHEN g %% 20 < 17 THEN 'SUCCESSFUL' WHEN g %% 20 < 19 THEN 'FAILED' ELSE 'CANCELLED' END,
       f.at - interval '2 s', f.at - interval '2 s', f.at - interval '1 s', f.at - interval '1 s', f.at,
       1, 3, '[]', '["worker-1"]', 0, 1, 0, 0, 0, 0, true, false, 0, to_jsonb(g)
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g
CROSS JOIN LATERAL (
    SELECT statement_timestamp() - interval '1 hour'
           - make_interval(secs => (%(size)s - g) * (%(days)s * 86400.0 - 3600) / %(size)s) AS at
) AS f
"""


def load(size: int, days: int) -> float:
    from django.db import connection

    started = time.perf_counter()
    with connection.cursor() as cursor:
        for first in range(1, size + 1, CHUNK):
            last = min(first + CHUNK - 1, size)
            cursor.execute(LOAD_SQL, {"first": first, "last": last, "size": size, "days": days})
    connection.close()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE tasks_task")
    return time.perf_counter() - started


def count_history() -> float:
    from django.db import connection

    from tasks.maintenance.history import COUNTED_MARGIN, roll_up_hours

    started = time.perf_counter()
    roll_up_hours()
    seconds = time.perf_counter() - started
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_activityhourmark SET counted_at = counted_at - make_interval(secs => %s)",
            [COUNTED_MARGIN + 60],
        )
    return seconds


def in_hot_table() -> int:
    """Rows left in tasks_task besides the drains' own."""
    from django.db import connection

    from bench.retained import QUEUE

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM tasks_task WHERE queue <> %s", [QUEUE])
        return int(cursor.fetchone()[0])


def move(tasks: int, log_dir: Path) -> dict[str, Any]:
    """Run the product's mover to the end while a drain runs beside it."""
    from bench.retained import drain
    from tasks.maintenance.archive import Archiver
    from tasks.maintenance.partitions import partitions

    beside: dict[str, Any] = {}

    def drain_beside() -> None:
        from django.db import connection

        try:
            beside.update(drain(tasks, log_dir))
        finally:
            connection.close()

    made_before = len(partitions())
    thread = threading.Thread(target=drain_beside)
    thread.start()
    archiver = Archiver(interval=3600.0)
    started = time.perf_counter()
    moved = 0
    while True:
        step = archiver.run_for(1.0)
        moved += step
        if archiver._pass is None:  # the pass ended: nothing more to move
            break
    seconds = time.perf_counter() - started
    thread.join()
    return {
        "moved": moved,
        "seconds": seconds,
        "rate": moved / seconds if seconds else 0.0,
        "partitions": len(partitions()) - made_before,
        "drain": beside,
    }


def retire_oldest_day() -> dict[str, Any]:
    from django.db import connection

    from bench.retained import stats_flushed
    from tasks.maintenance.partitions import partitions, retire

    oldest = next(p for p in partitions() if p.status == "SUCCESSFUL" and p.day is not None)
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT count(*) FROM "{oldest.name}"')
        rows = int(cursor.fetchone()[0])
    assert oldest.ends is not None
    started = time.perf_counter()
    retired = retire({"SUCCESSFUL": oldest.ends})
    seconds = time.perf_counter() - started
    stats_flushed()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT COALESCE(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE relname LIKE 'tasks_finished%%'"
        )
        dead = int(cursor.fetchone()[0])
    return {"retired": retired, "rows": rows, "mb": oldest.bytes / 1e6, "seconds": seconds, "dead": dead}


def line(name: str, result: dict[str, float]) -> str:
    return (
        f"{name}  {result['rate']:,.0f} tasks/s  [CPU per 1,000 tasks: worker {result['worker_ms']:.0f} ms,"
        f" postgres {result['server_ms']:.0f} ms; tasks_task buffers per task {result['buffers']:.1f}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1_000_000, help="finished tasks in tasks_task before the move")
    parser.add_argument("--days", type=int, default=6, help="days the finished tasks are spread over (1-6)")
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks per drain")
    args = parser.parse_args()
    if not 1 <= args.days <= 6:
        parser.error("--days must be 1 to 6: every status's default retention keeps them")
    server = prepare_database()
    log_dir = Path(tempfile.mkdtemp(prefix="leasing-archive-"))
    try:
        from django.db import connection
        from django.test.utils import override_settings

        from bench.retained import drain, forget_drained

        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            version = cursor.fetchone()[0]
        print(f"# PostgreSQL {version}; {args.size:,} finished tasks over {args.days} days", flush=True)
        print(f"archive.load  {load(args.size, args.days):.1f} s", flush=True)
        print(f"archive.history  every hour counted in {count_history():.1f} s", flush=True)
        print(line("archive.before", drain(args.tasks, log_dir)), flush=True)
        forget_drained()
        with override_settings(LEASING_TASKS={"ARCHIVE_AFTER": "0s"}):
            moved = move(args.tasks, log_dir)
        print(
            f"archive.move  {moved['moved']:,} rows in {moved['seconds']:.1f} s ({moved['rate']:,.0f}/s),"
            f" {moved['partitions']} day partitions made; {in_hot_table():,} rows left in tasks_task"
            " (besides the drain's)",
            flush=True,
        )
        print(line("archive.during", moved["drain"]), flush=True)
        forget_drained()
        print(line("archive.after", drain(args.tasks, log_dir)), flush=True)
        forget_drained()
        started = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute("VACUUM FULL tasks_task")
            cursor.execute("ANALYZE tasks_task")
        compacted = time.perf_counter() - started
        name = f"archive.compacted (VACUUM FULL, ANALYZE: {compacted:.1f} s)"
        print(line(name, drain(args.tasks, log_dir)), flush=True)
        forget_drained()
        retired = retire_oldest_day()
        print(
            f"archive.retire  {retired['retired']} ({retired['rows']:,} rows, {retired['mb']:,.0f} MB):"
            f" {retired['seconds']:.2f} s; dead tuples in tasks_finished {retired['dead']:,}",
            flush=True,
        )
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
