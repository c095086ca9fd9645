#!/usr/bin/env python
"""Task queue benchmark: enqueue, drain, wake-up latency, crash recovery.

    python bench/tasks.py [--tasks 20000] [--rounds 2]

Prints one figure per line:
- enqueue one by one (``Task.objects.enqueue``) and in bulk (``bulk_enqueue``), tasks/s;
- drain of N no-op tasks by 1 and by 4 worker processes (``manage.py run_worker``), tasks/s,
  timed from the enqueue of the batch to the last completion;
- enqueue-to-start latency of single tasks sent to an idle worker, p50 and p99 (ms);
- SIGKILL-to-rerun: a worker is killed mid-task; seconds until another worker starts it again,
  beside the bound TTL + recovery interval + 1 s;
- claim cost (median of one-task claims, rolled back) on an empty table and beside 1,000,000 finished
  rows, 300,000 READY rows of another queue and 300,000 deferred higher-priority rows of the same
  queue, and the ratio (goal: at most 3); also a claim from an empty queue beside those backlogs;
- drain of 60,000 tasks by 4 workers beside 1,000,000 finished rows a week old, then while they are
  pruned: by the recovery leader's automatic pruning, by ``prune_tasks`` at its default pace
  (``--busy-fraction 0.25``) and flat out (``1``); the ratio (goal: at least 80 %), the rows pruned
  during the drain and the prune rate over the whole backlog;
- stop-to-exit: SIGTERM arrives while a worker's one task runs; milliseconds from that task's end
  to the process's exit (median of 5);
- keyed drain: 2,000 no-op tasks over 20 concurrency keys of limit 2, by 4 worker processes, tasks/s
  (every admission is a key-row lock and a count under it; see tasks/lifecycle/concurrency.py).

``--only-rate`` runs a rate-limited backlog alone: 10,000 tasks on one key of 200/s and 2,000 on one of
20/s, by 4 processes: the rate achieved, the fullest window on the database clock, the hand-backs
(refused starts) per task (tasks/lifecycle/ratelimits.py).
``--only-keys`` runs drains of ``--key-tasks`` (100,000) tasks over 20 keys and over as many keys as
tasks, for concurrency keys (limit 2), rate keys (a limit never reached) and fair keys, by 4 processes,
and the cost ratio (time over many keys / time over 20; issue 24's goal: at most 2).
``--only-claim`` runs the claim cost alone (on DATABASE_URL's server when set: each PostgreSQL major
has its own figure). ``--only-drain`` runs the two drains alone (unkeyed by 4 processes, keyed), for A/B comparisons.
``--only-enqueue-drain`` runs the enqueues (single, bulk) and the drain by 4 processes; with
``--argument-index`` the opt-in argument search indexes exist meanwhile (docs/howto/operations.md: their write cost).
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
from typing import Any

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


def start_workers(
    count: int, *args: str, log_dir: Path, env: dict[str, str] | None = None
) -> list[subprocess.Popen[bytes]]:
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
                env={**os.environ, **(env or {})},
            )
        )
        log.close()
    deadline = time.monotonic() + 60
    while Worker.objects.filter(stopped_at__isnull=True, queues__contains=["bench"]).count() < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers did not start; see {log_dir}")
        time.sleep(0.05)
    return procs


def wait_drained(interval: float = 0.02) -> None:
    """Until no task of the bench queue waits or runs (BLOCKED, READY or RUNNING)."""
    from tasks.models import Task

    while Task.objects.filter(queue="bench", status__in=["BLOCKED", "READY", "RUNNING"]).exists():
        time.sleep(interval)


def check_ran_once(expected: int) -> int:
    """How many bench tasks succeeded in one attempt; RuntimeError unless ``expected``."""
    from tasks.models import Task

    done = Task.objects.filter(queue="bench", status="SUCCESSFUL", attempts=1).count()
    if done != expected:
        raise RuntimeError(f"only {done} of {expected} tasks succeeded exactly once")
    return done


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
        wait_drained()
        elapsed = time.perf_counter() - started
    finally:
        stop_processes(procs)
    check_ran_once(n)
    return n / elapsed


def bench_drain_keyed(n: int, keys: int, limit: int, processes: int, log_dir: Path, worker_args: list[str]) -> float:
    """Drain of ``n`` no-op tasks spread over ``keys`` concurrency keys of ``limit`` each."""
    from tasks.models import Task

    reset()
    procs = start_workers(processes, *worker_args, log_dir=log_dir)
    try:
        started = time.perf_counter()
        per_key = n // keys
        for key in range(keys):
            Task.objects.bulk_enqueue(
                NOOP,
                ({"i": i} for i in range(per_key)),
                queue="bench",
                concurrency_key=f"k{key}",
                concurrency_limit=limit,
            )
        wait_drained()
        elapsed = time.perf_counter() - started
    finally:
        stop_processes(procs)
    return check_ran_once(per_key * keys) / elapsed


#: The keyed controls of issue 24 and the concurrency keys, as enqueue arguments for task ``i`` of ``keys``.
KEYED: dict[str, Any] = {
    "concurrency": lambda i, keys: {"concurrency_key": f"k{i % keys}", "concurrency_limit": 2},
    # A limit no key reaches in this drain (every start is charged to its key's window all the same).
    "rate": lambda i, keys: {"rate_key": f"k{i % keys}", "rate_limit": (10_000, 1.0)},
    "fair": lambda i, keys: {"fair_key": f"k{i % keys}"},
}


def bench_drain_over_keys(kind: str, n: int, keys: int, processes: int, log_dir: Path, worker_args: list[str]) -> float:
    """Drain of a backlog of ``n`` no-op tasks spread over ``keys`` keys of ``kind`` (KEYED), by
    ``processes`` workers: timed from the resume of the paused queue (workers idle and the backlog in
    place) to the last completion, so the figure is the claims' and finishes' cost alone. The issue's
    goal: 100,000 distinct keys at most 2x the time of 20 keys."""
    from django.db import connection, transaction

    from tasks.models import QueueControl, Task

    reset()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE tasks_ratelimit, tasks_concurrencykey")
    QueueControl.objects.pause("bench", by="bench")
    arguments = KEYED[kind]
    with transaction.atomic():
        for i in range(n):
            Task.objects.enqueue(NOOP, kwargs={"i": i}, queue="bench", **arguments(i, keys))
    env = {"TASKS_FAIR_QUEUES": "bench"} if kind == "fair" else {}
    procs = start_workers(processes, *worker_args, log_dir=log_dir, env=env)
    try:
        started = time.perf_counter()
        QueueControl.objects.resume("bench", by="bench")
        wait_drained(0.05)
        elapsed = time.perf_counter() - started
    finally:
        stop_processes(procs)
    check_ran_once(n)
    return n / elapsed


def bench_rate_limited(
    backlog: int, count: int, period: float, processes: int, log_dir: Path, worker_args: list[str]
) -> tuple[float, int, float]:
    """A backlog of ``backlog`` no-op tasks on one rate key of ``count`` per ``period`` seconds, by
    ``processes`` workers at the default poll interval: the rate achieved (starts/s, first to last),
    the fullest window of the database clock, and the refusals (hand-backs) per task."""
    import datetime as dt

    from django.db import connection

    from tasks.models import RateLimit, Task

    reset()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE tasks_ratelimit")
    Task.objects.bulk_enqueue(
        NOOP, ({"i": i} for i in range(backlog)), queue="bench", rate_key="bench", rate_limit=(count, period)
    )
    procs = start_workers(processes, *worker_args, "--poll-interval", "2", log_dir=log_dir)
    try:
        wait_drained(0.05)
    finally:
        stop_processes(procs)
    recorded = Task.objects.filter(queue="bench", status="SUCCESSFUL").values_list("last_attempted_at", flat=True)
    starts = sorted(at for at in recorded if at is not None)
    if len(starts) != backlog:
        raise RuntimeError(f"only {len(starts)} of {backlog} tasks succeeded")
    width, most, j = dt.timedelta(seconds=period), 0, 0
    for i, at in enumerate(starts):
        while j < len(starts) and starts[j] < at + width:
            j += 1
        most = max(most, j - i)
    rate = (backlog - 1) / (starts[-1] - starts[0]).total_seconds()
    return rate, most, RateLimit.objects.get(key="bench").refusals / backlog


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


def _claim_ms(queue: str, samples: int = 300) -> float:
    """Median wall time of the worker's claim statement (one task, rolled back so it stays)."""
    from django.db import transaction

    from tasks.models import Task

    times = []
    for _ in range(samples):
        with transaction.atomic():
            started = time.perf_counter()
            Task.objects.claim("bench-claimer", limit=1, queues=[queue], take_isolated=False)
            times.append(time.perf_counter() - started)
            transaction.set_rollback(True)
    return statistics.median(times) * 1000


_ROWS = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, finished_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated)
SELECT %s, %s, 'bench.handlers.noop', '[]', '{}', %s, now() + make_interval(secs => %s),
       now(), CASE WHEN %s = 'SUCCESSFUL' THEN now() END, 0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false
FROM generate_series(1, %s)
"""


def bench_claim_cost() -> tuple[float, float, float]:
    """(empty-table claim ms, claim ms beside the backlogs, empty-queue claim ms beside them)."""
    from django.db import connection

    from tasks.models import Task

    reset()
    Task.objects.enqueue(NOOP, queue="bench")
    empty = _claim_ms("bench")
    with connection.cursor() as cursor:
        for queue, priority, status, delay, count in (
            ("bench", 0, "SUCCESSFUL", 0, 1_000_000),
            ("bulk", 5, "READY", 0, 300_000),
            ("bench", 10, "READY", 86_400, 300_000),
        ):
            cursor.execute(_ROWS, [queue, priority, status, delay, status, count])
        cursor.execute("VACUUM ANALYZE tasks_task")
    return empty, _claim_ms("bench"), _claim_ms("nothing-here")


def bench_claim_figures() -> None:
    """The claim cost's figures, with the server's major (the cost differs with skip scan or none)."""
    from django.db import connection

    empty, backlog, idle = bench_claim_cost()
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version_num")
        figure("tasks.claim.server_major", int(cursor.fetchone()[0]) // 10000, "(PostgreSQL)")
    figure("tasks.claim.empty_table", empty, "ms")
    figure("tasks.claim.beside_backlogs", backlog, "ms")
    figure("tasks.claim.ratio", backlog / empty, "x (goal <= 3)")
    figure("tasks.claim.empty_queue_beside_backlogs", idle, "ms")


def bench_stop_to_exit(samples: int, log_dir: Path) -> float:
    """Milliseconds from the end of a worker's last task (SIGTERM arrived while it ran) to the
    process's exit: the median of ``samples`` workers."""
    from tasks.models import Task

    delays = []
    for _ in range(samples):
        reset()
        [proc] = start_workers(1, "--concurrency", "1", "--no-recovery", log_dir=log_dir)
        try:
            task_id = Task.objects.enqueue("bench.handlers.pause", kwargs={"seconds": 0.3}, queue="bench").id
            while not Task.objects.filter(pk=task_id, attempt_started=True).exists():
                time.sleep(0.001)
            proc.send_signal(signal.SIGTERM)
            while not Task.objects.filter(pk=task_id, status="SUCCESSFUL").exists():
                time.sleep(0.001)
            finished = time.perf_counter()
            proc.wait(60)
            delays.append((time.perf_counter() - finished) * 1000)
        finally:
            stop_processes([proc])
    return statistics.median(delays)


_FINISHED_ROWS = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, finished_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated)
SELECT 'bench', 0, 'bench.handlers.noop', '[]', '{}', 'SUCCESSFUL', now() - interval '8 days',
       now() - interval '8 days', now() - interval '8 days' + make_interval(secs => i / 100.0), 1, 3, '[]', '[]',
       0, 0, 0, 0, 0, 0, true, false
FROM generate_series(1, %s) AS i
"""


def _old_rows() -> int:
    from tasks.models import Task

    return Task.objects.filter(status="SUCCESSFUL", finished_at__lt=time_ago(7 * 86400)).count()


def time_ago(seconds: float) -> Any:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds)


def bench_drain_while_pruning(
    n: int, rows: int, log_dir: Path, worker_args: list[str], pruner: str, busy: str = "0.25"
) -> tuple[float, float, int, float]:
    """Drain ``n`` no-op tasks with 4 workers beside ``rows`` finished rows a week old, first
    without pruning, then while they are pruned (``pruner``: "command" runs ``prune_tasks`` with
    ``--busy-fraction busy``; "auto" is the recovery leader inside the workers). Returns (drain rate unpruned, drain
    rate pruning, rows pruned during the drain, prune rate over the whole backlog in rows/s)."""
    from django.db import connection

    reset()
    with connection.cursor() as cursor:
        cursor.execute(_FINISHED_ROWS, [rows])
        cursor.execute("VACUUM ANALYZE tasks_task")
    quiet = [a for a in worker_args if a != "--no-recovery"]
    unpruned = bench_drain_beside(n, 4, log_dir, [*quiet, "--no-recovery"])
    assert _old_rows() == rows
    pruning: list[subprocess.Popen[bytes]] = []
    started = time.perf_counter()
    if pruner == "command":
        log = open(log_dir / f"prune-{time.monotonic_ns()}.log", "ab")  # noqa: SIM115
        pruning.append(
            subprocess.Popen(
                [sys.executable, "manage.py", "prune_tasks", "--older-than", "7d", "--busy-fraction", busy],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ.copy(),
            )
        )
        log.close()
        pruned_rate = bench_drain_beside(n, 4, log_dir, [*quiet, "--no-recovery"])
    else:
        pruned_rate = bench_drain_beside(n, 4, log_dir, quiet, keep=True)
    during = rows - _old_rows()
    try:
        if pruner == "command":
            pruning[0].wait(1800)
        else:
            while _old_rows():
                time.sleep(0.5)
    finally:
        stop_processes(pruning + KEPT)
        KEPT.clear()
    prune_rate = rows / (time.perf_counter() - started)
    if _old_rows():
        raise RuntimeError("the backlog was not pruned")
    return unpruned, pruned_rate, during, prune_rate


#: Workers left running by ``bench_drain_beside(keep=True)`` (their recovery leader still prunes).
KEPT: list[subprocess.Popen[bytes]] = []


def bench_drain_beside(n: int, processes: int, log_dir: Path, worker_args: list[str], keep: bool = False) -> float:
    """Like ``bench_drain``, without emptying the table first (the finished backlog stays)."""
    from tasks.models import Task

    Task.objects.filter(queue="bench", status="SUCCESSFUL", finished_at__gt=time_ago(3600)).delete()
    procs = start_workers(processes, *worker_args, log_dir=log_dir)
    try:
        started = time.perf_counter()
        ids = Task.objects.bulk_enqueue(NOOP, ({"i": i} for i in range(n)), queue="bench")
        wait_drained()
        elapsed = time.perf_counter() - started
    finally:
        if keep:
            KEPT.extend(procs)
        else:
            stop_processes(procs)
    done = Task.objects.filter(pk__in=ids, status="SUCCESSFUL", attempts=1).count()
    if done != n:
        raise RuntimeError(f"only {done} of {n} tasks succeeded exactly once")
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--prune-rows", type=int, default=1_000_000, help="finished rows pruned beside a drain")
    parser.add_argument("--prune-drain", type=int, default=60_000, help="tasks drained beside the pruning")
    parser.add_argument("--only-prune", action="store_true", help="run only the pruning case")
    parser.add_argument(
        "--only-claim", action="store_true", help="run only the claim cost (any server: DATABASE_URL or embedded)"
    )
    parser.add_argument(
        "--only-drain", action="store_true", help="run only the drains by 4 processes, unkeyed and keyed"
    )
    parser.add_argument(
        "--only-rate", action="store_true", help="run only the rate-limited backlog (one key, 4 processes)"
    )
    parser.add_argument(
        "--only-enqueue-drain", action="store_true", help="run only the enqueues and the drain by 4 processes"
    )
    parser.add_argument(
        "--only-keys",
        action="store_true",
        help="run only the drains over 20 and over --key-tasks distinct keys (concurrency, rate, fair)",
    )
    parser.add_argument("--key-tasks", type=int, default=100_000, help="tasks (and most keys) of --only-keys")
    parser.add_argument("--key-kinds", default="concurrency,rate,fair", help="kinds of keys for --only-keys")
    parser.add_argument(
        "--argument-index", action="store_true", help="with the opt-in argument search indexes (tasks_search_index)"
    )
    args = parser.parse_args()
    server = prepare_database()
    from django.core.management import call_command

    call_command("tasks_search_index", "create" if args.argument_index else "drop")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-tasks-"))
    worker_args = ["--concurrency", str(args.concurrency), "--batch-size", str(args.batch_size), "--no-recovery"]
    try:
        if args.only_claim:
            bench_claim_figures()
            return
        if args.only_rate:
            for backlog, count, period in ((10_000, 200, 1.0), (2_000, 20, 1.0)):
                rate, most, refusals = bench_rate_limited(backlog, count, period, 4, log_dir, worker_args)
                name = f"tasks.rate_limited.{backlog}_on_one_key_{count}_per_{period:g}s.procs=4"
                figure(f"{name}.rate", rate, f"starts/s (limit {count / period:g})")
                figure(f"{name}.fullest_window", most, f"starts (limit {count})")
                figure(f"{name}.refusals_per_task", refusals, "hand-backs")
        if args.only_keys:
            for round_no in range(1, args.rounds + 1):
                for kind in args.key_kinds.split(","):
                    few = bench_drain_over_keys(kind, args.key_tasks, 20, 4, log_dir, worker_args)
                    figure(f"tasks.drain.{kind}_keys.{args.key_tasks}_over_20.procs=4.round={round_no}", few, "tasks/s")
                    many = bench_drain_over_keys(kind, args.key_tasks, args.key_tasks, 4, log_dir, worker_args)
                    name = f"tasks.drain.{kind}_keys.{args.key_tasks}_over_{args.key_tasks}.procs=4.round={round_no}"
                    figure(name, many, "tasks/s")
                    figure(f"tasks.drain.{kind}_keys.cost_ratio.round={round_no}", few / many, "x (goal <= 2)")
            return
        if args.only_enqueue_drain:
            for round_no in range(1, args.rounds + 1):
                figure(f"tasks.enqueue.single.round={round_no}", bench_enqueue_single(args.tasks), "tasks/s")
                figure(f"tasks.enqueue.bulk.round={round_no}", bench_enqueue_bulk(args.tasks), "tasks/s")
                figure(
                    f"tasks.drain.procs=4.round={round_no}", bench_drain(args.tasks, 4, log_dir, worker_args), "tasks/s"
                )
            return
        if args.only_drain:
            for round_no in range(1, args.rounds + 1):
                rate = bench_drain(args.tasks, 4, log_dir, worker_args)
                figure(f"tasks.drain.procs=4.round={round_no}", rate, "tasks/s")
                rate = bench_drain_keyed(2000, 20, 2, 4, log_dir, worker_args)
                figure(f"tasks.drain.keyed.2000_over_20_keys_limit_2.procs=4.round={round_no}", rate, "tasks/s")
            return
        for pruner, busy in (("auto", "0.25"), ("command", "0.25"), ("command", "1")):
            case = pruner if pruner == "auto" else f"command.busy={busy}"
            unpruned, pruning, during, prune_rate = bench_drain_while_pruning(
                args.prune_drain, args.prune_rows, log_dir, worker_args, pruner, busy
            )
            figure(f"tasks.drain.procs=4.beside_{args.prune_rows}_finished", unpruned, "tasks/s")
            figure(f"tasks.drain.procs=4.while_pruning.{case}", pruning, "tasks/s")
            figure(f"tasks.drain.while_pruning.{case}.ratio", 100 * pruning / unpruned, "% (goal >= 80)")
            figure(f"tasks.prune.{case}.rows_during_drain", during, "rows")
            figure(f"tasks.prune.{case}.rate", prune_rate, "rows/s")
        if args.only_prune:
            return
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
        bench_claim_figures()
        figure("tasks.stop_to_exit.p50", bench_stop_to_exit(5, log_dir), "ms (last task's end to process exit)")
    finally:
        reset()
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
