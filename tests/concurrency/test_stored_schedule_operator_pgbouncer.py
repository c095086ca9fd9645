"""Two ``run_scheduler`` replicas through a real PgBouncer in transaction pooling (two server
connections); an operator edits, deletes and stores again a schedule through the JSON API while the
leader is SIGSTOPped (its lease expires, the other takes over, then it is resumed), and finally the
task path leaves the allow-list (the replicas restarted with another list). Each slot becomes at most
one task, under the definition current at it: the first one's slots before the edit, the edited
one's after it, none between the delete and the re-create, the new row's after that, none after its
path left the allow-list; a witness schedule (catch-up "all") keeps every slot, no gap, no repeat.

Written attacking issue 40 on Python 3.10, Django 5.2 and PostgreSQL 15 (the delete and re-create
it holds ran the deleted definition: tests/db/test_stored_schedule_recreated.py)."""

from __future__ import annotations

import datetime as dt
import itertools
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from leasing.models import Lease
from tasks.maintenance.scheduler import SCHEDULER_LEASE
from tasks.models import ScheduleRun, Task
from tests.helpers import db_now, start_manage, stop_process, wait_until
from tests.helpers.api import TOKEN, Api
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WITNESS = "tests.testapp.handlers.record"
SECOND = dt.timedelta(seconds=1)


def leader() -> str | None:
    held = Lease.objects.active().filter(resource=SCHEDULER_LEASE).first()
    return held.holder if held else None


def runs(name: str) -> list[ScheduleRun]:
    return list(ScheduleRun.objects.filter(schedule=name).order_by("slot"))


def a_run_after(name: str, moment: dt.datetime, timeout: float = 30) -> None:
    wait_until(lambda: any(r.slot > moment for r in runs(name)), timeout, interval=0.1, what=f"{name} after {moment}")


def test_edit_delete_and_store_again_through_a_stopped_leader_behind_pgbouncer(
    bouncer_pool_of_2: Bouncer, client: Client, tmp_path: Path, settings: Any
) -> None:
    settings.LEASING_TASKS = {"API_TASKS": [NOOP, WITNESS]}
    settings.LEASING_API_TOKENS = [TOKEN]
    api = Api(client)
    pooled = {"DATABASE_URL": bouncer_pool_of_2.url(connection.settings_dict["NAME"]), "DATABASE_POOLED": "true"}

    def start(name: str, allowed: str) -> subprocess.Popen[bytes]:
        args = ("run_scheduler", "--ttl", "2", "--instance-id", name, "-v", "2")
        return start_manage(tmp_path / f"{name}.log", *args, LEASING_TEST_API_TASKS=allowed, **pooled)

    procs = {name: start(name, f"{NOOP},{WITNESS}") for name in ("sched-a", "sched-b")}
    try:
        assert (
            api.call(
                "POST",
                "/api/schedules",
                {"name": "tick", "task": NOOP, "interval": 1, "catch_up": "all", "kwargs": {"v": 1}},
            )[0]
            == 201
        )
        witness = {"name": "witness", "task": WITNESS, "interval": 1, "catch_up": "all"}
        assert api.call("POST", "/api/schedules", witness)[0] == 201
        first = wait_until(leader, 30, interval=0.05, what="a scheduler to lead")
        wait_until(lambda: len(runs("tick")) >= 3, 30, interval=0.1, what="three slots of tick")

        # The leader stops (not killed: it wakes up later, sure it still leads); the other takes over.
        os.kill(procs[first].pid, signal.SIGSTOP)
        wait_until(lambda: (h := leader()) not in (None, first) and h, 30, interval=0.05, what="a successor")
        status, body = api.call("PATCH", "/api/schedules/tick", {"kwargs": {"v": 2}})
        assert status == 200, body
        edited_at = dt.datetime.fromisoformat(body["effective_from"])
        a_run_after("tick", edited_at + SECOND)
        os.kill(procs[first].pid, signal.SIGCONT)

        # Deleted, then stored again at once (within one round of the leader), twice: the row is a new
        # schedule (a new revision, never the deleted one's: migration 0033; created later).
        replaced = []  # (deleted at, stored again at, kwargs)
        for version in (3, 4):
            assert api.call("DELETE", "/api/schedules/tick")[0] == 200
            deleted_at = db_now()
            body = {"name": "tick", "task": NOOP, "interval": 1, "catch_up": "all", "kwargs": {"v": version}}
            status, body = api.call("POST", "/api/schedules", body)
            assert status == 201, body
            stored_again_at = dt.datetime.fromisoformat(body["effective_from"])
            replaced.append((deleted_at, stored_again_at, {"v": version}))
            a_run_after("tick", stored_again_at + 2 * SECOND)

        # tick's path leaves the allow-list: the replicas restart with the witness's path only.
        for proc in procs.values():
            stop_process(proc)
        refused_from = db_now()
        procs = {name: start(name, WITNESS) for name in ("sched-c", "sched-d")}
        a_run_after("witness", refused_from + 3 * SECOND)
        wait_until(
            lambda: "stored schedule tick is not run" in "".join((tmp_path / f"{n}.log").read_text() for n in procs),
            30,
            what="the leader to say why tick is not run",
        )
    finally:
        for proc in procs.values():
            stop_process(proc)

    tasks = {t.pk: t for t in Task.objects.all()}
    all_runs = list(ScheduleRun.objects.all())
    assert len(tasks) == len(all_runs) == len({r.task_id for r in all_runs}), "one task per slot"
    for run in runs("tick"):
        kwargs = tasks[run.task_id].kwargs
        assert run.enqueued_at < refused_from, run
        if run.slot <= edited_at:
            assert kwargs == {"v": 1}, run
            continue
        expected, after = {"v": 2}, edited_at
        for deleted_at, stored_again_at, definition in replaced:
            if run.slot > deleted_at:
                expected, after = definition, stored_again_at
        assert run.slot > after and kwargs == expected, (run, kwargs)
    slots = [r.slot for r in runs("witness")]
    assert not [(a, b) for a, b in itertools.pairwise(slots) if b - a != SECOND], "a witness slot missed or repeated"
    print(f"tick: {len(runs('tick'))} slots, witness: {len(slots)} slots, runs: {len(all_runs)}")
