#!/usr/bin/env python
"""Sustained load against the peers (issue 59): one worker process per system under a fixed offered
rate, held step after step up a ladder until the system falls behind; pickup latency, completions,
dead tuples and CPU all along. bench/compare.py measures short drains (a batch enqueued at once); this
is what a long-horizon harness sees instead.

    python3 -m venv .venv-bench && .venv-bench/bin/pip install -e '.[embedded]' -r bench/requirements.txt
    .venv-bench/bin/python bench/sustained.py [--systems django-leasing,graphile-worker,awa,awa-50,PgQueuer]
        [--rates 500,1000,2000,3000,4000,5000,6000] [--step-minutes 10] [--concurrency 16] [--out /tmp/sustained]
    (``django-leasing-async``: this project's jobs as coroutines on the worker's event loop, not a default system)
    .venv-bench/bin/python bench/sustained.py --replot /tmp/sustained --plot docs/explanation/sustained.svg

Each step, for each system still climbing (the systems take turns at each rate, one at a time on the one
server: the embedded PostgreSQL, or DATABASE_URL): the system's queue is emptied (bench/peers.py's
reset: TRUNCATE, or awa's queue-storage reset, so each step starts as a fresh install does, planner
statistics included), one worker process starts (bench/peers.py's ``sustained`` workload) at ``--concurrency`` jobs at
once, each job working 1 ms (this project: ``time.sleep(0.001)`` in a sync handler on its executor
threads, its default claim of 4 a thread; the async peers: ``await asyncio.sleep(0.001)``; graphile-worker:
a 1 ms timer, bench/graphile/worker.mjs's settings). Maintenance runs as each ships it: this project's worker runs
the recovery controller and the scheduler in its process (``manage.py run_worker``'s default, the
README's systemd unit; the recovery leader's duties, retention included, with it); graphile-worker,
awa and PgQueuer run whatever their worker runs by default.

A producer thread in the harness enqueues at the step's rate through the system's own bulk API, in
batches of up to 128: every ``--tick-ms`` it adds as many jobs as are due since the step began on a
monotonic clock (no drift), each job carrying its enqueue wall-clock time. Each handler reports
``time.time() - enqueued_at`` at its start and its end over UDP (bench/pickup.py; nothing touches the
measured database), gathered and flushed by the worker every 0.1 s. Every second the harness records
jobs enqueued and ended and the pickup latencies; every 5 s, from the system's own tables, its
backlog (unfinished jobs, counted up to 200,000) and the dead tuples and size of its tables
(``pg_stat_user_tables``).

A step holds for ``--step-minutes``. The system falls behind, and climbs no further, when it
completed fewer than 98 % of the jobs offered over the step, or its backlog (enqueued - ended) grew by
more than a second of offered load over the step's second half. Afterwards each system that held a
rate runs one more step at 80 % of the highest rate it held (its p99 there is the figure to quote).
Per step: offered/s, completed/s, backlog at the end (the harness's count and the tables'), pickup
p50/p95/p99, the most dead tuples of the system's tables and their size at the end, the worker's and
the server's CPU per 1,000 jobs. Under ``--out``: series.jsonl (a row a second per system),
steps.jsonl, summary.md and sustained.svg (completion rate, p99 pickup and dead tuples over time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import stop_processes  # noqa: E402
from bench.compare import cpu_split, cpu_times, server_pids, start_workers, versions  # noqa: E402
from bench.peers import (  # noqa: E402
    AWA_UNCLAIMED,
    QUEUE,
    SYSTEMS,
    Add,
    install_awa,
    install_graphile,
    install_pgqueuer,
    setup_django,
)
from bench.pickup import Listener  # noqa: E402

DEFAULT_SYSTEMS = "django-leasing,graphile-worker,awa,awa-50,PgQueuer"
DEFAULT_RATES = "500,1000,2000,3000,4000,5000,6000"
MAX_BATCH = 128
KEEP_UP = 0.98
SAMPLE_EVERY = 1.0
TABLES_EVERY = 5.0
BACKLOG_CAP = 200_000

#: Each system's rows of pg_stat_user_tables (its dead tuples and the size of its tables).
TABLES = {
    "django-leasing": "schemaname = 'public' AND (relname LIKE 'tasks\\_%' OR relname LIKE 'leasing\\_%')",
    "graphile-worker": "schemaname = 'graphile_worker'",
    "awa": "schemaname LIKE 'awa%'",
    "awa-50": "schemaname LIKE 'awa%'",
    "PgQueuer": "schemaname = 'public' AND relname LIKE 'pgqueuer%'",
}
#: Each system's unfinished jobs, from its own tables: index reads, capped (a count of a large backlog
#: every 5 s would charge the server to the system); awa: its claim signal (enqueued ahead of claimed)
#: plus its running leases.
BACKLOG = {
    "django-leasing": (
        "SELECT count(*) FROM (SELECT 1 FROM tasks_task WHERE queue = %(queue)s AND status IN ('READY', 'RUNNING') "
        "LIMIT %(cap)s) AS backlog"
    ),
    "graphile-worker": "SELECT count(*) FROM (SELECT 1 FROM graphile_worker._private_jobs LIMIT %(cap)s) AS backlog",
    "awa": (
        f"SELECT ({AWA_UNCLAIMED}) + (SELECT count(*) FROM awa.leases WHERE queue = %(queue)s AND state = 'running')"
    ),
    "PgQueuer": "SELECT count(*) FROM (SELECT 1 FROM pgqueuer LIMIT %(cap)s) AS backlog",
}
BACKLOG["awa-50"] = BACKLOG["awa"]
# The same tables, the jobs as coroutines on the event loop (bench/peers.py's ours_async).
TABLES["django-leasing-async"] = TABLES["django-leasing"]
BACKLOG["django-leasing-async"] = BACKLOG["django-leasing"]
TABLES_SQL = """
SELECT COALESCE(sum(n_dead_tup), 0), COALESCE(sum(pg_total_relation_size(relid)), 0)
FROM pg_stat_user_tables WHERE {where}
"""


@dataclass
class Producer:
    """Adds ``rate`` jobs a second through ``open()``'s ``add``: every ``tick`` seconds, what is due
    since the start on the monotonic clock, in batches of up to MAX_BATCH."""

    open: Callable[[], AbstractContextManager[Add]]
    rate: float
    tick: float
    enqueued: int = 0
    started: float = 0.0
    ready: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.open() as add:
                self.started = time.monotonic()
                self.ready.set()
                while not self.stop.is_set():
                    due = int((time.monotonic() - self.started) * self.rate) - self.enqueued
                    while due > 0 and not self.stop.is_set():
                        batch = min(due, MAX_BATCH)
                        add(batch, time.time())
                        self.enqueued += batch
                        due -= batch
                    self.stop.wait(self.tick)
        except BaseException as error:
            self.error = error
            self.ready.set()


@dataclass
class Step:
    system: str
    label: str  # "ladder", or "80%" (of the highest rate held)
    target: float
    seconds: float = 0.0
    enqueued: int = 0
    completed: int = 0
    backlog_end: int = 0
    backlog_tables_end: int = 0
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    dead_tuples_max: int = 0
    table_bytes_end: int = 0
    worker_cpu_ms_per_1k: float | None = None
    server_cpu_ms_per_1k: float | None = None
    harness_cpu_ms_per_1k: float | None = None
    #: The machine's 1-minute load average at the step's end (another run beside this one shows here).
    load: float = 0.0
    behind: bool = False
    why: str = ""

    @property
    def offered(self) -> float:
        return self.enqueued / self.seconds if self.seconds else 0.0

    @property
    def done(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0


def percentile(ordered: Sequence[float], q: float) -> float | None:
    if not ordered:
        return None
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


class Probe:
    """The cheap reads of a system's tables, on a connection of the harness's own."""

    def __init__(self, name: str) -> None:
        import psycopg

        from bench.common import psycopg_params

        self.connection = psycopg.connect(**psycopg_params(), autocommit=True)
        self.backlog_sql = BACKLOG[name]
        self.tables_sql = TABLES_SQL.format(where=TABLES[name])

    def read(self) -> tuple[int, int, int]:
        """(unfinished jobs, dead tuples, bytes) of the system now."""
        backlog = self.connection.execute(self.backlog_sql, {"queue": QUEUE, "cap": BACKLOG_CAP}, prepare=True)
        (unfinished,) = backlog.fetchone() or (0,)
        dead, size = self.connection.execute(self.tables_sql, prepare=True).fetchone() or (0, 0)
        return int(unfinished), int(dead), int(size)

    def close(self) -> None:
        self.connection.close()


def harness_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_step(
    step: Step, seconds: float, listener: Listener, args: Any, series: TextIO, offset: float, log_dir: Path
) -> Step:
    """One step of one system (see the module's docstring); writes its rows to ``series``, ``offset``
    seconds into the system's measured time."""
    system = SYSTEMS[step.system]()
    assert system.sustained_producer is not None
    system.reset()
    procs = start_workers(step.system, 1, log_dir, args.concurrency, "sustained")
    probe = Probe(step.system)
    producer = Producer(system.sustained_producer, step.target, args.tick_ms / 1000)
    thread = threading.Thread(target=producer.run, name="producer", daemon=True)
    try:
        pids = [proc.pid for proc in procs]
        listener.take()  # whatever an earlier step's worker sent late
        before = cpu_times([*pids, *server_pids()])
        harness_before = harness_cpu()
        thread.start()
        producer.ready.wait()
        if producer.error is not None:
            raise producer.error
        started = producer.started
        latencies: array[float] = array("f")
        backlog_at: list[tuple[float, int]] = []
        next_sample, next_tables = started + SAMPLE_EVERY, started
        enqueued_before = 0
        while True:
            now = time.monotonic()
            wake = min(next_sample, next_tables, started + seconds)
            if wake > now:
                time.sleep(wake - now)
                continue
            if producer.error is not None:
                raise producer.error
            row: dict[str, Any] = {"system": step.system, "label": step.label, "target": step.target}
            at = min(now, started + seconds) - started
            row["t"] = round(offset + at, 3)
            if now >= next_tables:
                backlog_tables, dead, size = probe.read()
                step.dead_tuples_max = max(step.dead_tuples_max, dead)
                row.update(backlog_tables=backlog_tables, dead_tuples=dead, table_bytes=size)
                next_tables += TABLES_EVERY
            if now >= next_sample or now >= started + seconds:
                ends, arrived = listener.take()
                enqueued = producer.enqueued
                step.completed += ends
                latencies.extend(arrived)
                ordered = sorted(arrived)
                row.update(
                    enqueued=enqueued - enqueued_before,
                    completed=ends,
                    backlog=enqueued - step.completed,
                    p50_ms=percentile(ordered, 0.5),
                    p99_ms=percentile(ordered, 0.99),
                )
                backlog_at.append((at, enqueued - step.completed))
                enqueued_before = enqueued
                next_sample += SAMPLE_EVERY
            series.write(json.dumps(row) + "\n")
            if now >= started + seconds:
                break
        step.seconds = seconds
        step.enqueued = producer.enqueued
        cpu = cpu_split(pids, before)
        harness = harness_cpu() - harness_before
        producer.stop.set()
        thread.join()
        step.backlog_tables_end, dead, step.table_bytes_end = probe.read()
        step.dead_tuples_max = max(step.dead_tuples_max, dead)
        step.backlog_end = step.enqueued - step.completed
        ordered = sorted(latencies)
        step.p50_ms, step.p95_ms, step.p99_ms = (percentile(ordered, q) for q in (0.5, 0.95, 0.99))
        if step.completed:
            per_1k = 1000 * 1000 / step.completed
            step.worker_cpu_ms_per_1k = cpu["workers"] * per_1k
            step.server_cpu_ms_per_1k = cpu["postgres"] * per_1k
            step.harness_cpu_ms_per_1k = harness * per_1k
        step.load = os.getloadavg()[0]
        judge(step, backlog_at, seconds)
        series.flush()
        return step
    finally:
        producer.stop.set()
        if thread.is_alive():
            thread.join()
        probe.close()
        stop_processes(procs)


def judge(step: Step, backlog_at: list[tuple[float, int]], seconds: float) -> None:
    """Behind: fewer than KEEP_UP of the offered jobs completed, or the backlog grew by more than a
    second of the offered load over the step's second half; the ladder cannot go on either when the
    producer itself fell short of the rate (the harness, not the system, was the limit)."""
    half = [backlog for at, backlog in backlog_at if at <= seconds / 2]
    grown = step.backlog_end - (half[-1] if half else 0)
    reasons = []
    if step.enqueued < KEEP_UP * step.target * seconds:
        reasons.append(f"producer short ({step.offered:,.0f}/s)")
    if step.completed < KEEP_UP * step.enqueued:
        reasons.append(f"completed {step.completed / max(step.enqueued, 1):.1%}")
    if grown > step.target:
        reasons.append(f"backlog +{grown:,} in the second half")
    step.behind = bool(reasons)
    step.why = ", ".join(reasons)


def ladder(text: str) -> list[float]:
    """``500,1000,2000`` as given, or ``500*2``: 500, 1000, 2000, ... (12 steps at most)."""
    if "*" in text:
        start, factor = (float(part) for part in text.split("*", 1))
        return [start * factor**index for index in range(12)]
    return [float(part) for part in text.split(",")]


def step_line(step: Step) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:,.1f}"

    cpu = ""
    if step.worker_cpu_ms_per_1k is not None and step.server_cpu_ms_per_1k is not None:
        worker, server = step.worker_cpu_ms_per_1k, step.server_cpu_ms_per_1k
        cpu = f"  [CPU per 1,000: worker {worker:.0f} ms, postgres {server:.0f} ms]"
    return (
        f"sustained.{step.system}.{step.label}.rate={step.target:.0f}  offered {step.offered:,.0f}/s "
        f"completed {step.done:,.0f}/s backlog {step.backlog_end:,} (tables {step.backlog_tables_end:,}) "
        f"pickup p50/p95/p99 {ms(step.p50_ms)}/{ms(step.p95_ms)}/{ms(step.p99_ms)} ms "
        f"dead {step.dead_tuples_max:,} size {step.table_bytes_end / 2**20:,.1f} MB"
        f"{cpu} load {step.load:.1f}  {'BEHIND: ' + step.why if step.behind else 'held'}"
    )


def render(steps: list[Step], systems: list[str], args: Any) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:,.1f}"

    def cpu(value: float | None) -> str:
        return "n/a" if value is None else f"{value:,.0f}"

    lines = [
        f"One worker process per system, {args.concurrency} jobs at once, each job 1 ms of work; steps of "
        f"{args.step_minutes:g} minutes at a fixed offered rate (bulk batches of up to {MAX_BATCH}, every "
        f"{args.tick_ms:g} ms what is due); a system climbs until it falls behind (completed < 98 % of offered, "
        "or its backlog growing), then runs a step at 80 % of the highest rate it held. Pickup: from the "
        "enqueue to the handler's start. CPU per 1,000 jobs completed. Load: the machine's 1-minute load "
        "average at the step's end.",
        "",
        "| system | step | offered/s | completed/s | backlog at end (tables) | pickup p50 / p95 / p99 ms | "
        "most dead tuples | tables at end | worker CPU ms | postgres CPU ms | load | |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for step in steps:
        verdict = f"behind: {step.why}" if step.behind else "held"
        lines.append(
            f"| {step.system} | {step.label} {step.target:,.0f}/s | {step.offered:,.0f} | {step.done:,.0f} | "
            f"{step.backlog_end:,} ({step.backlog_tables_end:,}) | "
            f"{ms(step.p50_ms)} / {ms(step.p95_ms)} / {ms(step.p99_ms)} | {step.dead_tuples_max:,} | "
            f"{step.table_bytes_end / 2**20:,.1f} MB | {cpu(step.worker_cpu_ms_per_1k)} | "
            f"{cpu(step.server_cpu_ms_per_1k)} | {step.load:.1f} | {verdict} |"
        )
    lines += ["", "| system | highest rate held | p99 pickup at 80 % of it |", "| --- | ---: | ---: |"]
    for name in systems:
        held = highest_held(steps, name)
        at_80 = [s for s in steps if s.system == name and s.label == "80%"]
        p99 = ms(at_80[0].p99_ms) + " ms" if at_80 else "n/a"
        lines.append(f"| {name} | {'none' if held is None else f'{held:,.0f}/s'} | {p99} |")
    info = versions()
    lines += [
        "",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in info.items())
        + ".",
    ]
    return "\n".join(lines)


def highest_held(steps: list[Step], name: str) -> float | None:
    held = [s.target for s in steps if s.system == name and s.label == "ladder" and not s.behind]
    return max(held) if held else None


def plot(series_path: Path, svg_path: Path) -> None:
    """Completion rate, p99 pickup and dead tuples over each system's measured time, one line a system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[str, list[dict[str, Any]]] = {}
    for line in series_path.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["system"], []).append(row)
    figure, (rate_axis, p99_axis, dead_axis) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for index, (name, found) in enumerate(rows.items()):
        colour = f"C{index}"
        sampled = [row for row in found if "completed" in row]
        minutes = [row["t"] / 60 for row in sampled]
        rate_axis.plot(minutes, [row["completed"] / SAMPLE_EVERY for row in sampled], color=colour, lw=0.8, label=name)
        rate_axis.plot(minutes, [row["target"] for row in sampled], color=colour, lw=0.8, ls=":")
        with_p99 = [row for row in sampled if row["p99_ms"] is not None]
        p99_axis.plot([row["t"] / 60 for row in with_p99], [row["p99_ms"] for row in with_p99], color=colour, lw=0.8)
        tables = [row for row in found if "dead_tuples" in row]
        dead_axis.plot([row["t"] / 60 for row in tables], [row["dead_tuples"] for row in tables], color=colour, lw=0.8)
    rate_axis.set_ylabel("completed jobs/s (dotted: offered)")
    rate_axis.legend(loc="upper left", fontsize="small")
    p99_axis.set_ylabel("p99 pickup per second (ms)")
    p99_axis.set_yscale("log")
    dead_axis.set_ylabel("dead tuples of its tables")
    dead_axis.set_xlabel("minutes of load (each system's steps end to end)")
    for axis in (rate_axis, p99_axis, dead_axis):
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(svg_path)  # the format from the suffix (.svg for the docs)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, of {', '.join(TABLES)}")
    parser.add_argument("--rates", default=DEFAULT_RATES, help="offered jobs/s per step: 500,1000,2000 or 500*2")
    parser.add_argument("--step-minutes", type=float, default=10.0, help="how long each step holds its rate")
    parser.add_argument("--concurrency", type=int, default=16, help="jobs at once in each system's worker")
    parser.add_argument("--tick-ms", type=float, default=10.0, help="the producer adds what is due this often")
    parser.add_argument("--out", type=Path, help="directory for series.jsonl, steps.jsonl, summary.md, the plot")
    parser.add_argument("--plot", type=Path, help="the SVG plot's path (default: sustained.svg under --out)")
    parser.add_argument("--replot", type=Path, help="only draw the plot again from this --out directory")
    args = parser.parse_args()
    if args.replot:
        plot(args.replot / "series.jsonl", args.plot or args.replot / "sustained.svg")
        return
    systems = args.systems.split(",")
    unknown = set(systems) - set(TABLES)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    rates = ladder(args.rates)
    out = args.out or Path(os.environ.get("BENCH_LOGS", "/tmp")) / f"bench-sustained-{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)
    seconds = args.step_minutes * 60

    from bench.common import prepare_database

    server = prepare_database()  # also sets Django up
    setup_django()
    if "graphile-worker" in systems:
        install_graphile()
    if {"awa", "awa-50"} & set(systems):
        install_awa()
    if "PgQueuer" in systems:
        install_pgqueuer()
    listener = Listener()
    os.environ["BENCH_PICKUP"] = listener.address  # the workers' environment
    steps: list[Step] = []
    measured = dict.fromkeys(systems, 0.0)  # each system's seconds of load so far (the series' time)
    try:
        with open(out / "series.jsonl", "w") as series, open(out / "steps.jsonl", "w") as summary:

            def run(step: Step) -> Step:
                run_step(step, seconds, listener, args, series, measured[step.system], log_dir)
                measured[step.system] += seconds
                steps.append(step)
                summary.write(json.dumps({**asdict(step), "offered": step.offered, "done": step.done}) + "\n")
                summary.flush()
                print(step_line(step), flush=True)
                return step

            climbing = list(systems)
            for rate in rates:
                for name in list(climbing):
                    if run(Step(name, "ladder", rate)).behind:
                        climbing.remove(name)
                if not climbing:
                    break
            for name in systems:
                held = highest_held(steps, name)
                if held is not None:
                    run(Step(name, "80%", 0.8 * held))
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)
    table = render(steps, systems, args)
    (out / "summary.md").write_text(table + "\n")
    print("\n" + table)
    plot(out / "series.jsonl", args.plot or out / "sustained.svg")
    print(f"\nseries, steps, summary and plot under {out}")


if __name__ == "__main__":
    main()
