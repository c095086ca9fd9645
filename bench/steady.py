#!/usr/bin/env python
"""A steady run with retention and the mover running, and without (issue 43): what they cost the
drain, and whether the dead tuples in the hot table stay bounded.

    python bench/steady.py [--rate 4000] [--minutes 60] [--baseline-minutes 10] [--processes 2]

Worker processes (bench/compare.py's: 8 threads, claim batch 64, no recovery of their own) drain a
queue of no-op tasks a producer enqueues at a fixed ``--rate`` (a bulk enqueue each tenth of a
second). A fixed rate, not flat out: the hot table keeps every task until its hour's count stands
(10 to 70 minutes), so flat out (~10,000 tasks/s on this 2-core machine) it would hold 40 M rows, more
than its disk; 4,000/s is 3.5x the issue's 100 M tasks a day. A recovery leader runs as in production,
in a process of its own (``manage.py recover_tasks``: recovery, the history rollup, retention, the
partitions' upkeep, and the mover when ARCHIVE_AFTER is set). Before the phases, the last hour and the
hour so far are filled with finished tasks at the rate (as if the run had been going for that long):
the last hour's count stands minutes into the run, so the phase with the mover meets a whole hour's
move from its start, whatever the clock. Three phases, one database:

1. ``without``: ``--baseline-minutes``, ARCHIVE_AFTER unset: every finished task stays in
   ``tasks_task``.
2. ``with``: ``--minutes``, the leader restarted with ARCHIVE_AFTER "0s": finished tasks move to
   ``tasks_finished`` once their hour's count stands (ten minutes after the hour ends: an hour of
   run meets one hour's move whole). Before it, a day of 1,000,000 successes eight days old is put
   in ``tasks_finished``: retention (7 days) retires it during the phase.
3. ``without`` again, ``--baseline-minutes`` (the mover off again).

Every 30 s it samples (cheap statements, whatever the backlog): tasks completed (the workers'
counters), those waiting (up to 200,000), the
dead and live tuples of ``tasks_task`` (``pg_stat_user_tables``), its size with its indexes,
autovacuums of it so far, rows moved (``tasks_archiveprogress``) and ``tasks_archive_behind_seconds``.
Every ``--probe-every`` seconds (the first at half that) a capacity probe: ``--probe`` tasks enqueued
at once on top of the rate, timed until the queue is back below 2,000 waiting; the drain's capacity
is the rate plus the probe over that time (with the rows the mover moved meanwhile). It prints each
5-minute window, each probe, and per phase: the windows' drain rates, the most tasks waiting, the
probes' capacities, the CPU per 1,000 tasks (workers, leader, server), the most dead tuples seen and
the table at the end.

Default durability (fsync on), the embedded PostgreSQL unless DATABASE_URL names another.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: this folder would shadow the apps; import from the root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.steady_settings"

from bench.common import ROOT, prepare_database, stop_processes

QUEUE = "bench"  # bench/peers.py's worker serves this queue
SAMPLE_EVERY = 30.0
WINDOW = 300.0
OLD_DAY_ROWS = 1_000_000
PROBE_DONE_BELOW = 2_000

# The hour so far, as the run would have left it: ``rows`` finished no-op tasks of the queue, their finish
# times spread evenly from the hour's start to now (a million a statement).
HOUR_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at,
    last_attempted_at, finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions, failures,
    crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, errors_dropped, return_value,
    holder)
SELECT %(q)s, 0, 'bench.handlers.noop', '[]', jsonb_build_object('i', g), 'SUCCESSFUL', f.at, f.at, f.at, f.at,
       f.at, 1, 3, '[]', '["seed"]', 0, 2, 0, 0, 0, 0, true, false, 0, 'null', 'seed'
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g
CROSS JOIN LATERAL (
    SELECT %(start)s::timestamptz + (%(now)s::timestamptz - %(start)s::timestamptz) * g / %(rows)s AS at
) AS f
"""

# Cheap whatever the backlog: a first run counted the waiting tasks whole, every 0.2 s during a probe; once
# a backlog of a million formed, the counts (in parallel workers) took the cores the drain needed, the
# backlog grew, and the drain collapsed to 1,664 tasks/s. Completed: the workers' own counters (their
# heartbeat writes them); waiting: counted up to WAITING_CAP.
WAITING_CAP = 200_000
SAMPLE_SQL = """
SELECT (SELECT COALESCE(sum((stats->>'succeeded')::bigint), 0) FROM tasks_worker),
       (SELECT count(*) FROM (SELECT 1 FROM tasks_task WHERE queue = %(q)s AND status = 'READY' LIMIT %(cap)s) AS w),
       s.n_dead_tup, s.n_live_tup, s.autovacuum_count,
       pg_total_relation_size('tasks_task'),
       (SELECT COALESCE(sum(moved), 0) FROM tasks_archiveprogress)
FROM pg_stat_user_tables AS s WHERE s.relid = 'tasks_task'::regclass
"""

# A day of successes eight days old, in its partition of tasks_finished (as the mover would have left it).
OLD_DAY_SQL = """
INSERT INTO tasks_finished (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at,
    last_attempted_at, finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions, failures,
    crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, errors_dropped, return_value, id)
SELECT 'old', 0, 'app.jobs.old', '[]', '{}', 'SUCCESSFUL', f.at, f.at, f.at, f.at, f.at, 1, 3, '[]', '["w"]',
       0, 1, 0, 0, 0, 0, true, false, 0, 'null', nextval(pg_get_serial_sequence('tasks_task', 'id'))
FROM generate_series(1, %(rows)s) AS g
CROSS JOIN LATERAL (SELECT %(day)s::timestamptz + make_interval(secs => g * 86000.0 / %(rows)s) AS at) AS f
"""


@dataclass
class Sample:
    at: float
    completed: int
    waiting: int
    dead: int
    live: int
    autovacuums: int
    size: int
    moved: int
    behind: float | None


@dataclass
class Producer:
    """Enqueues ``rate`` tasks a second (what is due each tenth of a second, in bulk); ``burst``
    adds that many at once (a capacity probe)."""

    rate: float
    enqueued: int = 0
    burst: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        from django.db import connection

        from tasks.models import Task

        started = time.monotonic()
        due_done = 0
        try:
            while not self.stop.is_set():
                due = int((time.monotonic() - started) * self.rate) - due_done
                with self.lock:
                    burst, self.burst = self.burst, 0
                if due + burst > 0:
                    Task.objects.bulk_enqueue(
                        "bench.handlers.noop", ({"i": i} for i in range(due + burst)), queue=QUEUE
                    )
                    due_done += due
                    with self.lock:
                        self.enqueued += due + burst
                self.stop.wait(0.1)
        finally:
            connection.close()


def start_leader(archive_after: str | None, log_dir: Path) -> subprocess.Popen[str]:
    # bench/compare.py (imported for its workers) names its own settings module in the environment
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.steady_settings"}
    env.pop("BENCH_ARCHIVE_AFTER", None)
    if archive_after is not None:
        env["BENCH_ARCHIVE_AFTER"] = archive_after
    log = open(log_dir / "leader.log", "a")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "recover_tasks"], cwd=ROOT, env=env, stdout=log, stderr=log, text=True
    )
    log.close()
    return proc


def sample(producer: Producer) -> Sample:
    from django.db import connection

    from tasks.web.metrics import archive_metrics

    with connection.cursor() as cursor:
        cursor.execute("SET max_parallel_workers_per_gather = 0")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(SAMPLE_SQL, {"q": QUEUE, "cap": WAITING_CAP})
        completed, waiting, dead, live, autovacuums, size, moved = cursor.fetchone()
    behind = [s.value for family in archive_metrics() for s in family.samples]
    return Sample(
        time.monotonic(), int(completed), int(waiting), int(dead), int(live), int(autovacuums), int(size),
        int(moved), max(behind) if behind else None,
    )  # fmt: skip


def fill_the_hour(rate: float) -> int:
    """The last hour and the hour so far at ``rate``, finished (HOUR_SQL); the rows put. The last
    hour's count stands minutes after the leader starts: its move falls within the run."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT date_trunc('hour', statement_timestamp()) - interval '1 hour', statement_timestamp()")
        start, now = cursor.fetchone()
    rows = int((now - start).total_seconds() * rate)
    with connection.cursor() as cursor:
        for first in range(1, rows + 1, 1_000_000):
            last = min(first + 999_999, rows)
            cursor.execute(
                HOUR_SQL, {"q": QUEUE, "first": first, "last": last, "rows": rows, "start": start, "now": now}
            )
    return rows


def put_old_day() -> str:
    """A day of successes eight days old in tasks_finished: retention's to retire."""
    import datetime as dt

    from django.db import connection

    from tasks.maintenance.partitions import create_day, day_start

    with connection.cursor() as cursor:
        cursor.execute("SELECT (statement_timestamp() AT TIME ZONE 'UTC')::date - 8")
        day = cursor.fetchone()[0]
    assert isinstance(day, dt.date)
    create_day("SUCCESSFUL", day)
    with connection.cursor() as cursor:
        cursor.execute(OLD_DAY_SQL, {"rows": OLD_DAY_ROWS, "day": day_start(day)})
    return f"tasks_finished_successful_{day:%Y%m%d}"


def old_day_kept(name: str) -> bool:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
        return bool(cursor.fetchone()[0])


def probe(producer: Producer, size: int) -> dict[str, float]:
    """``size`` tasks at once on top of the rate: the seconds until fewer than PROBE_DONE_BELOW wait
    again, the capacity that makes, the rows the mover moved meanwhile."""
    before = sample(producer)
    with producer.lock:
        producer.burst += size
    started = time.monotonic()
    time.sleep(1.0)
    while True:
        now = sample(producer)
        if now.waiting < PROBE_DONE_BELOW or now.at - started > 600:
            break
        time.sleep(1.0)
    seconds = now.at - started
    return {"seconds": seconds, "capacity": producer.rate + size / seconds, "moved": now.moved - before.moved}


def cpu(pids: dict[str, list[int]]) -> dict[str, float]:
    from bench.compare import cpu_times, server_pids

    return {
        "server": sum(cpu_times(server_pids()).values()),
        **{name: sum(cpu_times(group).values()) for name, group in pids.items()},
    }


def phase(
    name: str, args: argparse.Namespace, minutes: float, archive_after: str | None, producer: Producer,
    workers: list[Any], log_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    leader = start_leader(archive_after, log_dir)
    try:
        first = sample(producer)
        cpu_before = cpu({"workers": [w.pid for w in workers], "leader": [leader.pid]})
        samples = [first]
        end = first.at + minutes * 60
        window_start = first
        next_probe = first.at + args.probe_every / 2
        windows: list[float] = []
        probes: list[dict[str, float]] = []
        while time.monotonic() < end:
            time.sleep(min(SAMPLE_EVERY, args.window, max(end - time.monotonic(), 0.0)))
            if time.monotonic() >= next_probe and time.monotonic() < end - 60:
                probes.append(probe(producer, args.probe))
                print(
                    f"steady.{name}  probe {len(probes)}: {args.probe:,} more in {probes[-1]['seconds']:.1f} s,"
                    f" capacity {probes[-1]['capacity']:,.0f} tasks/s; moved meanwhile {probes[-1]['moved']:,}",
                    flush=True,
                )
                next_probe += args.probe_every
            now = sample(producer)
            samples.append(now)
            if now.at - window_start.at >= args.window - 1 or now.at >= end - 1:
                rate = (now.completed - window_start.completed) / (now.at - window_start.at)
                windows.append(rate)
                seen = [s for s in samples if s.at > window_start.at]
                behind = "" if now.behind is None else f", mover behind {now.behind:,.0f} s"
                print(
                    f"steady.{name}  window {len(windows)}: {rate:,.0f} tasks/s, up to {max(s.waiting for s in seen):,}"
                    f" waiting; tasks_task dead tuples up to {max(s.dead for s in seen):,}, live {now.live:,},"
                    f" {now.size / 1e9:.2f} GB, autovacuums {now.autovacuums}; moved {now.moved:,}{behind}",
                    flush=True,
                )
                window_start = now
        cpu_after = cpu({"workers": [w.pid for w in workers], "leader": [leader.pid]})
    finally:
        stop_processes([leader])
    last = samples[-1]
    completed = last.completed - first.completed
    return {
        "rates": windows,
        "waiting": max(s.waiting for s in samples),
        "probes": [p["capacity"] for p in probes],
        "cpu": {k: (cpu_after[k] - cpu_before[k]) * 1e6 / max(completed, 1) for k in cpu_after},
        "dead": max(s.dead for s in samples),
        "size": last.size,
        "live": last.live,
        "moved": last.moved - first.moved,
        "completed": completed,
    }


#: Bytes a finished task takes on disk, in tasks_task or in tasks_finished, with its indexes (16.1 GB
#: for 18.7 M rows in tasks_task; 7.7 GB for 10 M in tasks_finished), and room for the WAL.
ROW_BYTES = 900


def refuse_without_disk(args: argparse.Namespace) -> None:
    """Exit before the fill when the run would fill the embedded server's disk: every task of the
    fill and of the run is on disk at the end, in tasks_task or in tasks_finished (the hot table's
    space freed by the mover is reused by later tasks, not at once: a third more). Started late in
    an hour, the fill is nearly two hours of tasks: a run at 4,000/s started at :59 needs 56 GB (refused
    with 58 GB free), at :09 42 GB."""
    import shutil

    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM statement_timestamp() - date_trunc('hour', statement_timestamp()))")
        into_hour = float(cursor.fetchone()[0])
    seconds = 3600 + into_hour + 60 * (args.minutes + 2 * args.baseline_minutes)
    needed = 1.3 * seconds * args.rate * ROW_BYTES
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if needed > 0.9 * free:  # a tenth kept free: the server stops when its disk is full
        sys.exit(
            f"steady: this run needs about {needed / 1e9:.0f} GB ({seconds * args.rate / 1e6:.0f} M tasks),"
            f" {free / 1e9:.0f} GB are free: lower --rate or --minutes, or start early in an hour"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=4000.0, help="tasks enqueued a second")
    parser.add_argument("--minutes", type=float, default=60.0, help="the phase with the mover and retention")
    parser.add_argument("--baseline-minutes", type=float, default=10.0, help="each phase without")
    parser.add_argument("--processes", type=int, default=2, help="worker processes")
    parser.add_argument("--probe", type=int, default=100_000, help="tasks a capacity probe adds at once")
    parser.add_argument(
        "--probe-every", type=float, default=300.0, help="seconds between capacity probes (the first at half that)"
    )
    parser.add_argument("--window", type=float, default=WINDOW, help="seconds a printed window spans")
    parser.add_argument("--no-fill", action="store_true", help="do not fill the last hour and this one first")
    args = parser.parse_args()
    server = prepare_database()
    log_dir = Path(tempfile.mkdtemp(prefix="leasing-steady-"))
    workers: list[Any] = []
    producer = Producer(args.rate)
    thread = threading.Thread(target=producer.run, daemon=True)
    try:
        from django.db import connection

        from bench.compare import start_workers

        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            version = cursor.fetchone()[0]
        print(
            f"# PostgreSQL {version}; {args.processes} worker processes, {args.rate:,.0f} tasks/s enqueued;"
            f" logs in {log_dir}",
            flush=True,
        )
        if server is not None:
            refuse_without_disk(args)
        if not args.no_fill:
            started = time.perf_counter()
            rows = fill_the_hour(args.rate)
            with connection.cursor() as cursor:
                cursor.execute("VACUUM ANALYZE tasks_task")
            print(
                f"steady.fill  the last hour and this one: {rows:,} finished tasks"
                f" in {time.perf_counter() - started:.0f} s"
            )
        workers = start_workers("django-leasing", args.processes, log_dir)
        thread.start()
        results = {"without": phase("without", args, args.baseline_minutes, None, producer, workers, log_dir)}
        old_day = put_old_day()
        results["with"] = phase("with", args, args.minutes, "0s", producer, workers, log_dir)
        print(f"steady.with  the old day {old_day}: {'still kept' if old_day_kept(old_day) else 'retired'}")
        results["without again"] = phase("without-again", args, args.baseline_minutes, None, producer, workers, log_dir)
        for name, result in results.items():
            rates = result["rates"]
            probes = ", ".join(f"{c:,.0f}" for c in result["probes"]) or "none"
            use = ", ".join(f"{k} {v:.0f} ms" for k, v in result["cpu"].items())
            print(
                f"steady.summary {name}: windows {min(rates):,.0f}-{max(rates):,.0f} tasks/s (median"
                f" {statistics.median(rates):,.0f}), up to {result['waiting']:,} waiting; capacity probes {probes}"
                f" tasks/s; CPU per 1,000 tasks: {use}; {result['completed']:,} completed, {result['moved']:,}"
                f" moved; tasks_task dead tuples at most {result['dead']:,}, at the end {result['live']:,} live,"
                f" {result['size'] / 1e9:.2f} GB",
                flush=True,
            )
    finally:
        producer.stop.set()
        if thread.is_alive():
            thread.join(30)
        stop_processes(workers)
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
