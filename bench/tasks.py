#!/usr/bin/env python
"""Task queue benchmark: enqueue, drain, wake-up latency, crash recovery.

    python bench/tasks.py [--tasks 20000] [--rounds 2]

Prints one figure per line:
- enqueue one by one (``Task.objects.enqueue``) and in bulk (``bulk_enqueue``), tasks/s;
- drain of N no-op tasks by 1 and by 4 worker processes (``manage.py run_worker``), tasks/s,
  timed from the enqueue of the batch to the last completion;
- enqueue-to-start latency of single tasks sent to an idle worker, p50 and p99 (ms);
- SIGKILL-to-rerun: a worker is killed mid-task; seconds until another worker starts it again,
  beside the bound TTL + recovery interval + 1 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this folder would come first on sys.path and this file would shadow the
# ``tasks`` app: import from the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import ROOT, figure, prepare_database, stop_processes  # noqa: E402

NOOP = "bench.handlers.noop"


def reset() -> None:
    """Empty the queue between cases; TRUNCATE leaves no dead rows to slow the next case down."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE tasks_task, tasks_worker")


def start_workers(count: int, *args: str, log_dir: Path) -> list[subprocess.Popen[bytes]]:
    from tasks.models import Worker

    procs = []
    for index in range(count):
        log = open(log_dir / f"worker-{index}-{time.monotonic_ns()}.log", "ab")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [sys.executable, "manage.py", "run_worker", "--queues", "bench", "-v", "0", *args],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ.copy(),
            )
        )
        log.close()
    deadline = time.monotonic() + 60
    while Worker.objects.filter(stopped_at__isnull=True, queues__contains=["bench"]).count() < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers did not start; see {log_dir}")
        time.sleep(0.05)
    return procs


def bench_enqueue_single(n: int) -> float:
    from tasks.models import Task

    reset()
    started = time.perf_counter()
    for i in range(n):
        Task.objects.enqueue(NOOP, kwargs={"i": i}, queue="bench")
    return n / (time.perf_counter() - started)


def bench_enqueue_bulk(n: int) -> float:
    from tasks.models import Task

    reset()
    started = time.perf_counter()
    Task.objects.bulk_enqueue(NOOP, ({"i": i} for i in range(n)), queue="bench")
    return n / (time.perf_counter() - started)


def bench_drain(n: int, processes: int, log_dir: Path, worker_args: list[str]) -> float:
    from tasks.models import Task

    reset()
    procs = start_workers(processes, *worker_args, log_dir=log_dir)
    try:
        started = time.perf_counter()
        Task.objects.bulk_enqueue(NOOP, ({"i": i} for i in range(n)), queue="bench")
        while Task.objects.filter(queue="bench", status__in=["READY", "RUNNING"]).exists():
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
    finally:
        stop_processes(procs)
    done = Task.objects.filter(queue="bench", status="SUCCESSFUL", attempts=1).count()
    if done != n:
        raise RuntimeError(f"only {done} of {n} tasks succeeded exactly once")
    return n / elapsed


def bench_latency(samples: int, log_dir: Path) -> tuple[float, float]:
    from tasks.models import Task

    reset()
    procs = start_workers(1, "--poll-interval", "30", log_dir=log_dir)
    latencies = []
    try:
        for _ in range(samples):
            task_id = Task.objects.enqueue(NOOP, queue="bench").id
            while True:
                row = Task.objects.filter(pk=task_id, status="SUCCESSFUL").values("enqueued_at", "started_at").first()
                if row and row["started_at"] is not None:
                    latencies.append((row["started_at"] - row["enqueued_at"]).total_seconds() * 1000)
                    break
                time.sleep(0.001)
            time.sleep(0.01)  # pacing: one task at a time into an idle worker
    finally:
        stop_processes(procs)
    quantiles = statistics.quantiles(latencies, n=100)
    return statistics.median(latencies), quantiles[98]


def bench_kill_to_rerun(ttl: float, interval: float, log_dir: Path) -> float:
    from django.db import connection

    from tasks.models import Task

    reset()
    args = ["--ttl", str(ttl), "--recovery-interval", str(interval), "--poll-interval", "0.5"]
    victim = start_workers(1, *args, log_dir=log_dir)
    rescuer: list[subprocess.Popen[bytes]] = []
    try:
        task_id = Task.objects.enqueue("bench.handlers.hang_first_attempt", queue="bench").id
        while not Task.objects.filter(pk=task_id, status="RUNNING").exists():
            time.sleep(0.01)
        rescuer = start_workers(2, *args, log_dir=log_dir)  # the victim plus this one are registered
        victim[0].send_signal(signal.SIGKILL)
        victim[0].wait()
        with connection.cursor() as cursor:
            cursor.execute("SELECT clock_timestamp()")
            killed_at = cursor.fetchone()[0]
        while not Task.objects.filter(pk=task_id, status="SUCCESSFUL").exists():
            time.sleep(0.01)
        rerun_at = Task.objects.get(pk=task_id).last_attempted_at
    finally:
        stop_processes(victim + rescuer)
    return (rerun_at - killed_at).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    server = prepare_database()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-tasks-"))
    worker_args = ["--concurrency", str(args.concurrency), "--batch-size", str(args.batch_size), "--no-recovery"]
    try:
        for round_no in range(1, args.rounds + 1):
            figure(f"tasks.enqueue.single.round={round_no}", bench_enqueue_single(args.tasks), "tasks/s")
            figure(f"tasks.enqueue.bulk.round={round_no}", bench_enqueue_bulk(args.tasks), "tasks/s")
            for processes in (1, 4):
                rate = bench_drain(args.tasks, processes, log_dir, worker_args)
                figure(f"tasks.drain.procs={processes}.round={round_no}", rate, "tasks/s")
        p50, p99 = bench_latency(200, log_dir)
        figure("tasks.enqueue_to_start.p50", p50, "ms")
        figure("tasks.enqueue_to_start.p99", p99, "ms")
        ttl, interval = 5.0, 1.0
        figure("tasks.sigkill_to_rerun", bench_kill_to_rerun(ttl, interval, log_dir), "s")
        figure("tasks.sigkill_to_rerun.bound", ttl + interval + 1, "s (TTL + recovery interval + 1)")
    finally:
        reset()
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
