#!/usr/bin/env python
"""Demo health: run ``manage.py demo`` at its default failure rates and judge it by its outcome.

    python bench/demo_health.py [--minutes 10] [--sample 30]

The demo is started exactly as a user starts it (three workers at concurrency 4, the generator at
2 tasks/s, 5 % injected crashes that SIGKILL a worker, 10 % injected stalls past the 5 s TTL), on
its own embedded PostgreSQL with fsync on. Every ``--sample`` seconds it prints what the dashboard
shows; at the end one comparable figure per line:

- the share of the generator's finished tasks (``tasks.demo.sleep``, whose only faults are the
  injected crashes and stalls) that SUCCEEDED (goal: at least 99 %);
- the showcase's tasks (tasks/demo/showcase.py: retries, failures by design, workflows, a rate key,
  a fair queue, snoozes, the schedule) succeeded, failed and cancelled;
- the runnable backlog at the end and at its largest (goal: bounded: it keeps up);
- tasks stuck longer than TTL + recovery interval + 2 s (goal: 0);
- recoveries, crashes charged, failures charged, claims returned uncharged, worker restarts.

- attempts the task pages show with a duration of 0.000 s because their start and end are the same
  stamp (issue 56: a failed or timed-out attempt that ran showed its end as its start; goal: 0);
- samples whose "What holds the waiting tasks" panel left Ready tasks without a reason: its parts
  (runnable, paused, rate lines, snoozed, backoff) more than the Ready count, or more "scheduled"
  than Ready tasks due later in the same snapshot (goal: 0);
- the rows the repair sweep repaired (tasks_repair: each repair is a bug; goal: 0);
- how long after its start the demo had shown every feature (``Seen``: each state and view the
  dashboard lists and each showcase feature's mark; issue 41's goal: two minutes). The test suite
  checks that every feature shows (tests/concurrency/test_demo_features.py), not how soon.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, this folder would come first on sys.path and bench/tasks.py would shadow the
    # ``tasks`` app: import from the repository root instead. (Imported by a test, leave sys.path be.)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import ROOT, figure, prepare_database

DEMO_TTL = 5.0
DEMO_RECOVERY_INTERVAL = 1.0
DEMO_TASK = "tasks.demo.sleep"  # the generator's tasks: the ones the success ratio judges


@dataclass
class Sample:
    at: float
    generated: int
    succeeded: int
    failed: int
    backlog: int
    running: int
    stuck: int
    stuck_long: int
    recoveries: int
    crashes: int
    shared_crashes: int
    failures: int
    returned: int
    showcase_succeeded: int = 0
    showcase_failed: int = 0
    cancelled: int = 0
    rate_refusals: int = 0
    snoozes: int = 0
    #: The holds panel's parts did not add up to its Ready count (see unexplained_ready).
    unexplained_ready: int = 0

    @property
    def finished(self) -> int:
        return self.succeeded + self.failed

    @property
    def success_ratio(self) -> float:
        return self.succeeded / self.finished if self.finished else 1.0


@dataclass
class Health:
    samples: list[Sample] = field(default_factory=list)
    restarts: int = 0
    log: str = ""
    #: Seconds from the demo's start to the first poll that had seen every feature (None: not in the run).
    every_feature_after: float | None = None
    #: Attempts with a start and an end at the end of the run, and those whose end is their start.
    timed_attempts: int = 0
    zero_durations: int = 0
    #: The repair sweep's counts by kind at the end (tasks_repair; each a bug to report).
    repairs: dict[str, int] = field(default_factory=dict)

    @property
    def last(self) -> Sample:
        return self.samples[-1]

    @property
    def max_backlog(self) -> int:
        return max(s.backlog for s in self.samples)

    @property
    def max_stuck_long(self) -> int:
        return max(s.stuck_long for s in self.samples)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sample(started: float) -> Sample:
    from django.db import connection
    from django.db.models import Sum

    from tasks.models import GeneratorState, Task

    stuck_after = DEMO_TTL + DEMO_RECOVERY_INTERVAL + 2
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE status = 'SUCCESSFUL' AND task_path = %s),"
            " count(*) FILTER (WHERE status = 'FAILED' AND task_path = %s),"
            " count(*) FILTER (WHERE status = 'SUCCESSFUL' AND task_path <> %s),"
            " count(*) FILTER (WHERE status = 'FAILED' AND task_path <> %s),"
            " count(*) FILTER (WHERE status = 'CANCELLED'),"
            " COALESCE(sum(rate_refusals), 0), COALESCE(sum(snoozes), 0),"
            " count(*) FILTER (WHERE status = 'READY' AND run_after <= statement_timestamp()),"
            " count(*) FILTER (WHERE status = 'RUNNING'),"
            " count(*) FILTER (WHERE status = 'RUNNING' AND expires_at <= statement_timestamp()),"
            " count(*) FILTER (WHERE status = 'RUNNING'"
            "   AND expires_at <= statement_timestamp() - make_interval(secs => %s))"
            " FROM tasks_task",
            [DEMO_TASK] * 4 + [stuck_after],
        )
        (
            succeeded,
            failed,
            showcase_succeeded,
            showcase_failed,
            cancelled,
            rate_refusals,
            snoozes,
            backlog,
            running,
            stuck,
            stuck_long,
        ) = cursor.fetchone()
        cursor.execute(
            "SELECT count(*) FROM tasks_task t, jsonb_array_elements(t.errors) e"
            " WHERE e->>'exception_class_path' = 'tasks.exceptions.TaskLeaseLost'"
        )
        (recoveries,) = cursor.fetchone()
    sums = Task.objects.aggregate(
        crashes=Sum("crashes"),
        shared=Sum("shared_crashes"),
        failures=Sum("failures"),
        returned=Sum("unstarted_returns"),
    )
    generated = GeneratorState.objects.aggregate(n=Sum("generated"))["n"] or 0
    unexplained = unexplained_ready()
    return Sample(
        at=time.monotonic() - started,
        generated=generated,
        succeeded=succeeded,
        failed=failed,
        backlog=backlog,
        running=running,
        stuck=stuck,
        stuck_long=stuck_long,
        recoveries=recoveries,
        crashes=sums["crashes"] or 0,
        shared_crashes=sums["shared"] or 0,
        failures=sums["failures"] or 0,
        returned=sums["returned"] or 0,
        showcase_succeeded=showcase_succeeded,
        showcase_failed=showcase_failed,
        cancelled=cancelled,
        rate_refusals=rate_refusals,
        snoozes=snoozes,
        unexplained_ready=unexplained,
    )


def unexplained_ready() -> int:
    """Ready tasks the overview's "What holds the waiting tasks" panel gives no reason for, read in
    one snapshot (REPEATABLE READ): its parts beyond its Ready count, or a "scheduled" remainder
    larger than the Ready tasks whose run_after is later than the snapshot's start (a remainder
    that is not scheduled is a reason the panel does not know). 0 when a part stopped at its cap."""
    from django.db import connection, transaction

    from tasks.web.holds import waiting_holds

    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute("SELECT count(*) FROM tasks_task WHERE status = 'READY' AND run_after > now()")
            (later,) = cursor.fetchone()
        holds = waiting_holds(using="default")
    if holds.ready.capped or any(hold.count.capped for hold in holds.holds):
        return 0
    parts = holds.runnable.value + sum(hold.count.value for hold in holds.held)
    scheduled = sum(hold.count.value for hold in holds.held if hold.reason == "scheduled")
    return max(parts - holds.ready.value, 0) + max(scheduled - later, 0)


def zero_durations() -> tuple[int, int]:
    """Attempts with a start and an end, over every task in either table, as the task page lists them
    (tasks.web.attempts.history); and those of them whose end is their start (shown as 0.000 s)."""
    from tasks.models import Task
    from tasks.models.finished import FINISHED_TABLE
    from tasks.web.attempts import history

    timed = same = 0
    tasks = list(Task.objects.exclude(worker_ids=[]).iterator())
    tasks += list(Task.objects.raw(f"SELECT * FROM {FINISHED_TABLE} WHERE worker_ids <> '[]'::jsonb"))
    for task in tasks:
        for attempt in history(task).attempts:
            if attempt.started_at is not None and attempt.ended_at is not None:
                timed += 1
                same += attempt.started_at == attempt.ended_at
    return timed, same


class Seen:
    """What polls of the demo's rows have observed so far: each state and view the dashboard lists,
    and each showcase feature's mark."""

    def __init__(self) -> None:
        self.marks: dict[str, bool] = {}

    def poll(self) -> bool:
        from tasks.demo import showcase
        from tasks.models import Task, Workflow
        from tasks.web.history import history
        from tasks.web.queries import STATES

        marks = self.marks
        # Each state and view the dashboard lists, read as it reads them (tasks.web.queries.STATES):
        # shown if a poll saw a task in it. Stuck (an expired lease not yet recovered) is not a goal.
        for view, state in STATES.items():
            if view != "stuck" and not marks.get(view):
                marks[view] = state.queryset().exists()
        marks["retried to success"] = Task.objects.filter(
            status="SUCCESSFUL", task_path=f"{showcase.HANDLERS}.sync_partner", failures__gt=0
        ).exists()
        marks["failed for good"] = Task.objects.filter(
            status="FAILED", task_path=f"{showcase.HANDLERS}.charge_card", failures=2
        ).exists()
        marks["workflow callback"] = Task.objects.filter(
            task_path=f"{showcase.HANDLERS}.publish_album",
            status="SUCCESSFUL",
            workflow_id__in=Workflow.objects.filter(kind="group", status="SUCCESSFUL").values("id"),
        ).exists()
        marks["chain"] = Workflow.objects.filter(kind="chain", status="SUCCESSFUL").exists()
        marks["schedule fired"] = Task.objects.filter(
            task_path=f"{showcase.HANDLERS}.nightly_digest", status="SUCCESSFUL"
        ).exists()
        marks["rate-key refusal"] = Task.objects.filter(rate_key=showcase.RATE_KEY, rate_refusals__gt=0).exists()
        fair_keys = set(
            Task.objects.filter(queue=showcase.FAIR_QUEUE, status="SUCCESSFUL")
            .values_list("fair_key", flat=True)
            .distinct()
        )
        marks["two fair keys served"] = showcase.NOISY_TENANT in fair_keys and len(fair_keys) >= 2
        marks["history hours"] = sum(1 for hour in history(hours=48).series if hour.totals.finished) > 1
        return all(marks.values())

    def missing(self) -> str:
        return ", ".join(name for name, seen in self.marks.items() if not seen)


def observe(
    seconds: float,
    *,
    log_path: Path,
    every: float = 30.0,
    echo: bool = True,
    env: dict[str, str] | None = None,
    demo_args: tuple[str, ...] = (),
) -> Health:
    """Start ``manage.py demo`` with its defaults on DATABASE_URL (of ``env``, by default this
    process's environment), watch it for ``seconds`` through Django's connection, stop it."""
    port = free_port()
    log = open(log_path, "ab")  # noqa: SIM115 (closed below; the child keeps its own copy)
    demo = subprocess.Popen(
        [sys.executable, "manage.py", "demo", "--port", str(port), *demo_args],
        cwd=ROOT,
        env=os.environ.copy() if env is None else env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    health = Health()
    started = time.monotonic()
    seen = Seen()
    try:
        next_sample = started + every
        while (now := time.monotonic()) < started + seconds:
            if demo.poll() is not None:
                raise RuntimeError(f"the demo exited early ({demo.returncode}); see {log_path}")
            if health.every_feature_after is None and seen.poll():
                health.every_feature_after = now - started
            if now >= next_sample:
                health.samples.append(s := sample(started))
                next_sample += every
                if echo:
                    print(
                        f"{s.at:6.0f}s generated {s.generated:5d}  succeeded {s.succeeded:5d}  failed {s.failed:3d}"
                        f"  backlog {s.backlog:4d}  running {s.running:3d}  stuck {s.stuck:2d} (long {s.stuck_long})"
                        f"  recoveries {s.recoveries:4d}  crashes {s.crashes:4d}/{s.shared_crashes:4d} shared"
                        f"  returned {s.returned:4d}  showcase {s.showcase_succeeded}/{s.showcase_failed} failed"
                        f"/{s.cancelled} cancelled  ready without a reason {s.unexplained_ready}",
                        flush=True,
                    )
            time.sleep(min(1.0, max(0.0, next_sample - now)))
        health.samples.append(sample(started))
        health.timed_attempts, health.zero_durations = zero_durations()
        from tasks.models import Repair

        health.repairs = {r.kind: r.count for r in Repair.objects.filter(count__gt=0)}
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
    health.log = log_path.read_text(errors="replace")
    health.restarts = len(re.findall(r"worker-\d+ exited \(-?\d+\); restarting", health.log))
    return health


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--concurrency", type=int, help="the demo's --concurrency (default: the demo's own)")
    args = parser.parse_args()
    server = prepare_database()
    try:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        health = observe(
            args.minutes * 60,
            log_path=Path(f"/tmp/demo-health-{stamp}.log"),
            every=args.sample,
            demo_args=() if args.concurrency is None else ("--concurrency", str(args.concurrency)),
        )
        last = health.last
        figure("demo.minutes", args.minutes, "min")
        shown = health.every_feature_after
        figure("demo.every_feature_seen_after", -1 if shown is None else shown, "s (goal <= 120; -1: not all seen)")
        figure("demo.generated", last.generated, "tasks")
        figure("demo.finished", last.finished, "tasks")
        figure("demo.success_ratio", 100 * last.success_ratio, "% of generated tasks SUCCESSFUL (goal >= 99)")
        figure("demo.failed", last.failed, "generated tasks FAILED")
        figure("demo.showcase.succeeded", last.showcase_succeeded, "showcase tasks SUCCESSFUL")
        figure("demo.showcase.failed", last.showcase_failed, "showcase tasks FAILED (declined charges, broken feeds)")
        figure("demo.cancelled", last.cancelled, "tasks CANCELLED (chain steps after a failed one)")
        figure("demo.rate_refusals", last.rate_refusals, "starts refused by the demo-smtp rate key")
        figure("demo.snoozes", last.snoozes, "snoozes")
        figure("demo.backlog.end", last.backlog, "runnable tasks waiting")
        figure("demo.backlog.max", health.max_backlog, "runnable tasks waiting (largest sample)")
        figure("demo.stuck_long.max", health.max_stuck_long, "tasks stuck > TTL + interval + 2 s (goal 0)")
        figure("demo.recoveries", last.recoveries, "requeues after a lease expired")
        figure("demo.crashes", last.crashes, "attributable crashes (the attempt stalled, or ran isolated)")
        figure("demo.shared_crashes", last.shared_crashes, "attempts whose worker vanished beside others (uncharged)")
        figure("demo.failures", last.failures, "failed attempts (the handler's own)")
        figure("demo.returned_uncharged", last.returned, "claims returned uncharged")
        figure("demo.worker_restarts", health.restarts, "worker processes killed by injected crashes")
        figure("demo.attempts_timed", health.timed_attempts, "attempts with a start and an end")
        figure("demo.attempts_zero_duration", health.zero_durations, "of them ending at their start (goal 0)")
        repaired = f"rows repaired by the sweep (goal 0) {health.repairs or ''}"
        figure("demo.repairs", sum(health.repairs.values()), repaired)
        unexplained = sum(1 for s in health.samples if s.unexplained_ready)
        figure("demo.samples_with_unexplained_ready", unexplained, f"of {len(health.samples)} samples (goal 0)")
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
