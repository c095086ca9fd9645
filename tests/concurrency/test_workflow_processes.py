"""Workflows with real worker processes that are SIGKILLed and SIGSTOPped throughout: a group's
callback runs once, after every member's final state on the database clock; a chain runs its steps in
order and stops at a step that fails for good; a dependency graph starts no task before all of its
parents succeeded (tasks/lifecycle/workflows.py)."""

from __future__ import annotations

import itertools
import random
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.db.models import Min

from tasks.models import Task, Worker, Workflow
from tasks.workflows import Workflow as Flow
from tasks.workflows import chain, group, step
from tests.helpers import start_manage, stop_process, wait_until, wait_while_moving
from tests.testapp.models import Effect, Once

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

H = "tests.testapp.workflow_handlers."
FAST = ["--ttl", "1", "--recovery-interval", "0.2", "--poll-interval", "0.2", "-v", "2"]
#: A workflow that moved nothing (no member's state, no start) for this many seconds is stuck.
STALL = 120.0


def starts() -> int:
    """Every start of a task's attempt so far (the handlers mark each: tests.testapp.workflow_handlers)."""
    return Effect.objects.filter(phase="started").count()


class Chaos:
    """Worker processes under fire: after every ``every`` starts of a task and about ``pause``
    seconds, one of them (chosen at random) is SIGKILLed and started again, twice, then one is
    SIGSTOPped for longer than its lease and continued, and so on until :meth:`stop`. Paced by the
    work, not the clock alone: on a loaded machine, where a restarted worker takes seconds to come
    up, a strike every half second kept the workers from running at all."""

    def __init__(self, logs: Path, names: list[str], seed: int, pause: float = 0.5, every: int = 12) -> None:
        self.logs = logs
        self.every = every
        self.names = names
        self.random = random.Random(seed)
        self.pause = pause
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.kills = self.stops = 0
        self.starts = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start_worker(self, name: str) -> None:
        self.starts += 1
        log = self.logs / f"{name}-{self.starts}.log"
        self.procs[name] = start_manage(log, "run_worker", "--worker-id", name, *FAST)

    def __enter__(self) -> Chaos:
        for name in self.names:
            self.start_worker(name)
        for name in self.names:
            registered = Worker.objects.filter(name=name)
            wait_until(registered.exists, 30, what=f"{name} up")
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._strike()
        finally:
            connection.close()  # this thread's own

    def _moved(self, since: int) -> bool:
        """Wait until the work has made ``every`` more starts; False once stopped."""
        while starts() < since + self.every:
            if self._stopped.wait(0.1):
                return False
        return True

    def _strike(self) -> None:
        round = 0
        since = starts()
        while self._moved(since) and not self._stopped.wait(self.pause * (0.5 + self.random.random())):
            since = starts()
            name = self.random.choice(self.names)
            proc = self.procs[name]
            round += 1
            if round % 3:  # two kills, then a stop
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                self.kills += 1
                self.start_worker(name)
            else:
                proc.send_signal(signal.SIGSTOP)
                self.stops += 1
                if self._stopped.wait(2.5):  # past the 1 s lease: its tasks are recovered meanwhile
                    proc.send_signal(signal.SIGCONT)
                    return
                proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(10)

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for proc in self.procs.values():
            stop_process(proc)


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    return tmp_path


def wait_for_end(workflow_id: int) -> Workflow:
    def ended() -> bool:
        return not Workflow.objects.filter(pk=workflow_id, status="RUNNING").exists()

    def moved() -> tuple[int, int]:
        return Workflow.objects.get(pk=workflow_id).remaining, starts()

    wait_while_moving(ended, moved, STALL, what=f"workflow {workflow_id} to end")
    return Workflow.objects.get(pk=workflow_id)


def starts_of(ids: list[int]) -> dict[int, Any]:
    """Each task's first start, on the database clock."""
    rows = Effect.objects.filter(task_id__in=ids, phase="started").values("task_id").annotate(first=Min("created_at"))
    return {row["task_id"]: row["first"] for row in rows}


#: A group's size: 400 members take about 30 strikes of the chaos (1,000 took 80-250 s a seed
#: on a loaded two-core machine and proved nothing more: the callback's release is one row's
#: count reaching zero, whatever the count).
MEMBERS = 400


@pytest.mark.parametrize("seed", [11, 23])
def test_a_callback_runs_once_after_four_hundred_members_under_kills_and_stops(logs: Path, seed: int) -> None:
    members = [
        step(H + "member", n=n, seed=seed, fail_every=97, work=0.08).options(max_attempts=3) for n in range(MEMBERS)
    ]
    done = group(members, then=step(H + "callback", key=f"group-{seed}"), on_failure="run").enqueue()
    with Chaos(logs, ["wf-a", "wf-b", "wf-c"], seed) as chaos:
        ended = wait_for_end(done.id)
    assert chaos.kills >= 2 and chaos.stops >= 1, "the workers were not disturbed"
    rows = {t.id: t for t in Task.objects.filter(workflow_id=done.id)}
    assert done.callback_id is not None
    callback = rows.pop(done.callback_id)
    statuses = [t.status for t in rows.values()]
    assert len(statuses) == MEMBERS and set(statuses) <= {"SUCCESSFUL", "FAILED"}
    assert statuses.count("FAILED") >= MEMBERS // 97  # every 97th fails for good, some flaky ones ran out
    # The callback's effect happened once, and it found every member final.
    (once,) = Once.objects.filter(key=f"group-{seed}")
    assert once.value == {s: statuses.count(s) for s in set(statuses)}
    assert callback.status == "SUCCESSFUL"
    runs = Effect.objects.filter(task_id=callback.id, phase="started").count()
    assert once.runs == Effect.objects.filter(task_id=callback.id, phase="ended").count() >= 1
    # Every start of the callback came after the last member's final state (one clock).
    last_member = max(t.finished_at for t in rows.values() if t.finished_at)
    first_callback = Effect.objects.filter(task_id=callback.id).aggregate(first=Min("created_at"))["first"]
    assert first_callback > last_member
    assert ended.finished_at and callback.finished_at and ended.finished_at >= callback.finished_at
    failed = statuses.count("FAILED")
    assert (ended.status, ended.remaining, ended.failed, ended.total) == ("FAILED", 0, failed, MEMBERS + 1)
    # Released once: the callback's row went AWAITING -> READY once, and ran one attempt per start
    # (a rerun only after its own worker died under it). An attempt handed to the executors when its
    # worker was killed is charged as a crash whether or not it had begun (it may have run: issue 38),
    # so the charged attempts are the runs plus at most the crashes.
    crashes = callback.crashes + callback.shared_crashes
    assert runs <= callback.attempts <= runs + crashes, (runs, callback.attempts, crashes)
    assert runs <= 1 + crashes + callback.unstarted_returns


def test_a_chain_of_fifty_runs_in_order_across_kills_and_stops_at_a_failure(logs: Path) -> None:
    # 41 steps start (the 41st fails for good): a strike every 5 starts, eight at the least.
    steps = [step(H + "link", i, fail_at=40, work=0.1).options(max_attempts=2) for i in range(50)]
    done = chain(*steps).enqueue()
    with Chaos(logs, ["ch-a", "ch-b"], seed=5, every=5) as chaos:
        ended = wait_for_end(done.id)
    assert chaos.kills >= 2 and chaos.stops >= 1, "the workers were not disturbed"
    ids = done.task_ids
    rows = {t.id: t for t in Task.objects.filter(pk__in=ids)}
    assert [rows[i].status for i in ids] == ["SUCCESSFUL"] * 40 + ["FAILED"] + ["CANCELLED"] * 9
    assert [rows[i].return_value for i in ids[:40]] == list(range(40))
    first = starts_of(ids)
    assert set(first) == set(ids[:41])  # the cancelled steps never started
    for before, after in itertools.pairwise(ids[:41]):
        assert first[after] > rows[before].finished_at, f"task {after} started before {before} finished"
    for i in ids[41:]:
        assert rows[i].errors[-1]["exception_class_path"] == "tasks.exceptions.DependencyFailed"
    assert ended.status == "FAILED" and ended.finished_at
    assert ended.finished_at >= max(r.finished_at for r in rows.values() if r.finished_at)


def test_a_graph_of_two_hundred_starts_nothing_before_its_parents_succeeded(logs: Path) -> None:
    rng = random.Random(7)
    graph = Flow("random graph")
    parents: dict[int, list[int]] = {}
    for n in range(200):
        ups = rng.sample(range(n), k=min(n, rng.randint(0, 3)))
        parents[n] = ups
        graph.add(step(H + "node", n, work=0.3), after=ups)
    done = graph.enqueue()
    with Chaos(logs, ["dag-a", "dag-b", "dag-c"], seed=7) as chaos:
        ended = wait_for_end(done.id)
    assert chaos.kills >= 2 and chaos.stops >= 1, "the workers were not disturbed"
    assert ended.status == "SUCCESSFUL", ended
    ids = done.task_ids
    finished = dict(Task.objects.filter(pk__in=ids).values_list("id", "finished_at"))
    first = starts_of(ids)
    assert set(first) == set(ids)
    checked = 0
    for n, ups in parents.items():
        for up in ups:
            assert first[ids[n]] > finished[ids[up]], f"node {n} started before its parent {up} finished"
            checked += 1
    assert checked > 200
