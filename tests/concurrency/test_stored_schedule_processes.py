"""Two ``run_scheduler`` replicas with nothing declared in settings; an operator stores schedules
through the JSON API while the leader is SIGKILLed and the other takes over: each slot after the
schedule was stored becomes exactly one task, a pause and an edit are followed within one round."""

from __future__ import annotations

import datetime as dt
import itertools
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from leasing.models import Lease
from tasks.maintenance.scheduler import SCHEDULER_LEASE
from tasks.models import ScheduleRun, StoredSchedule, Task
from tests.helpers import iso_time, start_manage, stop_process, wait_until
from tests.helpers.api import TOKEN, Api
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]


@pytest.fixture
def stored_replicas(tmp_path: Path, settings: Any) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    settings.LEASING_TASKS = {"API_TASKS": [NOOP]}
    settings.LEASING_API_TOKENS = [TOKEN]
    procs = {
        name: start_manage(
            tmp_path / f"{name}.log",
            "run_scheduler",
            "--ttl",
            "2",
            "--instance-id",
            name,
            "-v",
            "2",
            LEASING_TEST_API_TASKS=NOOP,
        )
        for name in ("sched-a", "sched-b")
    }
    yield procs
    for proc in procs.values():
        stop_process(proc)


def leader() -> str | None:
    held = Lease.objects.active().filter(resource=SCHEDULER_LEASE).first()
    return held.holder if held else None


def runs(name: str) -> list[ScheduleRun]:
    return list(ScheduleRun.objects.filter(schedule=name).order_by("slot"))


def wait_for_runs(name: str, more: int, timeout: float = 30) -> None:
    target = len(runs(name)) + more
    wait_until(lambda: len(runs(name)) >= target, timeout, interval=0.1, what=f"{more} more slots of {name}")


def test_stored_schedules_fire_once_per_slot_through_a_leader_kill_and_follow_pause_and_edit(
    stored_replicas: dict[str, subprocess.Popen[bytes]], client: Client
) -> None:
    api = Api(client)
    status, body = api.call(
        "POST", "/api/schedules", {"name": "tick", "task": NOOP, "interval": 1, "catch_up": "all", "kwargs": {"v": 1}}
    )
    assert status == 201, body
    stored_at = iso_time(body["effective_from"])
    witness = {"name": "witness", "task": NOOP, "interval": 1, "catch_up": "all", "kwargs": {"w": 1}}
    assert api.call("POST", "/api/schedules", witness)[0] == 201

    first = wait_until(leader, 30, interval=0.05, what="a scheduler to lead")
    wait_for_runs("tick", 4)
    assert runs("tick")[0].slot == stored_at.replace(microsecond=0) + dt.timedelta(seconds=1)  # no back-fill

    stored_replicas[first].send_signal(signal.SIGKILL)
    stored_replicas[first].wait(10)
    wait_until(lambda: (h := leader()) not in (None, first) and h, 20, interval=0.05, what="a successor")
    wait_for_runs("tick", 4)

    # Paused: once the witness shows a round passed after the pause, tick has no slot after it.
    status, body = api.call("POST", "/api/schedules/tick/pause")
    paused_at = iso_time(body["updated_at"])
    wait_until(lambda: any(r.slot > paused_at + dt.timedelta(seconds=2) for r in runs("witness")), 20, what="rounds")
    assert all(r.slot <= paused_at for r in runs("tick"))

    # Edited and resumed in one write: the next slots carry the new definition, none the old after it.
    status, body = api.call(
        "PUT", "/api/schedules/tick", {"task": NOOP, "interval": 1, "kwargs": {"v": 2}, "paused": False}
    )
    assert status == 200 and not body["paused"]
    edited_revision = body["revision"]
    edited_at = iso_time(body["effective_from"])
    wait_until(lambda: any(r.slot > edited_at for r in runs("tick")), 20, interval=0.1, what="a slot after the edit")
    wait_for_runs("tick", 2)

    for proc in stored_replicas.values():
        stop_process(proc)
    tick = runs("tick")
    tasks = {t.pk: t for t in Task.objects.filter(task_path=NOOP)}
    assert len(tasks) == ScheduleRun.objects.count(), "one task per slot, no task without a slot"
    for run in tick:
        expected = {"v": 1} if run.slot <= paused_at else {"v": 2}
        assert tasks[run.task_id].kwargs == expected, run
        assert run.slot <= paused_at or run.slot > edited_at
    # Through the kill, the witness's slots follow each other with no gap and no repeat (catch-up "all").
    slots = [r.slot for r in runs("witness")]
    assert not [(a, b) for a, b in itertools.pairwise(slots) if b - a != dt.timedelta(seconds=1)]
    assert all(task.api_origin for task in tasks.values())
    assert StoredSchedule.objects.get(name="tick").revision == edited_revision
