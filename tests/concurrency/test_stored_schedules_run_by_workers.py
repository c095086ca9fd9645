"""Workers only (``run_worker``, no ``run_scheduler``) and no schedule in settings: a schedule stored
at runtime, before the workers started or after, is enqueued by a worker's scheduler thread and run
by the workers, each slot once; the Schedules page and the API name that worker's scheduler as the
leader."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from leasing.models import Lease
from tasks.maintenance.scheduler import SCHEDULER_LEASE
from tasks.models import ScheduleRun
from tasks.models.finished import statuses
from tests.factories import StaffFactory
from tests.helpers import start_manage, stop_process, wait_until
from tests.helpers.api import TOKEN, Api
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

WORKERS = ("sched-worker-a", "sched-worker-b")


@pytest.fixture
def api(settings: Any, client: Client) -> Api:
    settings.LEASING_TASKS = {"API_TASKS": [NOOP]}  # no SCHEDULES: the workers' settings declare none either
    settings.LEASING_API_TOKENS = [TOKEN]
    return Api(client)


@pytest.fixture
def start_workers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        stop_process(proc)


def start(procs: list[subprocess.Popen[bytes]], log: Path, name: str) -> None:
    procs.append(
        start_manage(
            log,
            "run_worker",
            *("--worker-id", name, "--poll-interval", "0.1", "--concurrency", "2", "-v", "2"),
            LEASING_TEST_API_TASKS=NOOP,
        )
    )


def store(api: Api, name: str) -> None:
    status, body = api.call(
        "POST", "/api/schedules", {"name": name, "task": NOOP, "interval": 1, "catch_up": "all", "kwargs": {"s": name}}
    )
    assert status == 201, body


def ran(name: str) -> bool:
    """A slot of ``name`` enqueued, and its task run to the end by a worker."""
    ids = list(ScheduleRun.objects.filter(schedule=name).values_list("task_id", flat=True))
    return "SUCCESSFUL" in statuses(ids).values()


def test_a_stored_schedule_runs_in_workers_whether_stored_before_or_after_they_started(
    api: Api, start_workers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    store(api, "stored-before")
    for name in WORKERS:
        start(start_workers, tmp_path / f"{name}.log", name)
    wait_until(lambda: ran("stored-before"), 60, interval=0.1, what="a slot of the schedule stored before")

    store(api, "stored-after")
    wait_until(lambda: ran("stored-after"), 60, interval=0.1, what="a slot of the schedule stored after")

    # The leader shown is a scheduler of one of the workers (holder host:pid:random).
    status, body = api.call("GET", "/api/schedules")
    assert status == 200, body
    prefixes = tuple(f"{socket.gethostname()}:{proc.pid}:" for proc in start_workers)
    leader = body["scheduler"]["leader"]
    assert leader and leader.startswith(prefixes), (leader, prefixes)
    staff = Client()
    staff.force_login(StaffFactory.create())
    page = staff.get("/dashboard/schedules/")
    assert page.status_code == 200 and leader in page.content.decode()

    for proc in start_workers:
        stop_process(proc)
    for name in ("stored-before", "stored-after"):
        runs = list(ScheduleRun.objects.filter(schedule=name).values_list("slot", "task_id"))
        slots = [slot for slot, _task in runs]
        assert len(slots) == len(set(slots)) >= 1, f"{name}: a slot enqueued twice, or none"
        assert len({task for _slot, task in runs}) == len(runs), f"{name}: one task per slot"


def test_a_workers_scheduler_takes_no_lease_while_no_schedule_is_stored(
    api: Api, start_workers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    start(start_workers, log, "sched-worker-idle")
    wait_until(lambda: "no lease taken until one is stored" in log.read_text(), 60, what="the scheduler standing aside")
    # Standing aside, it looks for a stored schedule and takes no lease (it never led: no row at all).
    assert not Lease.objects.filter(resource=SCHEDULER_LEASE).exists()
    store(api, "stored-later")
    wait_until(lambda: ran("stored-later"), 60, interval=0.1, what="a slot of the schedule stored later")
    assert Lease.objects.filter(resource=SCHEDULER_LEASE).exists()
