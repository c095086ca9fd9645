#!/usr/bin/env python
"""Durable steps under faults, and what a step costs (issue 58).

    python bench/durable_steps.py faults                   # 1,000 tasks x 5 steps, embedded PostgreSQL 18
    python bench/durable_steps.py faults --pgbouncer       # the workers through PgBouncer (transaction pooling)
    python bench/durable_steps.py faults --database-url postgres://postgres@/postgres?host=/tmp/pgm&port=55432 \\
        --restart "runuser -u postgres -- /usr/lib/postgresql/15/bin/pg_ctl -D /tmp/pgm/data -m fast -w restart"
    python bench/durable_steps.py overhead                 # 10 no-op steps per task, 1 and 4 worker processes
    python bench/durable_steps.py overhead --dbos-python .venv-bench/bin/python   # and DBOS's, interleaved

**faults.** N tasks of K steps. Each step writes an effect row inside its fenced transaction, sleeps
10-50 ms (so that faults land inside steps), then calls a counting "external service" (a file each
call is appended to, which survives SIGKILL) with ``step_key()``. One task in ten has a second step
of 1-4 s, about the pause: a zombie paused in it wakes while the worker that took the task over is
inside the same step, and races it to the commit. Four worker processes and the recovery controller
run while, every ``--chaos-every`` seconds, a random worker is SIGKILLed (and a new one started) or
SIGSTOPped for 1.5 TTL and then SIGCONTed: the zombie, which wakes inside its step after another
worker has taken the task over. PostgreSQL is restarted once, at 40 %. Counted at the end, and the
run exits non-zero unless each of these is zero:

- step effects committed twice (a (task, step) with two effect rows);
- steps committed by a worker that no longer held the task: stored by an attempt after a later
  attempt of the task had called a step (it could only have begun once the task was taken over);
- steps run again by a later attempt after they committed (the replay failed);
- steps stored without their effect, or with an effect of another attempt (the step's write and its
  result did not commit together);
- tasks lost (not SUCCESSFUL) or stuck RUNNING;

and reported: step runs by a zombie after another attempt committed that step (their commits refused,
their writes rolled back), and external calls with a key already seen (what the callee deduplicates).

**overhead.** Workers started on an empty queue (``--concurrency 4`` each); then N tasks of 10 no-op
steps, and N tasks of no step, each drained from the enqueue to the last finish. Steps per second,
and the time a step adds. With ``--dbos-python``, the same N workflows of 10 no-op DBOS steps in as
many processes of 4 threads each (bench/peer_dbos_steps.py), on the same server, interleaved.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# Run as a script, this folder would come first on sys.path and bench/tasks.py would shadow the
# ``tasks`` app: import from the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.soak import Chaos, Fleet, retrying  # noqa: E402

STEPPED = "bench.soak_handlers.stepped"
NOOP_STEPS = "bench.soak_handlers.noop_steps"


class Database:
    """A fresh database on the embedded server (PostgreSQL 18), or on the server of ``--database-url``
    (restarted by ``--restart``, a shell command)."""

    def __init__(self, url: str | None, restart: str | None) -> None:
        self.server: Any = None
        self.restart_command = restart
        self.created: tuple[str, str] | None = None
        if url is None:
            from leasing.embedded import ensure_server

            self.server = ensure_server(Path(tempfile.mkdtemp(prefix="leasing-durable-")) / "pgdata")
            self.url = self.server.url()
        else:
            import psycopg

            name = f"durable_bench_{os.getpid()}"
            with psycopg.connect(_conninfo(url), autocommit=True) as admin:
                admin.execute(f"CREATE DATABASE {name}")
            self.created = (url, name)
            parts = urlsplit(url)
            self.url = urlunsplit(parts._replace(path=f"/{name}"))

    def restart(self) -> bool:
        if self.server is not None:
            self.server.restart("fast")
            return True
        if self.restart_command:
            subprocess.run(shlex.split(self.restart_command), check=True, stdout=subprocess.DEVNULL)
            return True
        return False

    def discard(self) -> None:
        if self.server is not None:
            from leasing.embedded import discard

            discard(self.server)
        elif self.created is not None:
            import psycopg

            url, name = self.created
            from django.db import connections

            connections.close_all()
            with psycopg.connect(_conninfo(url), autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _conninfo(url: str) -> str:
    import environ

    settings = environ.Env.db_url_config(url)
    options = settings.get("OPTIONS") or {}
    parts = {
        "host": options.get("host") or settings.get("HOST"),
        "port": options.get("port") or settings.get("PORT"),
        "user": settings.get("USER"),
        "password": settings.get("PASSWORD"),
        "dbname": settings.get("NAME") or "postgres",
    }
    return " ".join(f"{k}={v}" for k, v in parts.items() if v)


def setup(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"  # the effect table lives in the test app
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["faults", "overhead"])
    parser.add_argument("--tasks", type=int, default=None, help="faults: 1,000; overhead: 1,000")
    parser.add_argument("--steps", type=int, default=None, help="faults: 5; overhead: 10")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 4], help="overhead: worker processes")
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--chaos-every", type=float, default=1.0, help="seconds between chaos events")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--pgbouncer", action="store_true", help="faults: the workers through PgBouncer")
    parser.add_argument("--database-url", default=None, help="a server to make the benchmark's database on")
    parser.add_argument("--restart", default=None, help="with --database-url: the command that restarts it")
    parser.add_argument("--dbos-python", default=None, help="overhead: a Python with dbos installed, to measure it too")
    args = parser.parse_args()
    database = Database(args.database_url, args.restart)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))  # run the clean-up below on SIGTERM too
    try:
        setup(database.url)
        if args.mode == "faults":
            return faults(args, database)
        return overhead(args)
    finally:
        database.discard()


# -- faults ----------------------------------------------------------------------------------------------


def faults(args: argparse.Namespace, database: Database) -> int:
    from django.db import connection

    from tasks.models import Task, TaskStep
    from tests.testapp.models import Effect

    rng = random.Random(args.seed)
    n_tasks, n_steps = args.tasks or 1000, args.steps or 5
    log_dir = Path(tempfile.mkdtemp(prefix="leasing-durable-logs-"))
    calls_dir = Path(tempfile.mkdtemp(prefix="leasing-durable-calls-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TASKS_TTL=str(args.ttl), DURABLE_CALL_LOG=str(calls_dir))
    with ExitStack() as stack:
        if args.pgbouncer:
            from tests.helpers.pgbouncer import pgbouncer

            bouncer = stack.enter_context(pgbouncer(connection.settings_dict, pool_size=8))
            env |= {"DATABASE_URL": bouncer.url(connection.settings_dict["NAME"]), "DATABASE_POOLED": "true"}
        server = connection.cursor().connection.info.server_version
        print(
            f"durable steps under faults: {n_tasks} tasks x {n_steps} steps, {args.workers} workers, TTL {args.ttl}s,"
            f" PostgreSQL {server // 10000}{', through PgBouncer' if args.pgbouncer else ''}; logs in {log_dir}",
            flush=True,
        )
        # One task in ten has a slow second step (1-4 s, about the pause): a zombie paused in it wakes
        # while the worker that took the task over is inside the same step, and races it to the commit.
        ids = Task.objects.bulk_enqueue(
            STEPPED,
            ({"steps": n_steps, "slow": rng.uniform(1, 4) if i % 10 == 0 else 0.0} for i in range(n_tasks)),
            max_attempts=50,
        )
        fleet = Fleet(log_dir, env, args.ttl)
        chaos = Chaos()
        started = time.monotonic()
        try:
            fleet.start_recovery(0.5)
            for _ in range(args.workers):
                fleet.start_worker()
            next_chaos = time.monotonic() + args.chaos_every
            restarted = False
            while True:
                unfinished = retrying(lambda: Task.objects.unfinished().count())
                if unfinished == 0:
                    break
                fleet.restart_dead()
                if time.monotonic() - started > args.timeout:
                    print(f"durable steps: TIMEOUT with {unfinished} unfinished tasks", flush=True)
                    break
                done = 1 - unfinished / n_tasks
                if not restarted and done >= 0.4:
                    restarted = True
                    if database.restart():
                        chaos.restarts += 1
                        print(f"durable steps: PostgreSQL restarted at {done:.0%}", flush=True)
                elif time.monotonic() >= next_chaos:
                    next_chaos = time.monotonic() + args.chaos_every
                    fleet.strike(chaos, rng, 0.5, lambda: 0.0)
                time.sleep(0.1)
        finally:
            fleet.stop()
        total = time.monotonic() - started

    # -- verdict ----------------------------------------------------------------------------------------
    rows = TaskStep.objects.filter(task_id__in=ids).values_list(
        "task_id", "position", "attempt", "token", "completed_at"
    )
    stored = {(t, p): (a, tok, done.timestamp()) for t, p, a, tok, done in rows}
    effects: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for task_id, phase, attempt, token in Effect.objects.filter(task_id__in=ids).values_list(
        "task_id", "phase", "attempt", "token"
    ):
        effects[(task_id, int(phase.removeprefix("step-")))].append((attempt, token))
    doubled = sum(1 for rows in effects.values() if len(rows) > 1)
    apart = sum(1 for key, (attempt, token, _) in stored.items() if effects.get(key) != [(attempt, token)]) + sum(
        1 for key in effects if key not in stored
    )
    calls: list[tuple[int, int, int, float]] = []  # task, position, attempt, time
    for path in calls_dir.glob("calls-*.txt"):
        for line in path.read_text().splitlines():
            step_key, attempt_text, at_text = line.split()
            _, task_text, _, position_text, _ = step_key.split("-", 4)
            calls.append((int(task_text), int(position_text), int(attempt_text), float(at_text)))
    rerun_later = rerun_zombie = 0
    for task_id, position, attempt, at in calls:
        committed = stored.get((task_id, position))
        if committed is None or at <= committed[2]:
            continue
        if attempt > committed[0]:
            rerun_later += 1
        elif attempt < committed[0]:
            rerun_zombie += 1
    # A commit by a worker that no longer held the task: the step stored by attempt a after any later
    # attempt of the task had already called a step (a later attempt exists only once the task was
    # taken over: its claim gave it a new token). What the unique (task, position) alone does not stop.
    first_call: dict[tuple[int, int], float] = {}  # (task, attempt) -> its first call
    for task_id, _, attempt, at in calls:
        first_call[(task_id, attempt)] = min(at, first_call.get((task_id, attempt), at))
    by_non_holder = sum(
        1
        for (task_id, _), (attempt, _, committed_at) in stored.items()
        if any(t == task_id and a > attempt and at < committed_at for (t, a), at in first_call.items())
    )
    keys = Counter((task_id, position) for task_id, position, _, _ in calls)
    repeated = sum(count - 1 for count in keys.values())
    statuses = Counter(Task.objects.filter(pk__in=ids).values_list("status", flat=True))
    lost = n_tasks - statuses.get("SUCCESSFUL", 0)
    stuck = statuses.get("RUNNING", 0)
    missing_steps = n_tasks * n_steps - len(stored)
    attempts = Counter(Task.objects.filter(pk__in=ids).values_list("attempts", flat=True))
    rejected = sum(log.read_text(errors="replace").count("outcome REJECTED (fencing)") for log in log_dir.glob("*.log"))
    print("")
    print(f"tasks x steps                            {n_tasks} x {n_steps}")
    print(f"step effects committed twice             {doubled}")
    print(f"steps re-run by a later attempt          {rerun_later} (after their commit)")
    print(f"steps committed by a non-holder          {by_non_holder} (after a later attempt began)")
    print(f"steps stored apart from their effect     {apart}")
    print(f"steps never stored                       {missing_steps}")
    print(f"tasks lost / stuck running               {lost} / {stuck}")
    print(f"zombie step runs after the commit        {rerun_zombie} (their commits refused, writes rolled back)")
    print(f"attempts refused by the fence (logs)     {rejected}")
    print(f"external calls / with a key seen before  {len(calls)} / {repeated} (the callee deduplicates these)")
    print(f"workers killed / paused / PG restarts    {len(chaos.kills)} / {chaos.pauses} / {chaos.restarts}")
    print(f"attempts per task                        {dict(sorted(attempts.items()))}")
    print(f"total time                               {total:.1f} s")
    failed = doubled or rerun_later or by_non_holder or apart or missing_steps or lost or stuck
    print("durable steps: " + ("FAILED" if failed else "passed: no step committed twice, none re-run after its commit"))
    return 1 if failed else 0


# -- overhead --------------------------------------------------------------------------------------------


def overhead(args: argparse.Namespace) -> int:
    from bench.common import figure

    n_tasks, n_steps = args.tasks or 1000, args.steps or 10
    log_dir = Path(tempfile.mkdtemp(prefix="leasing-durable-overhead-"))
    kinds = ["steps", "none", *(["dbos"] if args.dbos_python else [])]
    results: dict[tuple[int, str], float] = {}
    for processes in args.processes:
        for _ in range(2):  # interleaved, twice each; the best of two
            for kind in kinds:
                if kind == "dbos":
                    elapsed = dbos_run(args.dbos_python, processes, n_tasks, n_steps, log_dir)
                else:
                    elapsed = ours_run(processes, n_tasks, n_steps if kind == "steps" else 0, log_dir)
                results[(processes, kind)] = min(results.get((processes, kind), elapsed), elapsed)
    for processes in args.processes:
        with_steps, without = results[(processes, "steps")], results[(processes, "none")]
        figure(f"{processes} process(es): tasks of {n_steps} no-op steps", n_tasks * n_steps / with_steps, "steps/s")
        if "dbos" in kinds:
            figure(f"{processes} process(es): DBOS, workflows of {n_steps} no-op steps",
                   n_tasks * n_steps / results[(processes, "dbos")], "steps/s")  # fmt: skip
        figure(f"{processes} process(es): tasks of no step", n_tasks / without, "tasks/s")
        figure(f"{processes} process(es): time a step adds", (with_steps - without) / (n_tasks * n_steps) * 1e6, "us")
    return 0


def ours_run(processes: int, n_tasks: int, steps: int, log_dir: Path) -> float:
    """``processes`` workers of ``--concurrency 4``, from the enqueue of ``n_tasks`` to the last finish."""
    from django.db import connection

    from bench.common import stop_processes
    from tasks.models import Task
    from tasks.models import Worker as WorkerRow

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE tasks_task, tasks_taskstep, tasks_worker CASCADE")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = []
    for i in range(processes):
        log = open(log_dir / f"w{processes}-{i}.log", "ab")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [sys.executable, "manage.py", "run_worker", "--concurrency", "4", "--no-scheduler",
                 "--poll-interval", "0.2", "-v", "0"],
                cwd=Path(__file__).resolve().parents[1], env=env, stdout=log, stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        log.close()
    try:
        deadline = time.monotonic() + 60
        while WorkerRow.objects.filter(stopped_at__isnull=True).count() < processes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not start; see {log_dir}")
            time.sleep(0.05)
        start = time.perf_counter()
        Task.objects.bulk_enqueue(NOOP_STEPS, ({"steps": steps} for _ in range(n_tasks)))
        while Task.objects.unfinished().exists():
            time.sleep(0.01)
        elapsed = time.perf_counter() - start
    finally:
        stop_processes(procs)
    done = Task.objects.filter(status="SUCCESSFUL", attempts=1).count()
    if done != n_tasks:
        raise RuntimeError(f"only {done} of {n_tasks} tasks succeeded at their first attempt; see {log_dir}")
    return elapsed


def dbos_run(python: str, processes: int, n_tasks: int, n_steps: int, log_dir: Path) -> float:
    """DBOS's side: ``processes`` processes of 4 threads, from "go" to the last one's "done"."""
    import psycopg
    from django.db import connection

    params = connection.get_connection_params()
    name = f"dbos_bench_{os.getpid()}"
    info = " ".join(f"{k}={params[k]}" for k in ("host", "port", "user", "password") if params.get(k))
    with psycopg.connect(info + " dbname=postgres", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    query = "&".join(f"{k}={params[k]}" for k in ("host", "port") if params.get(k))
    url = f"postgresql+psycopg://{params.get('user', 'postgres')}@/{name}?{query}"
    script = str(Path(__file__).resolve().parent / "peer_dbos_steps.py")
    procs = []
    for i in range(processes):
        log = open(log_dir / f"dbos{processes}-{i}.log", "ab")  # noqa: SIM115
        count = n_tasks // processes + (1 if i < n_tasks % processes else 0)
        procs.append(
            subprocess.Popen(
                [python, script, url, "--workflows", str(count), "--steps", str(n_steps), "--threads", "4"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            )
        )  # fmt: skip
        log.close()
        if i == 0:  # the first one creates the system database
            assert procs[0].stdout and procs[0].stdout.readline().strip() == "ready", f"see {log_dir}"
    for proc in procs[1:]:
        assert proc.stdout and proc.stdout.readline().strip() == "ready", f"see {log_dir}"
    start = time.perf_counter()
    for proc in procs:
        assert proc.stdin
        proc.stdin.write("go\n")
        proc.stdin.flush()
    for proc in procs:
        assert proc.stdout and proc.stdout.readline().strip() == "done", f"see {log_dir}"
    elapsed = time.perf_counter() - start
    for proc in procs:
        proc.wait(60)
    return elapsed


if __name__ == "__main__":
    sys.exit(main())
