#!/usr/bin/env python
"""A rate-limited backlog drained by worker processes (issue 38, item 6): does it wait in line, and
what do the refused starts cost?

    python bench/rate_limits.py [--backlogs 600,1500] [--limit 20] [--processes 3] [--concurrency 4]
        [--rounds 1] [--flow-seconds 30] [--kill-at 10]

Each case: a backlog of N no-op tasks on one rate key of ``--limit`` starts per second, enqueued in
one statement (ids in enqueue order), then ``--processes`` worker processes (``manage.py run_worker``
at the default 2 s poll interval) drain it. From the rows afterwards (each task ran once, so its
``last_attempted_at`` is its one grant, on the database clock):

- refusals per start: each task's ``rate_refusals`` (mean, max, how many were refused 3+ times) and
  the key's total refusals per grant (tasks_ratelimit);
- the order: the latest start among the first 100 tasks enqueued, in seconds after the first start
  (in line: about 100 / limit), and how far a task's start rank strays from its enqueue rank (p95,
  max);
- the rate held: starts per second from the first to the last start, and the fullest sliding
  one-period window (never more than the limit);
- the drain, from the first start to the last.

Then the flow case (``--flow-seconds``, 0 leaves it out; what tests/concurrency/test_rate_limit_processes.py
measured until issue 55 made it a check of what holds at any speed): a backlog the key cannot finish,
other work flowing beside it (5 unkeyed tasks and 5 of another key far from its limit every 0.25 s),
one worker SIGKILLed ``--kill-at`` seconds in: the key's rate over the run and from 3 s after the kill
(a killed worker's grants take no budget with it), the fullest window, and how long the other tasks
waited for their start (p50, p95) and how many the key refused (none should be).

Against the embedded PostgreSQL (or DATABASE_URL), each case on an emptied table. Timing goals belong
here; tests/concurrency/test_rate_limit_order.py and test_rate_limit_processes.py check what holds at
any speed (each task started once, the limit never exceeded, the other keys never refused).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # run as a script: this folder would shadow the apps; import from the root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import figure, prepare_database, stop_processes
from bench.tasks import NOOP, reset, start_workers

KEY = "bench-rate"


@dataclass(frozen=True)
class Drain:
    backlog: int
    refusals_mean: float
    refusals_max: int
    refused_3_plus: int
    refusals_per_grant: float
    first_100_latest: float
    rank_stray_p95: int
    rank_stray_max: int
    rate: float
    fullest_window: int
    drain_seconds: float


def fullest_window(times: list[dt.datetime], period: float) -> int:
    """The most starts in any half-open window [t, t + period) of the database clock."""
    width, most, j = dt.timedelta(seconds=period), 0, 0
    for i, at in enumerate(times):
        j = max(j, i)
        while j < len(times) and times[j] < at + width:
            j += 1
        most = max(most, j - i)
    return most


def drain(backlog: int, limit: int, processes: int, concurrency: int, log_dir: Path) -> Drain:
    from django.db import connection

    from tasks.models import RateLimit, Task

    reset()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE tasks_ratelimit")
    Task.objects.bulk_enqueue(NOOP, [{}] * backlog, queue="bench", rate_key=KEY, rate_limit=(limit, 1.0))
    procs = start_workers(processes, "--concurrency", str(concurrency), log_dir=log_dir)
    try:
        # A drain at the key's rate, with a generous deadline: a stuck backlog ends the bench, not the machine.
        budget = 3 * backlog / limit + 120
        deadline = time.monotonic() + budget
        while Task.objects.filter(queue="bench", status__in=["BLOCKED", "READY", "RUNNING"]).exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the backlog did not drain within {budget:.0f} s; see {log_dir}")
            time.sleep(0.1)
    finally:
        stop_processes(procs)
    rows = list(
        Task.objects.filter(queue="bench")
        .order_by("id")
        .values_list("id", "status", "attempts", "rate_refusals", "last_attempted_at")
    )
    if any(status != "SUCCESSFUL" or attempts != 1 for _, status, attempts, _, _ in rows) or len(rows) != backlog:
        raise RuntimeError(f"not every task succeeded in one attempt; see {log_dir}")
    refusals = [refused for _, _, _, refused, _ in rows]
    starts: list[dt.datetime] = [at for _, _, _, _, at in rows if at is not None]  # in enqueue (id) order
    if len(starts) != backlog:
        raise RuntimeError(f"a task succeeded without a start time; see {log_dir}")
    first = min(starts)
    by_start = sorted(range(backlog), key=lambda i: (starts[i], i))
    stray = sorted(abs(rank - i) for rank, i in enumerate(by_start))
    key = RateLimit.objects.get(key=KEY)
    ordered = sorted(starts)
    span = (ordered[-1] - ordered[0]).total_seconds()
    return Drain(
        backlog=backlog,
        refusals_mean=statistics.fmean(refusals),
        refusals_max=max(refusals),
        refused_3_plus=sum(1 for r in refusals if r >= 3),
        refusals_per_grant=key.refusals / max(key.grants, 1),
        first_100_latest=max((at - first).total_seconds() for at in starts[:100]),
        rank_stray_p95=stray[int(len(stray) * 0.95)],
        rank_stray_max=stray[-1],
        rate=(backlog - 1) / span,
        fullest_window=fullest_window(ordered, 1.0),
        drain_seconds=span,
    )


@dataclass(frozen=True)
class Flow:
    rate: float
    rate_after_kill: float
    fullest_window: int
    others: int
    others_wait_p50: float
    others_wait_p95: float
    others_refused: int


def database_now() -> dt.datetime:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        now: dt.datetime = cursor.fetchone()[0]
    return now


def flow(limit: int, processes: int, concurrency: int, seconds: float, kill_at: float, log_dir: Path) -> Flow:
    from django.db import connection

    from tasks.models import Task

    reset()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE tasks_ratelimit")
    Task.objects.bulk_enqueue(
        NOOP, [{}] * int(2 * limit * seconds), queue="bench", rate_key=KEY, rate_limit=(limit, 1.0)
    )
    procs = start_workers(processes, "--concurrency", str(concurrency), log_dir=log_dir)
    keyed = Task.objects.filter(queue="bench", rate_key=KEY)
    others: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not keyed.filter(last_attempted_at__isnull=False).exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no start of the key within 120 s; see {log_dir}")
            time.sleep(0.05)
        began = time.monotonic()
        killed: dt.datetime | None = None
        while (elapsed := time.monotonic() - began) < seconds:
            others += Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="bench")
            others += Task.objects.bulk_enqueue(
                NOOP, [{}] * 5, queue="bench", rate_key="bench-other", rate_limit=(1000, 1.0)
            )
            if killed is None and elapsed > kill_at:
                os.kill(procs[0].pid, signal.SIGKILL)
                procs[0].wait(10)
                killed = database_now()
            time.sleep(0.25)  # the feeder's pace
        ended = database_now()
        deadline = time.monotonic() + 120
        while Task.objects.filter(pk__in=others).exclude(status="SUCCESSFUL").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the other tasks did not finish within 120 s; see {log_dir}")
            time.sleep(0.1)
    finally:
        stop_processes(procs)
    times: list[dt.datetime] = sorted(
        at for at in keyed.filter(last_attempted_at__lte=ended).values_list("last_attempted_at", flat=True) if at
    )
    span = (times[-1] - times[0]).total_seconds()
    after_from = (killed or ended) + dt.timedelta(seconds=3)
    after = [t for t in times if t > after_from]
    waits = sorted(
        (started - enqueued).total_seconds()
        for started, enqueued in Task.objects.filter(pk__in=others).values_list("last_attempted_at", "enqueued_at")
        if started is not None
    )
    return Flow(
        rate=(len(times) - 1) / span,
        rate_after_kill=len(after) / max((ended - after_from).total_seconds(), 1e-9),
        fullest_window=fullest_window(times, 1.0),
        others=len(others),
        others_wait_p50=waits[len(waits) // 2],
        others_wait_p95=waits[int(len(waits) * 0.95)],
        others_refused=Task.objects.filter(pk__in=others, rate_refusals__gt=0).count(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backlogs", default="600,1500", help="comma-separated backlog sizes")
    parser.add_argument("--limit", type=int, default=20, help="starts per second of the key")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4, help="executor threads per process")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--flow-seconds", type=float, default=30.0, help="the flow case's length (0: none)")
    parser.add_argument("--kill-at", type=float, default=10.0, help="seconds into the flow case of the SIGKILL")
    args = parser.parse_args()
    server = prepare_database()
    log_dir = Path(tempfile.mkdtemp(prefix="leasing-bench-rate-"))
    try:
        for _ in range(args.rounds):
            for backlog in (int(n) for n in args.backlogs.split(",")):
                d = drain(backlog, args.limit, args.processes, args.concurrency, log_dir)
                name = f"rate.{backlog}_at_{args.limit}_per_s.procs={args.processes}"
                figure(f"{name}.refusals_per_start_mean", d.refusals_mean, "refusals")
                figure(f"{name}.refusals_per_start_max", d.refusals_max, "refusals")
                figure(f"{name}.refused_3_or_more_times", d.refused_3_plus, "tasks")
                figure(f"{name}.key_refusals_per_grant", d.refusals_per_grant, "refusals")
                figure(f"{name}.first_100_latest_start", d.first_100_latest, "s")
                figure(f"{name}.start_rank_stray_p95", d.rank_stray_p95, "ranks")
                figure(f"{name}.start_rank_stray_max", d.rank_stray_max, "ranks")
                figure(f"{name}.rate", d.rate, "starts/s")
                figure(f"{name}.fullest_window", d.fullest_window, "starts")
                figure(f"{name}.drain", d.drain_seconds, "s")
            if args.flow_seconds > 0:
                f = flow(args.limit, args.processes, args.concurrency, args.flow_seconds, args.kill_at, log_dir)
                name = f"rate.flow_at_{args.limit}_per_s.procs={args.processes}"
                figure(f"{name}.rate", f.rate, "starts/s")
                figure(f"{name}.rate_from_3s_after_the_kill", f.rate_after_kill, "starts/s")
                figure(f"{name}.fullest_window", f.fullest_window, "starts")
                figure(f"{name}.others", f.others, "tasks")
                figure(f"{name}.others_wait_p50", f.others_wait_p50 * 1000, "ms")
                figure(f"{name}.others_wait_p95", f.others_wait_p95 * 1000, "ms")
                figure(f"{name}.others_refused", f.others_refused, "tasks")
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
