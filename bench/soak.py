#!/usr/bin/env python
"""Crash soak: prove that nothing is lost, doubled or stuck while workers crash and freeze and the
database restarts under them.

    python bench/soak.py                      # 20,000 tasks (the long form)
    python bench/soak.py --tasks 2000         # the short form .ci/run runs (under two minutes)

Every task's handler records its start, then writes its task's effect row through
``fenced_update`` with its fencing token, then sleeps a few milliseconds. Four worker processes
and the recovery controller run while, every few seconds, a random worker is SIGKILLed (and a new
one started) or SIGSTOPped for longer than the TTL (then SIGCONTed), and PostgreSQL itself is
restarted once mid-run (the workers reconnect by themselves).

A share of the tasks (``--misbehave``, 5 % by default) are what careless task authors write: they
return NaN, infinity, a NUL character, a lone surrogate or an object; raise with NUL or a surrogate
in the message; raise SystemExit or KeyboardInterrupt; overrun their timeout; and a few poison pills
call ``os._exit`` on every worker they land on (the fleet restarts dead workers). Each must end in its
recorded terminal state while the rest of the run is unaffected.

At the end it checks, prints, and exits non-zero if any is not zero: tasks lost (a well-behaved task
not SUCCESSFUL, a misbehaving one not in its expected recorded end), tasks finished more than once,
effect rows left by a stale token, tasks stuck running, and attempts charged to tasks whose handler
never started (each handler appends "task attempt" to a file first thing, which survives SIGKILL). It also
prints how many stale writes the fence rejected, the longest time from a kill to the task running
again, and the total time. Runs against its own embedded PostgreSQL (it must be able to restart
it), with the test settings' fenced table.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a script, this folder would come first on sys.path and bench/tasks.py would shadow the
# ``tasks`` app: import from the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])
ROOT = Path(__file__).resolve().parents[1]

HANDLER = "bench.soak_handlers.effect"
MISBEHAVING = "bench.soak_handlers.misbehave"
#: kind -> the exception class path its task must end FAILED with.
KINDS = {
    "nan": "tasks.exceptions.UnstorableResult",
    "inf": "tasks.exceptions.UnstorableResult",
    "nul": "tasks.exceptions.UnstorableResult",
    "surrogate": "tasks.exceptions.UnstorableResult",
    "object": "tasks.exceptions.UnstorableResult",
    "error-nul": "builtins.ValueError",
    "error-surrogate": "builtins.ValueError",
    "system-exit": "builtins.SystemExit",
    "keyboard-interrupt": "builtins.KeyboardInterrupt",
    "timeout": "tasks.exceptions.TaskTimeout",
    "poison": "tasks.exceptions.TaskLeaseLost",
}
POISON_PILLS = 2
SUCCEEDED = re.compile(r"task (\d+) \S+ succeeded")


@dataclass
class Chaos:
    kills: list[tuple[str, float]] = field(default_factory=list)  # (worker name, database time as epoch)
    pauses: int = 0
    paused: set[str] = field(default_factory=set)  # the names of the workers SIGSTOPped past the TTL
    restarts: int = 0


class Fleet:
    def __init__(self, log_dir: Path, env: dict[str, str], ttl: float) -> None:
        self.log_dir = log_dir
        self.env = env
        self.ttl = ttl
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.others: list[subprocess.Popen[bytes]] = []
        self.started = 0

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        return proc

    def start_worker(self) -> str:
        self.started += 1
        name = f"soak-worker-{self.started}"
        self.workers[name] = self._spawn(
            name,
            "run_worker", "--worker-id", name, "--ttl", str(self.ttl), "--no-recovery",
            "--concurrency", "4", "--batch-size", "8", "--poll-interval", "0.5", "-v", "1",
        )  # fmt: skip
        return name

    def start_recovery(self, interval: float) -> None:
        self.others.append(self._spawn("recovery", "recover_tasks", "--interval", str(interval), "-v", "1"))

    def restart_dead(self) -> list[str]:
        """Workers that died on their own (a poison pill's os._exit) are replaced, as a supervisor would."""
        dead = [name for name, proc in self.workers.items() if proc.poll() is not None]
        for name in dead:
            del self.workers[name]
            self.start_worker()
        return dead

    def strike(self, chaos: Chaos, rng: random.Random, kill_share: float, when: Callable[[], float]) -> str:
        """One fault on a worker ``rng`` picks: SIGKILL (a share ``kill_share`` of strikes; a new worker
        started in its place, the kill recorded at ``when()``) or SIGSTOP for 1.5 TTL, then SIGCONT: a
        zombie that wakes to find its lease taken. Returns what it did, for the log."""
        name = rng.choice(sorted(self.workers))
        proc = self.workers[name]
        if rng.random() < kill_share:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            chaos.kills.append((name, when()))
            del self.workers[name]
            return f"SIGKILL {name}, started {self.start_worker()}"
        chaos.pauses += 1
        chaos.paused.add(name)
        pause = self.ttl * 1.5
        proc.send_signal(signal.SIGSTOP)
        time.sleep(pause)
        proc.send_signal(signal.SIGCONT)
        return f"SIGSTOP {name} for {pause:.1f}s"

    def stop(self) -> None:
        for proc in [*self.workers.values(), *self.others]:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.workers.values(), *self.others]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def db_epoch() -> float:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())")
        return float(cursor.fetchone()[0])


def retrying(query):
    """Run a read of the orchestrator through a database restart."""
    from django.db import Error, connection

    for _ in range(100):
        try:
            return query()
        except Error:
            connection.close()
            time.sleep(0.2)
    return query()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--recovery-interval", type=float, default=0.5)
    parser.add_argument("--chaos-every", type=float, default=3.0, help="seconds between chaos events")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--misbehave", type=float, default=0.05, help="share of tasks that misbehave")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    from leasing.embedded import discard, ensure_server

    base = Path(tempfile.mkdtemp(prefix="leasing-soak-"))
    server = ensure_server(base / "pgdata")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))  # run the clean-up below on SIGTERM too
    try:
        return _soak(args, rng, server)
    finally:
        discard(server)


def _soak(args: argparse.Namespace, rng: random.Random, server: Any) -> int:
    os.environ["DATABASE_URL"] = server.url()
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"  # the fenced table lives in the test app
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.db import models

    from tasks.models import Task
    from tests.testapp.models import Effect, FencedRecord

    log_dir = Path(tempfile.mkdtemp(prefix="leasing-soak-logs-"))  # kept after the server is discarded
    print(f"soak: {args.tasks} tasks, {args.workers} workers, TTL {args.ttl}s; logs in {log_dir}", flush=True)
    FencedRecord.objects.bulk_create([FencedRecord(key=str(i)) for i in range(args.tasks)], batch_size=5000)
    kinds = list(KINDS)
    step = max(1, round(1 / args.misbehave)) if args.misbehave > 0 else args.tasks + 1
    bad = {i: kinds[n % (len(kinds) - 1)] for n, i in enumerate(range(0, args.tasks, step))}
    for i in sorted(bad)[:POISON_PILLS] if bad else []:
        bad[i] = "poison"
    good = [i for i in range(args.tasks) if i not in bad]
    Task.objects.bulk_enqueue(HANDLER, ({"key": str(i)} for i in good), max_attempts=25)
    expected: dict[int, str] = {}
    for i, kind in bad.items():
        task_id = Task.objects.enqueue(
            MISBEHAVING,
            kwargs={"key": str(i), "kind": kind},
            max_attempts=3,
            timeout=0.3 if kind == "timeout" else None,
        ).id
        expected[task_id] = kind
    starts_dir = Path(tempfile.mkdtemp(prefix="leasing-soak-starts-"))

    env = dict(os.environ, PYTHONUNBUFFERED="1", TASKS_TTL=str(args.ttl), SOAK_START_LOG=str(starts_dir))
    fleet = Fleet(log_dir, env, args.ttl)
    chaos = Chaos()
    started = time.monotonic()
    try:
        fleet.start_recovery(args.recovery_interval)
        for _ in range(args.workers):
            fleet.start_worker()
        next_chaos = time.monotonic() + args.chaos_every
        restarted = False
        while True:
            unfinished = retrying(lambda: Task.objects.unfinished().count())
            if unfinished == 0:
                break
            for name in fleet.restart_dead():
                print(f"soak: {name} died on its own (a poison pill); replaced it", flush=True)
            if time.monotonic() - started > args.timeout:
                print(f"soak: TIMEOUT with {unfinished} unfinished tasks", flush=True)
                break
            done_fraction = 1 - unfinished / args.tasks
            if not restarted and done_fraction >= 0.4:
                restarted = True
                chaos.restarts += 1
                print(f"soak: restarting PostgreSQL at {done_fraction:.0%}", flush=True)
                server.restart("fast")
            elif time.monotonic() >= next_chaos:
                next_chaos = time.monotonic() + args.chaos_every
                did = fleet.strike(chaos, rng, 0.6, lambda: retrying(db_epoch))
                print(f"soak: {did} ({done_fraction:.0%} done)", flush=True)
            time.sleep(0.1)
    finally:
        fleet.stop()
    total = time.monotonic() - started

    # -- verdict ------------------------------------------------------------------------------
    statuses = Counter(Task.objects.exclude(pk__in=expected).values_list("status", flat=True))
    lost = len(good) - statuses.get("SUCCESSFUL", 0)
    wrong_ends: list[str] = []
    from tasks.conf import get_settings

    max_crashes = get_settings().MAX_CRASHES
    for task in Task.objects.filter(pk__in=expected):
        kind = expected[task.pk]
        last = (task.errors or [{}])[-1]
        ok = task.status == "FAILED" and last.get("exception_class_path") == KINDS[kind]
        if kind == "poison":
            ok = ok and last.get("kind") == "crash" and task.failures == 0 and task.crashes == max_crashes
        elif task.failures > task.max_attempts:
            ok = False
        if not ok:
            wrong_ends.append(f"{task.pk} {kind}: {task.status} {last.get('exception_class_path')} {last.get('kind')}")
    lost += len(wrong_ends)
    handler_starts: set[tuple[int, int]] = set()
    for path in starts_dir.glob("starts-*.txt"):
        for line in path.read_text().splitlines():
            started_id, started_attempt = line.split()
            handler_starts.add((int(started_id), int(started_attempt)))
    # What an attempt is charged with is a failure or an attributable crash (error entries of kind
    # "failure" / "crash"); ``attempts`` counts every attempt recorded as begun, charged or not.
    # One exception: a suspect's start is marked (committed) before its handler is called, and a
    # process SIGSTOPped past the TTL between the two looks, once it runs again, exactly like an
    # attempt that stalled (the worker heartbeats, the attempt's lease has lapsed): the fault model
    # charges it as the attempt's crash. Counted apart; how often a pause lands in that window is a
    # matter of the machine's load (one in a clean-clone CI run beside two other sessions' work).
    charged_never_begun = []
    paused_after_the_mark = 0
    marked_never_begun = 0
    for task_id, begun, errors in Task.objects.values_list("id", "attempts", "errors"):
        marked_never_begun += sum(1 for n in range(1, begun + 1) if (task_id, n) not in handler_starts)
        for entry in errors:
            if entry.get("kind") in ("failure", "crash") and (task_id, entry.get("attempt")) not in handler_starts:
                worker_name = str(entry.get("worker") or "").split(":")[0]
                if entry.get("kind") == "crash" and worker_name in chaos.paused:
                    paused_after_the_mark += 1
                    continue
                charged_never_begun.append((task_id, entry.get("attempt"), entry.get("kind")))
    charged_unstarted = len(charged_never_begun)
    for task_id, n, kind in charged_never_begun[:10]:
        task = Task.objects.get(pk=task_id)
        entries = [(e.get("attempt"), e.get("kind"), e.get("worker")) for e in task.errors]
        print(f"  charged ({kind}), never begun: task {task_id} attempt {n} ({expected.get(task_id, 'effect')})"
              f" {task.status} worker_ids={task.worker_ids} errors={entries}")  # fmt: skip
    stuck = Task.objects.running().count()
    completions: Counter[int] = Counter()
    for log in log_dir.glob("soak-worker-*.log"):
        completions.update(int(task_id) for task_id in SUCCEEDED.findall(log.read_text()))
    doubled = sum(1 for count in completions.values() if count > 1)
    finals = dict(Task.objects.values_list("kwargs__key", "token"))
    stale_rows = sum(
        1
        for record in FencedRecord.objects.exclude(key__in=[str(i) for i in bad])
        if record.fence_token != finals.get(record.key)
    )
    rejected = Effect.objects.filter(phase="stale-rejected").count()
    attempts = Counter(Task.objects.values_list("attempts", flat=True))
    # Kill -> requeue (runnable again: what invariant 7 bounds), from each recovery's own record;
    # kill -> rerun, to the start of the very next attempt where that attempt did start (a rerun
    # that was itself killed or frozen before starting is a new chaos event, not this one's delay).
    from django.db import connection

    from tasks.models import Worker

    worst_requeue = worst_rerun = 0.0
    incarnations = dict(Worker.objects.values_list("name", "id"))  # each soak worker name starts once
    with connection.cursor() as cursor:
        for name, killed_at in chaos.kills:
            worker = incarnations.get(name, name)
            cursor.execute(
                "SELECT max(EXTRACT(EPOCH FROM (e->>'at')::timestamptz) - %s) FROM tasks_task t,"
                " jsonb_array_elements(t.errors) e WHERE e->>'worker' = %s"
                " AND e->>'exception_class_path' = 'tasks.exceptions.TaskLeaseLost'",
                [killed_at, worker],
            )
            worst_requeue = max(worst_requeue, float(cursor.fetchone()[0] or 0))
            cursor.execute(
                "SELECT max(EXTRACT(EPOCH FROM n.created_at) - %s) FROM tasks_task t"
                " JOIN testapp_effect e ON e.task_id = t.id AND e.phase = 'started'"
                " JOIN testapp_effect n ON n.task_id = t.id AND n.phase = 'started' AND n.attempt = e.attempt + 1"
                " WHERE t.worker_ids -> (e.attempt - 1) = to_jsonb(%s::text) AND EXTRACT(EPOCH FROM e.created_at) < %s"
                # only attempts the kill interrupted: recovery recorded their lease as lost
                " AND EXISTS (SELECT 1 FROM jsonb_array_elements(t.errors) x WHERE x->>'worker' = %s"
                "  AND (x->>'attempt')::int = e.attempt"
                "  AND x->>'exception_class_path' = 'tasks.exceptions.TaskLeaseLost')",
                [killed_at, worker, killed_at, worker],
            )
            worst_rerun = max(worst_rerun, float(cursor.fetchone()[0] or 0))
    print("")
    print(f"tasks                          {args.tasks}")
    print(f"tasks lost (not finished)      {lost}")
    print(f"misbehaving tasks              {len(expected)} ({', '.join(sorted(set(expected.values())))})")
    for line in wrong_ends[:20]:
        print(f"  not in its recorded end: {line}")
    print(f"attempts charged, never begun  {charged_unstarted} (failures or crashes, handler never ran)")
    print(f"attempts marked, never begun   {marked_never_begun} (killed before the handler ran)")
    print(f"paused between mark and handler {paused_after_the_mark} (charged as a stall: the fault model's rule)")
    returned = Task.objects.aggregate(n=models.Sum("unstarted_returns"))["n"] or 0
    print(f"claims returned uncharged      {returned}")
    print(f"tasks finished more than once  {doubled}")
    print(f"effect rows by a stale token   {stale_rows}")
    print(f"stale writes rejected          {rejected}")
    print(f"tasks stuck running            {stuck}")
    print(f"workers killed / paused        {len(chaos.kills)} / {chaos.pauses}")
    print(f"PostgreSQL restarts            {chaos.restarts}")
    print(f"attempts per task              {dict(sorted(attempts.items()))}")
    bound = args.ttl + args.recovery_interval
    print(
        f"longest kill to requeue        {worst_requeue:.2f} s (runnable again; bound: TTL + interval = {bound:.2f} s)"
    )
    print(f"longest kill to rerun          {worst_rerun:.2f} s (the next attempt's start, while every worker is busy)")
    print(f"total time                     {total:.1f} s")
    failed = lost or doubled or stale_rows or stuck or charged_unstarted
    print("soak: " + ("FAILED" if failed else "passed: nothing lost, doubled, stale or stuck"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
