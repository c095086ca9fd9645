#!/usr/bin/env python
"""Two PostgreSQL servers, one queue routed to each: does each drain correctly, and how fast?

    python bench/two_servers.py [--tasks 20000] [--processes 1] [--concurrency 8] [--batch-size 64]

Starts two embedded PostgreSQL servers (fsync on, as a deployment runs), configures two database
aliases ("default" on the first, "second" on the second) with ``LEASING_TASKS["QUEUE_DATABASES"] =
{"bench-b": "second"}``, starts ``--processes`` worker processes per alias (``run_worker --database
ALIAS``), then bulk-enqueues N no-op tasks per server (queue ``bench-a`` lands in the default
database, ``bench-b`` in the second, by the route) and times each server's drain from the enqueue of
its batch to its last completion, as bench/tasks.py does for one server. It checks that every task
of each server ended SUCCESSFUL after exactly one attempt by a worker of that server, and that no
task is in the wrong database, then prints one figure per line: tasks/s per server and combined (2N
over the time from the first enqueue until both were drained).

Both servers and every worker share this machine's cores: on a 2-core machine the combined rate
measures contention, not the capacity of two servers (see docs/explanation/capacity.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not bench/ (see bench/tasks.py)

from bench.common import ROOT, figure, stop_processes  # noqa: E402

NOOP = "bench.handlers.noop"
QUEUES = {"default": "bench-a", "second": "bench-b"}
ROUTES = {"bench-b": "second"}


def configure(first_url: str, second_url: str) -> dict[str, str]:
    """Environment of this process and the workers: two aliases, one route."""
    env = {
        "DATABASE_URL": first_url,
        "LEASING_BENCH_SECOND_URL": second_url,
        "LEASING_BENCH_QUEUE_DATABASES": json.dumps(ROUTES),
        "DJANGO_SETTINGS_MODULE": "bench.two_server_settings",
    }
    os.environ.update(env)
    return env


def start_workers(alias: str, count: int, args: list[str], log_dir: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    for index in range(count):
        log = open(log_dir / f"{alias}-{index}.log", "ab")  # noqa: SIM115 (the child has its own copy)
        procs.append(
            subprocess.Popen(
                [sys.executable, "manage.py", "run_worker", "--database", alias, "--queues", QUEUES[alias], *args],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ.copy(),
            )
        )
        log.close()
    return procs


def drain(n: int, processes: int, worker_args: list[str], log_dir: Path) -> dict[str, float]:
    from django.db import connections

    from tasks.models import Task
    from tasks.models import Worker as WorkerRow

    for alias in QUEUES:
        with connections[alias].cursor() as cursor:
            cursor.execute("TRUNCATE tasks_task, tasks_worker")
    procs = {alias: start_workers(alias, processes, worker_args, log_dir) for alias in QUEUES}
    elapsed: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 60
        while any(
            WorkerRow.objects.using(alias).filter(stopped_at__isnull=True).count() < processes for alias in QUEUES
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not start; see {log_dir}")
            time.sleep(0.05)
        # As bench/tasks.py: from the enqueue of a server's batch to its last completion. The two
        # batches go in one after the other (a bulk insert of 20,000 takes about 0.4 s).
        started: dict[str, float] = {}
        for alias, queue in QUEUES.items():
            started[alias] = time.perf_counter()
            ids = Task.objects.bulk_enqueue(NOOP, ({"i": i} for i in range(n)), queue=queue)  # routed by queue
            assert len(ids) == n
        deadline = time.monotonic() + 600
        while len(elapsed) < len(QUEUES):
            for alias, queue in QUEUES.items():
                if alias in elapsed:
                    continue
                if not Task.objects.using(alias).filter(queue=queue, status__in=["READY", "RUNNING"]).exists():
                    elapsed[alias] = time.perf_counter() - started[alias]
            if time.monotonic() > deadline:
                raise RuntimeError(f"not drained within 600 s; see {log_dir}")
            time.sleep(0.02)
        combined = max(started[a] + elapsed[a] for a in QUEUES) - min(started.values())
    finally:
        for group in procs.values():
            stop_processes(group)
    for alias, queue in QUEUES.items():
        tasks = Task.objects.using(alias)
        done = tasks.filter(queue=queue, status="SUCCESSFUL", attempts=1).count()
        if done != n:
            raise RuntimeError(f"{alias}: only {done} of {n} tasks succeeded exactly once")
        if tasks.exclude(queue=queue).exists():
            raise RuntimeError(f"{alias}: tasks of another database's queue landed here")
        workers = set(WorkerRow.objects.using(alias).values_list("id", flat=True))
        ran_by = {w for row in tasks.values_list("worker_ids", flat=True) for w in row}
        if not ran_by <= workers:
            raise RuntimeError(f"{alias}: tasks run by workers of the other server: {sorted(ran_by - workers)}")
    # Combined: both batches over the time from the first enqueue to the later server's last completion.
    return {**elapsed, "combined": combined}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=20_000, help="no-op tasks per server")
    parser.add_argument("--processes", type=int, default=1, help="worker processes per server")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import tempfile

    from leasing.embedded import discard, ensure_server

    base = Path(tempfile.mkdtemp(prefix="leasing-two-servers-"))
    servers: list[Any] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))
    try:
        # Default durability (fsync on), as bench/common.py's server: the figures are a deployment's.
        servers = [ensure_server(base / name / "pgdata") for name in ("first", "second")]
        configure(servers[0].url(), servers[1].url())
        import django

        django.setup()
        from django.core.management import call_command

        for alias in QUEUES:
            call_command("migrate", database=alias, verbosity=0)
        worker_args = ["--concurrency", str(args.concurrency), "--batch-size", str(args.batch_size), "-v", "0"]
        worker_args += ["--no-scheduler", "--no-recovery"]
        for round_ in range(1, args.rounds + 1):
            result = drain(args.tasks, args.processes, worker_args, base)
            label = f"{args.processes} proc/server"
            for alias in QUEUES:
                figure(
                    f"round {round_}: drain {alias} server ({label}), tasks/s", args.tasks / result[alias], "tasks/s"
                )
            figure(
                f"round {round_}: drain both servers, combined, tasks/s", 2 * args.tasks / result["combined"], "tasks/s"
            )
        print("every task SUCCESSFUL after one attempt, by a worker of its own server; none misplaced")
    finally:
        from django.db import connections

        connections.close_all()
        for server in servers:
            discard(server)


if __name__ == "__main__":
    main()
