#!/usr/bin/env python
"""Concurrency keys at scale (issue 20): what admission costs as the number of keys grows.

    python bench/concurrency_keys.py [--sizes 100,10000,100000] [--samples 5]

- **Admission delay of a due key** beside N keys with waiting tasks (half of them full, half with a
  task deferred for an hour): a recovery process (``recover_tasks --interval 1``) runs beside it; a
  key's task is enqueued due 1 s later and the case times from its ``run_after`` to its admission
  (READY), read by polling every 10 ms. Goal: at most one recovery interval at every size. The
  sweep's own duration at that size is printed too.
- **Bulk statements over many keys**: ``Task.objects.cancel()`` of 3 tasks per key (one admitted,
  two waiting) over 500 and over 8,000 keys, in rows/s (goal: within 2x), and one INSERT of one task
  per key for 2,000 keys.
- **The unkeyed drain beside 16 keys held by open transactions** (an application that enqueued a
  task of each key and has not committed): 4 workers drain 20,000 unkeyed no-op tasks and 1,600
  keyed ones of those keys, against the same drain with no transaction open (goal: within 20 %), and
  with 16 open transactions that hold no key (what old snapshots alone cost: dead rows cannot be
  pruned while they are open).

Against the embedded PostgreSQL (or DATABASE_URL), each case on an emptied table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: this folder would shadow the apps; import from the root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import ROOT, figure, prepare_database, stop_processes
from bench.tasks import NOOP, reset, start_workers

# One statement: ``per_key`` tasks for each of ``keys`` keys, limit ``limit``, due after ``delay``.
KEYED_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts,
    max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes, unstarted_returns,
    attempt_started, attempt_isolated, concurrency_key, concurrency_limit)
SELECT %(queue)s, 0, %(path)s, '[]', '{}', 'READY', clock_timestamp() + make_interval(secs => %(delay)s),
       clock_timestamp(), 0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false,
       %(prefix)s || lpad(k::text, 6, '0'), %(limit)s
FROM generate_series(1, %(keys)s) AS k, generate_series(1, %(per_key)s) AS r
"""


def insert_keyed(
    prefix: str, keys: int, *, per_key: int = 1, limit: int = 1, delay: float = 0, queue: str = "parked"
) -> float:
    from django.db import connection

    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            KEYED_SQL,
            {
                "prefix": prefix,
                "keys": keys,
                "per_key": per_key,
                "limit": limit,
                "delay": delay,
                "queue": queue,
                "path": NOOP,
            },
        )
    return time.perf_counter() - started


def reset_keys() -> None:
    from django.db import connection

    reset()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE tasks_concurrencykey")
        cursor.execute("SELECT to_regclass('tasks_concurrencywake')")
        if cursor.fetchone()[0]:
            cursor.execute("TRUNCATE tasks_concurrencywake")
        cursor.execute("VACUUM ANALYZE tasks_task")


def admission_delay(size: int, samples: int, log_dir: Path) -> None:
    from django.db import connection

    from tasks.lifecycle import concurrency
    from tasks.models import Task

    reset_keys()
    insert_keyed("full-", size // 2, per_key=2)
    insert_keyed("later-", size - size // 2, delay=3600)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task; ANALYZE tasks_concurrencykey")
    sweeps = []
    for _ in range(5):
        started = time.perf_counter()
        concurrency.admit_waiting()
        sweeps.append((time.perf_counter() - started) * 1000)
    figure(f"keys.sweep.waiting_keys={size}", statistics.median(sweeps), "ms (one sweep, nothing due)")
    log = open(log_dir / f"recovery-{size}.log", "ab")  # noqa: SIM115
    recovery = subprocess.Popen(
        [sys.executable, "manage.py", "recover_tasks", "--interval", "1", "-v", "0"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    delays = []
    try:
        for sample in range(samples):
            task = Task.objects.enqueue(
                NOOP, queue="parked", concurrency_key=f"probe-{sample}", concurrency_limit=1, run_after=_in(1.0)
            )
            while Task.objects.filter(pk=task.id, status="BLOCKED").exists():
                time.sleep(0.01)
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT EXTRACT(EPOCH FROM clock_timestamp() - run_after) FROM tasks_task WHERE id = %s",
                    [task.id],
                )
                delays.append(float(cursor.fetchone()[0]))
    finally:
        stop_processes([recovery])
    figure(f"keys.admission_delay.waiting_keys={size}.median", statistics.median(delays), "s (goal <= 1 s interval)")
    figure(f"keys.admission_delay.waiting_keys={size}.max", max(delays), "s")


def _in(seconds: float) -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)


def bulk_statements() -> None:
    from tasks.models import Task

    for keys in (500, 8000):
        reset_keys()
        insert_keyed("c-", keys, per_key=3)
        started = time.perf_counter()
        cancelled = Task.objects.filter(concurrency_key__startswith="c-").cancel()
        elapsed = time.perf_counter() - started
        figure(f"keys.bulk_cancel.keys={keys}", cancelled / elapsed, f"rows/s ({cancelled} rows in {elapsed:.2f} s)")
    reset_keys()
    elapsed = insert_keyed("i-", 2000)
    figure("keys.insert_one_per_key.keys=2000", elapsed * 1000, "ms (one statement)")


def drain_beside_held_keys(log_dir: Path, worker_args: list[str], held: bool, keyed: bool = True) -> float:
    """``held``: 16 application transactions stay open during the drain, each having enqueued a task
    (of one of the 16 keys when ``keyed``, else an unkeyed one: the cost of old snapshots alone)."""
    from django.db import connections, transaction

    from tasks.models import Task

    reset_keys()
    keys = [f"held-{n:02d}" for n in range(16)]
    for key in keys:
        insert_keyed(key, 1, per_key=100, limit=1000, queue="bench")
    release = threading.Event()
    holding = [threading.Event() for _ in keys]

    def application(key: str, ready: threading.Event) -> None:
        try:
            with transaction.atomic():
                if keyed:
                    Task.objects.enqueue(NOOP, queue="parked", concurrency_key=key, concurrency_limit=1000)
                else:
                    Task.objects.enqueue(NOOP, queue="parked")
                ready.set()
                release.wait(600)
        finally:
            connections["default"].close()

    threads = []
    if held:
        threads = [threading.Thread(target=application, args=(k, h)) for k, h in zip(keys, holding, strict=True)]
        for thread in threads:
            thread.start()
        for event in holding:
            event.wait(30)
    procs = start_workers(4, *worker_args, log_dir=log_dir)
    try:
        started = time.perf_counter()
        Task.objects.bulk_enqueue(NOOP, ({"i": i} for i in range(20_000)), queue="bench")
        while Task.objects.filter(queue="bench", status__in=["BLOCKED", "READY", "RUNNING"]).exists():
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
    finally:
        stop_processes(procs)
        release.set()
        for thread in threads:
            thread.join(60)
    done = Task.objects.filter(queue="bench", status="SUCCESSFUL", attempts=1).count()
    if done != 21_600:
        raise RuntimeError(f"only {done} of 21,600 tasks succeeded exactly once")
    return done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,10000,100000", help="numbers of waiting keys")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the drain pair")
    parser.add_argument("--only", choices=["delay", "bulk", "drain"], help="run one case")
    args = parser.parse_args()
    server = prepare_database()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-keys-"))
    worker_args = ["--concurrency", "8", "--batch-size", "64", "--no-recovery"]
    try:
        if args.only in (None, "delay"):
            for size in (int(s) for s in args.sizes.split(",")):
                admission_delay(size, args.samples, log_dir)
        if args.only in (None, "bulk"):
            bulk_statements()
        if args.only in (None, "drain"):
            for round_no in range(1, args.rounds + 1):
                free = drain_beside_held_keys(log_dir, worker_args, held=False)
                busy = drain_beside_held_keys(log_dir, worker_args, held=True)
                plain = drain_beside_held_keys(log_dir, worker_args, held=True, keyed=False)
                figure(f"keys.drain.no_open_transactions.round={round_no}", free, "tasks/s")
                figure(f"keys.drain.16_keys_held.round={round_no}", busy, "tasks/s")
                figure(f"keys.drain.16_open_transactions_no_key.round={round_no}", plain, "tasks/s")
                figure(f"keys.drain.held_ratio.round={round_no}", 100 * busy / free, "% (goal >= 80)")
                figure(f"keys.drain.held_vs_open_ratio.round={round_no}", 100 * busy / plain, "%")
    finally:
        reset_keys()
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
