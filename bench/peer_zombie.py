#!/usr/bin/env python
"""Durable steps under faults, against the peers, each through its own API (issue 58).

    python bench/peer_zombie.py --peer dbos          # DBOS: the write in a datasource transaction
    python bench/peer_zombie.py --peer dbos-step     # DBOS: the write in a @DBOS.step (as the ORM would)
    python bench/peer_zombie.py --peer absurd        # django-absurd: the write in ctx.step(...)
    python bench/peer_zombie.py --peer dbos --tasks 1000 --seed 2
    python bench/peer_zombie.py --peer absurd --database-url "postgres://postgres@/postgres?host=/tmp/pgm&port=55432"

The scenario of ``bench/durable_steps.py faults``, run against a peer: a fresh database (the embedded
PostgreSQL 18, as durable_steps.py's ``Database``, or one made on ``--database-url``'s server), N
workflows of K steps, ``--workers`` worker processes of the peer (``--peer-python``, the environment
of bench/requirements.txt: bench/peer_zombie_dbos.py, bench/peer_zombie_absurd.py). The workflows
are enqueued as the workers drain them, at most ``--backlog`` waiting (Absurd claims a retry run
behind every run already waiting: with all N enqueued at once, a paused worker's task is taken over
only once the backlog has drained).
Each step writes an effect row in the user's database (table ``peer_effect``), sleeps ``--sleep``
seconds (one workflow in ten has a second step of 1-4 s), then calls the counting "external service"
(a line appended to a file) with a key built from the workflow's id and the step.

Every ``--chaos-every`` seconds, one fault, each by the peer's own recovery:

- **SIGKILL** of a worker, and a new one started. DBOS: the new process has the killed one's
  executor id, and recovers its PENDING workflows at launch. Absurd: the killed run's claim expires
  (``--claim-timeout``), a polling worker's claim fails it and a retry run is claimed.
- **SIGSTOP** of a worker, then SIGCONT: the zombie. DBOS: after ``--detect`` seconds (the
  supervisor's verdict "dead"), a replacement with the paused worker's executor id is launched and
  recovers its workflows; the paused one is woken once another process has begun one of its
  in-flight workflows (and not before 1.5 x ``--detect``). It then runs on beside its replacement.
  Absurd: paused 1.5 x the claim timeout, and until another worker has begun one of its in-flight
  tasks. The zombie wakes inside its step after another process took the work over.

Counted at the end, from the effect rows, the peer's checkpoints and the call log (what
durable_steps.py counts for ours): step effects committed twice (a (workflow, step) with two effect
rows); steps re-run by a later execution after their checkpoint committed (an execution that began
after the commit); step runs by an execution that began before the commit and called after it (the
zombie); external calls whose key was seen before; workflows lost or stuck; and whether the faults
landed: kills, pauses, paused workflows taken over during the pause, and those whose zombie ran on
after waking. The run exits non-zero if workflows are lost or stuck, or if no pause led to a
takeover (the scenario tested nothing); not because of what the peer allows (the findings).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import stop_processes  # noqa: E402
from bench.durable_steps import Database, _conninfo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TERMINAL = {
    "dbos": {"SUCCESS", "ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED"},
    "absurd": {"completed", "failed", "cancelled"},
}
DONE = {"dbos": "SUCCESS", "absurd": "completed"}


@dataclass
class Event:
    kind: str  # begin, call, end
    wf: int
    exec_id: str
    pid: int
    at: float
    key: str = ""
    step: int = -1


def read_events(log_dir: Path) -> list[Event]:
    events = []
    for path in log_dir.glob("events-*.txt"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if parts[0] == "call":
                _, key, wf, step, exec_id, pid, at = parts
                events.append(Event("call", int(wf), exec_id, int(pid), float(at), key, int(step)))
            elif len(parts) == 5:
                kind, wf, exec_id, pid, at = parts
                events.append(Event(kind, int(wf), exec_id, int(pid), float(at)))
    return events


@dataclass
class Pause:
    pid: int
    start: float
    end: float = 0.0
    in_flight: dict[int, str] = field(default_factory=dict)  # workflow -> the paused execution of it


class Peer:
    """The worker processes of one peer, their faults, and the reads of its tables."""

    def __init__(self, args: argparse.Namespace, conninfo: str, log_dir: Path) -> None:
        import psycopg

        self.args = args
        self.kind = "dbos" if args.peer.startswith("dbos") else "absurd"
        self.log_dir = log_dir
        self.app = psycopg.connect(conninfo, autocommit=True)
        params = self.app.info.get_parameters()
        host, port, user, dbname = params.get("host"), params.get("port"), params.get("user"), params["dbname"]
        self.sys_name = f"{dbname}_dbos_sys"
        query = "&".join(f"{k}={v}" for k, v in (("host", host), ("port", port)) if v)
        self.app_url = f"postgresql+psycopg://{user}@/{dbname}?{query}"
        self.sys_url = f"postgresql+psycopg://{user}@/{self.sys_name}?{query}"
        self.django_url = f"postgres://{user}@/{dbname}?{query}"
        self.sys_conninfo = f"{conninfo} dbname={self.sys_name}"
        self.sys: Any = None
        self.members: dict[str, subprocess.Popen[bytes]] = {}  # slot -> its current process
        self.zombies: list[subprocess.Popen[bytes]] = []  # woken DBOS processes whose slot was replaced
        self.others: list[subprocess.Popen[bytes]] = []  # the enqueue
        self.started = 0
        self.logs: dict[int, Path] = {}  # pid -> its output
        self.kills = 0
        self.pauses: list[Pause] = []

    # -- processes ------------------------------------------------------------------------------------

    def script(self) -> str:
        return str(ROOT / "bench" / ("peer_zombie_dbos.py" if self.kind == "dbos" else "peer_zombie_absurd.py"))

    def common(self) -> list[str]:
        a = self.args
        if self.kind == "dbos":
            urls = [self.app_url, self.sys_url]
            extra = ["--write", "step" if a.peer == "dbos-step" else "transaction"]
        else:
            urls, extra = [self.django_url], ["--claim-timeout", str(a.claim_timeout)]
        return [*urls, "--log-dir", str(self.log_dir), "--concurrency", str(a.concurrency), *extra]

    def feed(self, *extra: str) -> subprocess.Popen[bytes]:
        """The enqueue of the workflows, beside the workers (it keeps at most --backlog waiting)."""
        with open(self.log_dir / "enqueue.log", "ab") as log:
            proc = subprocess.Popen(
                [self.args.peer_python, self.script(), "enqueue", *self.common(), *extra],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.others.append(proc)
        return proc

    def run(self, command: str, *extra: str) -> None:
        """A one-off command of the peer's script (the schema, the enqueue), to its end."""
        with open(self.log_dir / f"{command}.log", "ab") as log:
            subprocess.run(
                [self.args.peer_python, self.script(), command, *self.common(), *extra],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=600,
            )  # fmt: skip

    def spawn(self, slot: str) -> subprocess.Popen[bytes]:
        """A worker process in ``slot`` (DBOS: the executor id), in place of the one there."""
        self.started += 1
        log = open(self.log_dir / f"{slot}-{self.started}.log", "ab")  # noqa: SIM115
        name = ["--executor-id", slot] if self.kind == "dbos" else ["--name", f"{slot}-{self.started}"]
        proc = subprocess.Popen(
            [self.args.peer_python, self.script(), "worker", *self.common(), *name],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
        log.close()
        self.members[slot] = proc
        self.logs[proc.pid] = self.log_dir / f"{slot}-{self.started}.log"
        return proc

    def wait_ready(self, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
        """DBOS prints "ready" once launched; django-absurd's worker "Started worker"."""
        word = "ready" if self.kind == "dbos" else "Started worker"
        deadline = time.monotonic() + timeout
        while word not in self.logs[proc.pid].read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"a worker did not start; see {self.log_dir}")
            time.sleep(0.1)

    def stop(self) -> None:
        procs = [*self.members.values(), *self.zombies, *self.others]
        stop_processes(procs, timeout=20)
        for proc in procs:
            proc.wait()  # reaped, killed or not

    # -- faults ---------------------------------------------------------------------------------------

    def strike(self, rng: random.Random) -> str:
        slot = rng.choice(sorted(self.members))
        proc = self.members[slot]
        if rng.random() < 0.5:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self.kills += 1
            self.spawn(slot)  # DBOS: the same executor id, which recovers its PENDING workflows at launch
            return f"SIGKILL {slot} (pid {proc.pid}), restarted"
        pause = Pause(proc.pid, time.time())
        proc.send_signal(signal.SIGSTOP)
        pause.in_flight = in_flight(read_events(self.log_dir), proc.pid)
        self.pauses.append(pause)
        if self.kind == "dbos":
            timeout = self.args.detect
            time.sleep(timeout)  # the supervisor's liveness timeout: only then is the worker declared dead
            self.spawn(slot)  # its replacement, same executor id: recovers the paused one's workflows
            self.zombies.append(proc)
        else:
            timeout = self.args.claim_timeout
        # Woken once another process has begun one of its in-flight workflows (not before 1.5 x the
        # timeout; at most --pause-max seconds): it wakes inside its step, after the takeover.
        earliest, deadline = pause.start + 1.5 * timeout, time.monotonic() + self.args.pause_max
        while time.time() < earliest or (pause.in_flight and not self.taken_over(pause)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        pause.end = time.time()  # before the SIGCONT: what the zombie does once woken comes after it
        proc.send_signal(signal.SIGCONT)
        return (
            f"SIGSTOP {slot} (pid {proc.pid}) for {pause.end - pause.start:.1f}s, {len(pause.in_flight)} in flight,"
            f" {len(self.taken_over(pause))} taken over"
        )

    def taken_over(self, pause: Pause) -> set[int]:
        return {
            e.wf
            for e in read_events(self.log_dir)
            if e.kind == "begin" and e.pid != pause.pid and e.wf in pause.in_flight and e.at > pause.start
            and (not pause.end or e.at < pause.end)
        }  # fmt: skip

    # -- the peer's tables ----------------------------------------------------------------------------

    def statuses(self) -> Counter[str]:
        if self.kind == "dbos":
            if self.sys is None:
                import psycopg

                self.sys = psycopg.connect(self.sys_conninfo, autocommit=True)
            rows = self.sys.execute(
                "SELECT status, count(*) FROM dbos.workflow_status WHERE workflow_uuid LIKE 'wf-%' GROUP BY status"
            ).fetchall()
        else:
            rows = self.app.execute("SELECT state, count(*) FROM absurd.t_default GROUP BY state").fetchall()
        return Counter({status: count for status, count in rows})

    def unfinished(self, n: int) -> int:
        return n - sum(count for status, count in self.statuses().items() if status in TERMINAL[self.kind])

    def commits(self) -> dict[tuple[int, int], float]:
        """(workflow, step) -> when the step's checkpoint committed (epoch seconds)."""
        if self.kind == "dbos":
            rows = self.sys.execute(
                "SELECT workflow_uuid, function_id, completed_at_epoch_ms FROM dbos.operation_outputs"
                " WHERE workflow_uuid LIKE 'wf-%%' AND function_name LIKE %s ORDER BY workflow_uuid, function_id",
                ("%external_call" if self.args.peer == "dbos" else "%write_and_call",),
            ).fetchall()
            commits, seen = {}, Counter[int]()
            for workflow, _, at in rows:
                wf = int(workflow.removeprefix("wf-"))
                commits[(wf, seen[wf])] = at / 1000 + 0.001  # the time its function returned, in whole ms
                seen[wf] += 1
            return commits
        rows = self.app.execute(
            "SELECT (t.params->'kwargs'->>'wf')::int, c.checkpoint_name, extract(epoch FROM c.updated_at)::float8"
            " FROM absurd.c_default c JOIN absurd.t_default t USING (task_id)"
        ).fetchall()
        return {(wf, int(name.removeprefix("part-"))): at for wf, name, at in rows}


def in_flight(events: list[Event], pid: int) -> dict[int, str]:
    """The workflows ``pid`` has begun and not ended, and that no other process has begun since: each
    with the id of ``pid``'s execution of it."""
    last: dict[int, Event] = {}  # workflow -> pid's last begin of it
    for e in events:
        if e.pid == pid and e.kind == "begin" and (e.wf not in last or e.at > last[e.wf].at):
            last[e.wf] = e
    done = {e.wf for e in events if e.pid == pid and e.kind == "end"}
    done |= {e.wf for e in events if e.pid != pid and e.kind == "begin" and e.wf in last and e.at > last[e.wf].at}
    return {wf: e.exec_id for wf, e in last.items() if wf not in done}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", choices=["dbos", "dbos-step", "absurd"], required=True)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2, help="workflows a worker runs at once")
    parser.add_argument("--sleep", type=float, nargs=2, default=[0.1, 0.5], help="a step's sleep, seconds")
    parser.add_argument("--backlog", type=int, default=8, help="workflows kept waiting in the queue (0: all at once)")
    parser.add_argument("--claim-timeout", type=int, default=2, help="absurd: the claim timeout, seconds")
    parser.add_argument("--detect", type=float, default=2.0, help="dbos: seconds before a paused worker is replaced")
    parser.add_argument("--pause-max", type=float, default=120.0, help="the longest a pause waits for a takeover")
    parser.add_argument("--chaos-every", type=float, default=1.0, help="seconds between two faults")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--database-url", default=None, help="a server to make the benchmark's database on")
    parser.add_argument("--peer-python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    args = parser.parse_args()
    # Database.discard closes Django's connections (none are opened here): settings it can read.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    database = Database(args.database_url, None)
    os.environ.setdefault("DATABASE_URL", database.url)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))
    try:
        return run(args, database)
    finally:
        if database.created is not None:  # on --database-url's server: DBOS's system database too
            import psycopg

            url, name = database.created
            with psycopg.connect(_conninfo(url), autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {name}_dbos_sys WITH (FORCE)")
        database.discard()


def run(args: argparse.Namespace, database: Database) -> int:
    rng = random.Random(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="peer-zombie-"))
    peer = Peer(args, _conninfo(database.url), log_dir)
    try:
        return run_peer(args, peer, rng, log_dir)
    finally:
        peer.app.close()
        if peer.sys is not None:
            peer.sys.close()


def run_peer(args: argparse.Namespace, peer: Peer, rng: random.Random, log_dir: Path) -> int:
    peer.app.execute(
        "CREATE TABLE peer_effect (id bigserial PRIMARY KEY, wf int NOT NULL, step int NOT NULL, exec text NOT NULL,"
        " pid int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )
    server = peer.app.info.server_version
    print(
        f"{args.peer} under faults: {args.tasks} workflows x {args.steps} steps, {args.workers} workers of"
        f" concurrency {args.concurrency}, PostgreSQL {server // 10000}; logs in {log_dir}",
        flush=True,
    )
    n = args.tasks
    seed = ["--seed", str(args.seed)] if args.seed is not None else []
    enqueue = ["--workflows", str(n), "--steps", str(args.steps), "--sleep", *map(str, args.sleep)]
    enqueue += ["--backlog", str(args.backlog), *seed]
    started = time.monotonic()
    try:
        if peer.kind == "absurd":
            peer.run("migrate")
        first = peer.spawn("w1")  # DBOS: the first one creates the system database
        peer.wait_ready(first)
        rest = [peer.spawn(f"w{i}") for i in range(2, args.workers + 1)]
        for proc in rest:
            peer.wait_ready(proc)
        feeder = peer.feed(*enqueue)
        started = time.monotonic()
        next_chaos = time.monotonic() + args.chaos_every
        progress, progress_at = n, time.monotonic()
        while (unfinished := peer.unfinished(n)) > 0:
            now = time.monotonic()
            if unfinished < progress:
                progress, progress_at = unfinished, now
            if now - started > args.timeout or now - progress_at > 120:
                print(f"{args.peer}: TIMEOUT with {unfinished} unfinished workflows", flush=True)
                break
            for slot, proc in list(peer.members.items()):
                if proc.poll() is not None:  # died on its own: a supervisor restarts it
                    print(f"{slot} exited ({proc.returncode}), restarted", flush=True)
                    peer.spawn(slot)
            if feeder.poll() not in (None, 0):
                raise RuntimeError(f"the enqueue failed; see {log_dir}/enqueue.log")
            if now >= next_chaos:
                print(peer.strike(rng), flush=True)
                next_chaos = time.monotonic() + args.chaos_every
            time.sleep(0.1)
        total = time.monotonic() - started
    finally:
        peer.stop()
    return verdict(args, peer, log_dir, total)


def verdict(args: argparse.Namespace, peer: Peer, log_dir: Path, total: float) -> int:
    n, k = args.tasks, args.steps
    events = read_events(log_dir)
    effects: dict[tuple[int, int], int] = Counter()
    for wf, step in peer.app.execute("SELECT wf, step FROM peer_effect").fetchall():
        effects[(wf, step)] += 1
    doubled = sum(1 for count in effects.values() if count > 1)
    statuses = peer.statuses()
    done = statuses.get(DONE[peer.kind], 0)
    no_effect = sum(1 for wf in range(n) for step in range(k) if (wf, step) not in effects)
    commits = peer.commits()
    began: dict[tuple[int, str], float] = {}
    for e in events:
        if e.kind == "begin":
            began[(e.wf, e.exec_id)] = min(e.at, began.get((e.wf, e.exec_id), e.at))
    calls = [e for e in events if e.kind == "call"]
    rerun_later = rerun_zombie = 0
    for e in calls:
        committed = commits.get((e.wf, e.step))
        if committed is None or e.at <= committed:
            continue
        if began.get((e.wf, e.exec_id), 0.0) > committed:
            rerun_later += 1  # an execution that began after the commit ran the step again: no replay
        else:
            rerun_zombie += 1  # one that began before it (the zombie) finished the step after it
    keys = Counter(e.key for e in calls)
    repeated = sum(count - 1 for count in keys.values())
    executions = Counter(len({e.exec_id for e in events if e.kind == "begin" and e.wf == wf}) for wf in range(n))
    taken_over = woke = zombie_effects = 0
    for pause in peer.pauses:
        over = peer.taken_over(pause)
        taken_over += len(over)
        late = {e.exec_id for e in events if e.kind == "call" and e.at > pause.end}
        woke += sum(1 for wf in over if pause.in_flight[wf] in late)
        if over:
            row = peer.app.execute(
                "SELECT count(*) FROM peer_effect WHERE exec = ANY(%s) AND at > to_timestamp(%s)",
                ([pause.in_flight[wf] for wf in over], pause.end),
            ).fetchone()
            zombie_effects += row[0] if row else 0
    lost = n - done
    stuck = sum(count for status, count in statuses.items() if status not in TERMINAL[peer.kind])
    print("")
    print(f"workflows x steps                        {n} x {k}")
    print(f"step effects committed twice             {doubled}")
    print(f"steps re-run by a later execution        {rerun_later} (after their commit)")
    print(f"steps with no effect                     {no_effect}")
    print(f"workflows lost / stuck                   {lost} / {stuck} ({dict(sorted(statuses.items()))})")
    print(f"zombie step runs after the commit        {rerun_zombie}")
    print(f"external calls / with a key seen before  {len(calls)} / {repeated}")
    print(f"workers killed / paused                  {peer.kills} / {len(peer.pauses)}")
    print(f"workflows taken over during a pause      {taken_over} (their zombie woken after the takeover)")
    print(f"  of which the zombie called after waking  {woke} (and wrote {zombie_effects} effect rows)")
    print(f"executions per workflow                  {dict(sorted(executions.items()))}")
    print(f"total time                               {total:.1f} s")
    broken = lost or stuck or (peer.pauses and not taken_over)
    print(f"{args.peer}: " + ("BROKEN RUN" if broken else "run complete (the counts above are the findings)"))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
