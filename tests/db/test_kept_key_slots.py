"""Key slots kept for handlers that outlive their rows (issue 20, item 7; tasks/lifecycle/concurrency.py).

The statements on one connection: a timed-out attempt's slot kept by its worker before the timeout is
recorded, a lapsed attempt's slot kept by recovery while its worker lives on, and the slots given
back when the handler returns or its worker is known dead, each admitting the key's next task.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from leasing.metrics import scrape_values
from tasks.lifecycle import concurrency
from tasks.lifecycle.statements import ISOLATED_WAITING_SQL
from tasks.maintenance.recovery import recover_once
from tasks.models import ConcurrencyHold, Failure, Task, TaskStatus, Worker
from tests.factories import StaffFactory
from tests.helpers.plans import add_rows, explained, rows_read, seq_scans_of_tasks
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def serial(n: int, key: str = "k") -> list[int]:
    return [Task.objects.enqueue(NOOP, concurrency_key=key, concurrency_limit=1, max_attempts=1).id for _ in range(n)]


def status(task_id: int) -> str:
    return Task.objects.get(pk=task_id).status


def register(worker_id: str, ttl: float = 2.0) -> None:
    Worker.objects.create(id=worker_id, name=worker_id.rsplit(":", 1)[0], hostname="h", pid=1, concurrency=4, ttl=ttl)


def test_a_timed_out_attempt_keeps_its_slot_until_its_handler_returns() -> None:
    first, second = serial(2)
    register("w:1")
    [claimed] = Task.objects.claim("w:1", ttl=30)
    assert claimed.id == first and status(second) == TaskStatus.BLOCKED

    # The worker abandons the attempt at its timeout: slot kept first, then the timeout recorded.
    assert concurrency.keep_slots("w:1", [claimed.key], reason="timeout", using="default") == {claimed.key}
    Task.objects.fail(Failure(first, claimed.token, "tasks.exceptions.TaskTimeout", "timed out", ""), "w:1")
    assert status(first) == TaskStatus.FAILED
    assert status(second) == TaskStatus.BLOCKED  # the handler may still be running: no second one

    # Another worker's release, or a wrong token, gives nothing back.
    assert concurrency.release_kept("w:2", [claimed.key], using="default") == 0
    assert concurrency.release_kept("w:1", [(first, claimed.token + 1)], using="default") == 0
    assert status(second) == TaskStatus.BLOCKED

    assert concurrency.release_kept("w:1", [claimed.key], using="default") == 1  # the handler returned
    assert status(second) == TaskStatus.READY
    assert not ConcurrencyHold.objects.exists()


def test_keeping_a_slot_needs_a_keyed_row_the_worker_still_runs() -> None:
    plain = Task.objects.enqueue(NOOP).id
    [keyed] = serial(1)
    register("w:1")
    claimed = {c.id: c for c in Task.objects.claim("w:1", ttl=30, limit=2)}
    assert set(claimed) == {plain, keyed}
    attempts = [claimed[plain].key, claimed[keyed].key, (keyed, claimed[keyed].token + 1)]
    assert concurrency.keep_slots("w:2", attempts, reason="timeout", using="default") == set()  # not its rows
    assert concurrency.keep_slots("w:1", attempts, reason="timeout", using="default") == {claimed[keyed].key}
    assert concurrency.keep_slots("w:1", attempts, reason="timeout", using="default") == set()  # once


def _lapse(task_id: int, worker_id: str, *, worker_seen_after_renewal: bool) -> None:
    """The attempt's lease ran out 5 s ago, 10 s after its last renewal; its worker's last stamp came
    after that renewal (it lived on: the attempt stalled) or not (it vanished)."""
    now = timezone.now()
    Task.objects.filter(pk=task_id).update(
        attempt_started=True, renewed_at=now - dt.timedelta(seconds=15), expires_at=now - dt.timedelta(seconds=5)
    )
    seen = now - dt.timedelta(seconds=7 if worker_seen_after_renewal else 20)
    Worker.objects.filter(pk=worker_id).update(last_seen_at=seen, previous_seen_at=seen, ttl=12)


def test_recovery_keeps_the_slot_of_an_attempt_that_stalled_in_a_live_worker() -> None:
    first, second = serial(2)
    register("w:1")
    [claimed] = Task.objects.claim("w:1", ttl=30)
    _lapse(first, "w:1", worker_seen_after_renewal=True)

    report = recover_once()
    # Requeued (a first crash: due at once), but waiting for a slot: its stalled handler keeps one.
    assert first in report.requeued and status(first) == TaskStatus.BLOCKED
    [kept] = ConcurrencyHold.objects.all()
    assert (kept.task_id, kept.token, kept.worker) == (first, claimed.token, "w:1")
    assert (kept.reason, kept.key) == ("lapsed", "k")
    assert status(second) == TaskStatus.BLOCKED
    # Nothing of the key runs beside the stalled handler, its own task's next attempt included; once
    # the handler has returned, the task (first by id at equal priority) gets the slot again.
    assert concurrency.release_kept("w:1", [claimed.key], using="default") == 1
    assert (status(first), status(second)) == (TaskStatus.READY, TaskStatus.BLOCKED)
    assert not ConcurrencyHold.objects.exists()


def test_the_heartbeat_gives_back_slots_kept_for_attempts_whose_handler_is_not_running() -> None:
    first, second = serial(2)
    register("w:1")
    [claimed] = Task.objects.claim("w:1", ttl=30)
    concurrency.keep_slots("w:1", [claimed.key], reason="timeout", using="default")
    Task.objects.fail(Failure(first, claimed.token, "tasks.exceptions.TaskTimeout", "t", ""), "w:1")
    ConcurrencyHold.objects.create(key="other", task_id=10**9, token=5, worker="w:2", reason="lapsed")
    beats = Task.objects
    beats.heartbeat_detail("w:1", [], ttl=30, stats={}, live=[claimed.key])  # still running: kept
    assert status(second) == TaskStatus.BLOCKED
    beats.heartbeat_detail("w:1", [], ttl=30, stats={})  # a beat that says nothing of live handlers: kept
    assert status(second) == TaskStatus.BLOCKED
    beats.heartbeat_detail("w:1", [], ttl=30, stats={}, live=[])  # returned, its release lost: given back
    assert status(second) == TaskStatus.READY
    assert list(ConcurrencyHold.objects.values_list("worker", flat=True)) == ["w:2"]  # not another's


def test_recovery_keeps_nothing_for_a_worker_that_vanished() -> None:
    first, _second = serial(2)
    register("w:1")
    Task.objects.claim("w:1", ttl=30)
    _lapse(first, "w:1", worker_seen_after_renewal=False)
    report = recover_once()
    assert first in report.requeued
    assert not ConcurrencyHold.objects.exists()  # requeued within TTL + interval, as before (invariant 7)


def test_slots_kept_for_workers_known_dead_are_given_back_by_recovery() -> None:
    first, second = serial(2, key="a")
    third, fourth = serial(2, key="b")
    register("w:stopped")
    register("w:alive")
    [a] = Task.objects.claim("w:stopped", ttl=30)
    [b] = Task.objects.claim("w:alive", ttl=30)
    assert (a.id, b.id) == (first, third)
    concurrency.keep_slots("w:stopped", [a.key], reason="timeout", using="default")
    concurrency.keep_slots("w:alive", [b.key], reason="timeout", using="default")
    for worker, claimed in (("w:stopped", a), ("w:alive", b)):
        Task.objects.fail(Failure(claimed.id, claimed.token, "tasks.exceptions.TaskTimeout", "t", ""), worker)
    Worker.objects.filter(pk="w:stopped").update(stopped_at=timezone.now(), stop_reason="stopped")

    report = recover_once()
    assert report.slots_released == [first]
    assert (status(second), status(fourth)) == (TaskStatus.READY, TaskStatus.BLOCKED)
    assert list(ConcurrencyHold.objects.values_list("worker", flat=True)) == ["w:alive"]


def test_the_admission_counts_kept_slots_beside_ready_and_running_rows() -> None:
    ConcurrencyHold.objects.create(key="k", task_id=10**9, token=1, worker="w:gone", reason="timeout")
    first, second = (
        Task.objects.enqueue(NOOP, concurrency_key="k", concurrency_limit=2, max_attempts=1).id for _ in range(2)
    )
    assert (status(first), status(second)) == (TaskStatus.READY, TaskStatus.BLOCKED)
    with connection.cursor() as cursor:  # an operator's delete admits too (the trigger)
        cursor.execute("DELETE FROM tasks_concurrencyhold WHERE key = 'k'")
    assert status(second) == TaskStatus.READY


def test_kept_slots_show_on_the_dashboard_and_in_metrics(client: Client) -> None:
    first, second = serial(2, key="shown")
    ConcurrencyHold.objects.create(key="shown", task_id=first, token=1, worker="w:1", reason="timeout")
    client.force_login(StaffFactory.create())
    page = client.get("/dashboard/").content.decode()
    assert "+1 kept" in page
    scraped = scrape_values(client.get("/metrics").content.decode())
    assert scraped['tasks_concurrency_kept{database="default",key="shown"}'] == 1
    assert scraped['tasks_concurrency_keys_full{database="default"}'] == 1  # one READY + one kept: full
    assert status(second) == TaskStatus.BLOCKED


def test_the_look_for_isolated_tasks_reads_only_the_few_that_crashed() -> None:
    """A busy worker's probe (tasks/worker/isolation.py) beside 200,000 READY tasks of its queue and 1,000
    crashed ones elsewhere reads the partial index of crashed READY rows, never the backlog."""
    add_rows("default", "READY", 200_000)
    add_rows("other", "READY", 1_000)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET shared_crashes = 1 WHERE queue = 'other'")
        cursor.execute("ANALYZE tasks_task")
    suspect = Task.objects.enqueue(NOOP, queue="default").id
    Task.objects.filter(pk=suspect).update(shared_crashes=2)
    params: dict[str, Any] = {"isolate_after": 2, "queues": ["default", "mail"]}
    plan = explained(ISOLATED_WAITING_SQL, params)
    assert seq_scans_of_tasks(plan) == []
    assert max(read for _node, read in rows_read(plan)) <= 2, rows_read(plan)
    with connection.cursor() as cursor:
        cursor.execute(ISOLATED_WAITING_SQL, params)
        assert cursor.fetchone() == ("default",)
        cursor.execute(ISOLATED_WAITING_SQL, {"isolate_after": 3, "queues": ["default"]})
        assert cursor.fetchone() is None  # not yet to be isolated
