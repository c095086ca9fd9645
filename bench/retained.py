#!/usr/bin/env python
"""The claim, the finish and retention against retained history (issue 43's first measurement):
what a drain and a prune cost when ``tasks_task`` keeps 10,000 finished tasks, and when it keeps
millions.

    python bench/retained.py [--sizes 10000,10000000] [--tasks 20000] [--rounds 3]

For each size the table is built by bench/pages.py's ``build`` (its realistic mix: 85 % succeeded,
3 % failed, 2 % cancelled, 10 % waiting, four queues, dedup keys, 200 running tasks; VACUUM FREEZE
ANALYZE after the load). Then:

- ``--rounds`` drains of ``--tasks`` no-op tasks by one worker process (bench/peers.py's: 8 threads,
  claim batch 64, recovery off) in a queue of their own: timed from the bulk enqueue to nothing
  left in that queue; the CPU per 1,000 tasks of the worker and of the server (from /proc, as
  bench/compare.py), and the buffers ``tasks_task`` (heap and indexes) was read from per task
  (pg_statio_user_tables: hits + reads). After each round the drained rows are deleted and the
  table vacuumed, so every round meets the same history.
- retention: the product's own prune (``tasks.maintenance.retention.prune``, batches of the
  default size) of the oldest tenth of the succeeded tasks: its seconds and rows per second, the
  dead tuples it left in ``tasks_task`` (``n_dead_tup``), and what the VACUUM that removes them took.
  This is the cost a time-partitioned layout replaces with a ``DROP`` of a partition.
- the mover of the layout chosen for issue 43 (docs/explanation/finished-storage.md), as a
  prototype: ``bench_finished`` (the columns of ``tasks_task``, range-partitioned by day of
  ``finished_at``, six page indexes) is filled by the next tenth of the succeeded tasks in batches of
  1,000, each batch one statement (``DELETE ... RETURNING`` the rows retention's prune would pick,
  inserted into the partitions); its rows per second, then what ``DETACH PARTITION ... CONCURRENTLY``
  and ``DROP TABLE`` of the fullest day take. ``bench_finished`` is dropped after.

Default durability (fsync on), the embedded PostgreSQL unless DATABASE_URL names another.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: this folder would shadow the apps; import from the root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.peer_settings"

from bench.common import prepare_database, stop_processes

QUEUE = "bench"  # bench/peers.py's worker serves this queue; bench/pages.py's build never fills it


def statio() -> int:
    """Buffers of tasks_task and its indexes read so far (hits and reads), every backend's."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT heap_blks_hit + heap_blks_read + COALESCE(idx_blks_hit, 0) + COALESCE(idx_blks_read, 0)"
            " FROM pg_statio_user_tables WHERE relname = 'tasks_task'"
        )
        return int(cursor.fetchone()[0])


def stats_flushed() -> None:
    """Make this backend's and the others' statistics visible (PostgreSQL 15+ flushes them at most
    once a second: wait for the next flush rather than read a stale counter)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
    time.sleep(1.1)  # the other backends' (the worker's) pending counters: their flush interval
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")


def any_left() -> bool:
    """Whether the drain's queue still has a task waiting or running: the claim's index for the
    waiting ones, the running set (bounded by the workers) for the others; neither read grows with
    the retained rows, so the poll's own buffers stay out of the comparison."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM tasks_task WHERE queue = %(q)s AND status = 'READY')"
            " OR EXISTS (SELECT 1 FROM tasks_task WHERE status = 'RUNNING' AND COALESCE(queue, '') = %(q)s)",
            {"q": QUEUE},
        )
        return bool(cursor.fetchone()[0])


def drain(n: int, log_dir: Path) -> dict[str, float]:
    from bench.compare import cpu_split, cpu_times, server_pids, start_workers
    from tasks.models import Task

    procs = start_workers("django-leasing", 1, log_dir)
    try:
        stats_flushed()
        buffers = statio()
        pids = [proc.pid for proc in procs]
        before = cpu_times([*pids, *server_pids()])
        started = time.perf_counter()
        Task.objects.bulk_enqueue("bench.handlers.noop", ({"i": i} for i in range(n)), queue=QUEUE)
        deadline = started + 1800
        while any_left():
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{n} tasks not drained in 30 minutes")
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
        cpu = cpu_split(pids, before)
    finally:
        stop_processes(procs)
    stats_flushed()
    return {
        "rate": n / elapsed,
        "worker_ms": cpu["workers"] * 1e6 / n,
        "server_ms": cpu["postgres"] * 1e6 / n,
        "buffers": (statio() - buffers) / n,
    }


def forget_drained() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM tasks_task WHERE queue = %s", [QUEUE])
        cursor.execute("TRUNCATE tasks_worker")
    connection.close()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM tasks_task")


def retention(size: int) -> dict[str, float]:
    """Prune the oldest tenth of the succeeded tasks with the product's own prune."""
    from django.db import connection
    from django.utils import timezone

    from tasks.maintenance.retention import prune

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT finished_at FROM tasks_task WHERE status = 'SUCCESSFUL' AND finished_at IS NOT NULL"
            " ORDER BY status, finished_at, id OFFSET %s LIMIT 1",
            [int(size * 0.85) // 10],
        )
        cutoff = cursor.fetchone()[0]
    age = timezone.now() - cutoff
    started = time.perf_counter()
    deleted = prune({"SUCCESSFUL": age}).get("SUCCESSFUL", 0)
    seconds = time.perf_counter() - started
    stats_flushed()
    with connection.cursor() as cursor:
        cursor.execute("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'tasks_task'")
        dead = int(cursor.fetchone()[0])
    connection.close()
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM tasks_task")
    vacuum = time.perf_counter() - started
    return {
        "deleted": deleted,
        "seconds": seconds,
        "rate": deleted / seconds if seconds else 0.0,
        "dead": dead,
        "vacuum": vacuum,
    }


MOVE_SQL = """
WITH picked AS (
    SELECT id FROM tasks_task
    WHERE status = 'SUCCESSFUL' AND finished_at IS NOT NULL AND (finished_at, id) > (%(at)s, %(id)s)
    ORDER BY status, finished_at, id LIMIT %(n)s FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM tasks_task AS t USING picked WHERE t.id = picked.id RETURNING t.*
)
INSERT INTO bench_finished SELECT * FROM moved RETURNING finished_at, id
"""
FINISHED_INDEXES = {
    "status": "status, id DESC",
    "queue": "queue, status, id DESC",
    "path": "task_path, status, id DESC",
    "holder": "holder, status, id DESC) WHERE (holder IS NOT NULL",
    "dedup": "dedup_key, status, id DESC) WHERE (dedup_key IS NOT NULL",
    "workflow": "workflow_id, status, id DESC) WHERE (workflow_id IS NOT NULL",
}


def mover(size: int, batch: int = 1000) -> dict[str, float]:
    """Move the next tenth of the succeeded tasks into day partitions (the prototype above)."""
    from django.db import connection, transaction

    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS bench_finished")
        cursor.execute(
            "CREATE TABLE bench_finished (LIKE tasks_task INCLUDING DEFAULTS) PARTITION BY RANGE (finished_at)"
        )
        cursor.execute(
            "ALTER TABLE bench_finished ALTER COLUMN finished_at SET NOT NULL, ADD PRIMARY KEY (id, finished_at)"
        )
        cursor.execute("SELECT min(finished_at), max(finished_at) FROM tasks_task WHERE status = 'SUCCESSFUL'")
        first, last = cursor.fetchone()
        day = first.astimezone(dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
        while day <= last:
            cursor.execute(
                f"CREATE TABLE bench_finished_{day:%Y%m%d} PARTITION OF bench_finished FOR VALUES FROM (%s) TO (%s)",
                [day, day + dt.timedelta(days=1)],
            )
            day += dt.timedelta(days=1)
        for name, columns in FINISHED_INDEXES.items():
            cursor.execute(f"CREATE INDEX bench_finished_{name}_idx ON bench_finished ({columns})")
    target = int(size * 0.85) // 10
    at, last_id, moved = first - dt.timedelta(seconds=1), 0, 0
    started = time.perf_counter()
    while moved < target:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(MOVE_SQL, {"at": at, "id": last_id, "n": min(batch, target - moved)})
            rows = cursor.fetchall()
        if not rows:
            break
        moved += len(rows)
        at, last_id = max(rows)
    seconds = time.perf_counter() - started
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_inherits AS i JOIN pg_class AS c"
            " ON c.oid = i.inhrelid WHERE i.inhparent = 'bench_finished'::regclass ORDER BY 2 DESC LIMIT 1"
        )
        fullest, size_bytes = cursor.fetchone()
        cursor.execute(f"SELECT count(*) FROM {fullest}")
        rows_in = cursor.fetchone()[0]
        started = time.perf_counter()
        cursor.execute(f"ALTER TABLE bench_finished DETACH PARTITION {fullest} CONCURRENTLY")
        detach = time.perf_counter() - started
        started = time.perf_counter()
        cursor.execute(f"DROP TABLE {fullest}")
        drop = time.perf_counter() - started
        cursor.execute("DROP TABLE bench_finished")
    return {
        "moved": moved,
        "rate": moved / seconds if seconds else 0.0,
        "partition_rows": rows_in,
        "partition_mb": size_bytes / 1e6,
        "detach": detach,
        "drop": drop,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,10000000", help="comma-separated retained task counts")
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks per drain")
    parser.add_argument("--rounds", type=int, default=3, help="drains per size")
    parser.add_argument("--no-retention", action="store_true", help="skip the prune")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    server = prepare_database()
    log_dir = Path(tempfile.mkdtemp(prefix="leasing-retained-"))
    try:
        from django.db import connection

        from bench.pages import build

        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            version = cursor.fetchone()[0]
        print(f"# PostgreSQL {version}; drains of {args.tasks:,} no-op tasks, 1 worker process", flush=True)
        rows: list[tuple[int, list[dict[str, float]], dict[str, float] | None, dict[str, float]]] = []
        for size in sizes:
            build(size)
            drains = []
            for round_no in range(1, args.rounds + 1):
                result = drain(args.tasks, log_dir)
                drains.append(result)
                print(
                    f"retained.{size}.drain.round={round_no}  {result['rate']:,.0f} tasks/s  [CPU per 1,000 tasks:"
                    f" worker {result['worker_ms']:.0f} ms, postgres {result['server_ms']:.0f} ms;"
                    f" tasks_task buffers per task {result['buffers']:.1f}]",
                    flush=True,
                )
                forget_drained()
            pruned = None
            if not args.no_retention:
                pruned = retention(size)
                print(
                    f"retained.{size}.prune  {pruned['deleted']:,} rows in {pruned['seconds']:.1f} s"
                    f" ({pruned['rate']:,.0f}/s); dead tuples left {pruned['dead']:,}; VACUUM {pruned['vacuum']:.1f} s",
                    flush=True,
                )
            moved = mover(size)
            print(
                f"retained.{size}.mover  {moved['moved']:,} rows moved at {moved['rate']:,.0f}/s (batches of 1,000);"
                f" the fullest day ({moved['partition_rows']:,} rows, {moved['partition_mb']:,.0f} MB):"
                f" DETACH CONCURRENTLY {moved['detach']:.2f} s, DROP {moved['drop']:.2f} s",
                flush=True,
            )
            rows.append((size, drains, pruned, moved))
        print()
        print(
            "| retained tasks | drain tasks/s (median) | worker CPU / 1,000 | server CPU / 1,000 |"
            " tasks_task buffers / task | prune rows/s | dead tuples left | VACUUM after | mover rows/s |"
            " DROP of a day |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for size, drains, pruned, moved in rows:
            med = {key: statistics.median(d[key] for d in drains) for key in drains[0]}
            prune_cells = f"{pruned['rate']:,.0f} | {pruned['dead']:,} | {pruned['vacuum']:.1f} s" if pruned else " | |"
            print(
                f"| {size:,} | {med['rate']:,.0f} | {med['worker_ms']:.0f} ms | {med['server_ms']:.0f} ms |"
                f" {med['buffers']:.1f} | {prune_cells} | {moved['rate']:,.0f} |"
                f" {moved['drop']:.2f} s ({moved['partition_rows']:,} rows) |"
            )
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
