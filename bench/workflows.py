#!/usr/bin/env python
"""Workflows (issue 23): what a group with a callback costs beside the same tasks enqueued plainly.

    python bench/workflows.py [--members 10000] [--rounds 3] [--processes 2]

Per round, interleaved:

- **plain**: ``--members`` no-op tasks bulk-enqueued (one statement), timed from the enqueue to the
  moment none is unfinished, drained by ``--processes`` idle worker processes;
- **group**: the same number of no-op members in one group with a no-op callback
  (``tasks.workflows.group(..., then=...)``: four statements), timed from the enqueue to the
  callback's end (its ``finished_at`` on the database clock, read once it is final);
- **chain**: a chain of 200 no-op steps, enqueue to the last step's end (each step released by the
  statement that finished the one before: the figure is the latency of one hand-over).

The ratio group / plain is the workflow's cost per member (goal: at most 1.3x). Against the
embedded PostgreSQL (or DATABASE_URL), on an emptied table each time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: this folder would shadow the apps; import from the root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import figure, prepare_database, stop_processes
from bench.tasks import NOOP, bench_drain, start_workers


def reset() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE tasks_task, tasks_worker, tasks_workflow, tasks_taskdependency")


def wait_final(workflow_id: int) -> None:
    from tasks.models import Workflow

    while Workflow.objects.filter(pk=workflow_id, status="RUNNING").exists():
        time.sleep(0.01)


def plain(n: int, processes: int, log_dir: Path) -> float:
    """Seconds from the bulk enqueue of ``n`` no-op tasks to the end of their drain."""
    reset()
    return n / bench_drain(n, processes, log_dir, [])


def grouped(n: int, processes: int, log_dir: Path) -> tuple[float, float]:
    """Seconds from the enqueue to the callback's end, and the enqueue's own seconds."""
    from django.db import connection

    from tasks.models import Task
    from tasks.workflows import group, step

    reset()
    procs = start_workers(processes, log_dir=log_dir)
    try:
        members = [step(NOOP, i=i).options(queue="bench") for i in range(n)]
        callback = step(NOOP, callback=True).options(queue="bench")
        with connection.cursor() as cursor:
            cursor.execute("SELECT clock_timestamp()")
            (t0,) = cursor.fetchone()
        started = time.perf_counter()
        done = group(members, then=callback).enqueue()
        enqueued = time.perf_counter() - started
        wait_final(done.id)
    finally:
        stop_processes(procs)
    row = Task.objects.get(pk=done.callback_id)
    assert row.status == "SUCCESSFUL" and Task.objects.filter(status="SUCCESSFUL").count() == n + 1
    assert row.finished_at is not None
    return (row.finished_at - t0).total_seconds(), enqueued


def chained(steps: int, processes: int, log_dir: Path) -> float:
    from django.db import connection

    from tasks.models import Task
    from tasks.workflows import chain, step

    reset()
    procs = start_workers(processes, log_dir=log_dir)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT clock_timestamp()")
            (t0,) = cursor.fetchone()
        done = chain(*[step(NOOP, i=i).options(queue="bench") for i in range(steps)], pipe=False).enqueue()
        wait_final(done.id)
    finally:
        stop_processes(procs)
    last = Task.objects.get(pk=done.task_ids[-1])
    assert last.status == "SUCCESSFUL" and last.finished_at is not None
    return (last.finished_at - t0).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--chain", type=int, default=200)
    args = parser.parse_args()
    server = prepare_database()
    log_dir = Path(tempfile.mkdtemp(prefix="leasing-bench-workflows-"))
    ratios = []
    try:
        for round_ in range(1, args.rounds + 1):
            base = plain(args.members, args.processes, log_dir)
            figure(f"workflows.plain.round={round_}", args.members / base, "tasks/s")
            total, enqueue = grouped(args.members, args.processes, log_dir)
            figure(f"workflows.group.round={round_}", args.members / total, "members/s")
            figure(f"workflows.group.enqueue.round={round_}", args.members / enqueue, "members/s")
            ratios.append(total / base)
            print(f"    group / plain, enqueue to the end: {total / base:.2f}x", flush=True)
            seconds = chained(args.chain, args.processes, log_dir)
            figure(f"workflows.chain.handover.round={round_}", seconds / args.chain * 1000, "ms/step")
        print(f"group / plain: median {statistics.median(ratios):.2f}x, worst {max(ratios):.2f}x", flush=True)
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
