"""Three ``run_scheduler`` replicas, a 1-second schedule, the leader SIGKILLed and SIGSTOPped:
every slot becomes exactly one task, none is missed (catch-up "all")."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasing.models import Lease
from tasks.maintenance.scheduler import SCHEDULER_LEASE
from tasks.models import ScheduleRun, Task
from tests.helpers import start_manage, stop_process, wait_until
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

SCHEDULES = {"tick": {"task": NOOP, "interval": 1, "catch_up": "all", "kwargs": {"from": "schedule"}}}


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    env = {"LEASING_TEST_SCHEDULES": json.dumps(SCHEDULES)}
    procs = {
        name: start_manage(
            tmp_path / f"{name}.log", "run_scheduler", "--ttl", "2", "--instance-id", name, "-v", "2", **env
        )
        for name in ("sched-a", "sched-b", "sched-c")
    }
    yield procs
    for proc in procs.values():
        stop_process(proc)


def leader() -> str | None:
    held = Lease.objects.active().filter(resource=SCHEDULER_LEASE).first()
    return held.holder if held else None


def wait_for_runs(more: int, timeout: float = 20) -> None:
    target = ScheduleRun.objects.count() + more
    wait_until(lambda: ScheduleRun.objects.count() >= target, timeout, interval=0.1, what=f"{more} more slots")


def test_each_slot_is_enqueued_exactly_once_through_kills_and_pauses(
    replicas: dict[str, subprocess.Popen[bytes]],
) -> None:
    first = wait_until(leader, 30, interval=0.05, what="a scheduler to lead")
    wait_for_runs(10)

    # The leader pauses for less than its TTL: it keeps the lease and catches up the slots it missed.
    os.kill(replicas[first].pid, signal.SIGSTOP)
    time.sleep(1.2)  # the fault being injected lasts this long (not a synchronisation)
    os.kill(replicas[first].pid, signal.SIGCONT)
    wait_for_runs(8)

    # The leader dies: a standby takes over once its lease expires, and catches up the gap.
    replicas[first].send_signal(signal.SIGKILL)
    replicas[first].wait(10)
    second = wait_until(lambda: (h := leader()) not in (None, first) and h, 20, interval=0.05, what="a successor")
    wait_for_runs(10)

    # The new leader freezes past its TTL: the third replica takes over; the frozen one comes back
    # as a stale leader and must not enqueue anything (its writes carry an old token).
    os.kill(replicas[second].pid, signal.SIGSTOP)
    third = wait_until(
        lambda: (h := leader()) not in (None, first, second) and h, 20, interval=0.05, what="a third leader"
    )
    wait_for_runs(10)
    os.kill(replicas[second].pid, signal.SIGCONT)
    wait_for_runs(10)
    assert leader() in (second, third)

    for name in (second, third):
        stop_process(replicas[name])
    runs = list(ScheduleRun.objects.filter(schedule="tick").order_by("slot"))
    slots = [run.slot for run in runs]
    step = dt.timedelta(seconds=1)
    gaps = [(a, b) for a, b in itertools.pairwise(slots) if b - a != step]
    assert not gaps, f"slots missed or repeated: {gaps}"
    assert len(slots) >= 48

    tasks = list(Task.objects.filter(task_path=NOOP))
    assert len(tasks) == len(runs), "one task per slot, no task without a slot"
    assert {t.pk for t in tasks} == {r.task_id for r in runs}
    assert all(t.kwargs == {"from": "schedule"} for t in tasks)

    # Terms follow each other: a slot enqueued later never carries an older token, and three
    # leaders (at least three terms) enqueued.
    tokens = [run.token for run in runs]
    assert tokens == sorted(tokens)
    assert len(set(tokens)) >= 3
