"""Uniqueness over a window and debounce under concurrent enqueues from 8 processes, each on its own
connection, released together by a barrier in the database (an advisory lock the test holds until
every child waits on it): exactly the promised number of tasks per key and window, and a debounce
never changes the arguments of an attempt a worker has claimed. That a key's windows never overlap
while 8 processes enqueue it freely (rolled-back enqueues and retention's pruning among them) is
tests/concurrency/test_windows_and_debounce_pgbouncer.py's, through PgBouncer."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from tasks.models import Task, TaskStatus, UniqueKey
from tests.helpers import db_now, ensure_ended, read_message, send, start_child, wait_until
from tests.helpers.windows import BARRIER

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

PROCESSES = 8


class Children:
    """Child processes of the windows helper, each round released together."""

    def __init__(self, roles: list[tuple[str, str]]) -> None:
        self.procs = [start_child("windows", role, name) for role, name in roles]
        for proc in self.procs:
            # A deadline, not a pause: 8 Django processes starting on a loaded 2-core machine.
            assert read_message(proc, 180).get("ready")

    def round(self, spec: dict[str, Any], timeout: float = 180.0) -> list[list[Any]]:
        """Send ``spec`` to every child, let them go at once, return each child's results."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [BARRIER])
            try:
                for proc in self.procs:
                    send(proc, spec)
                wait_until(lambda: waiting_at_barrier() == len(self.procs), 120, what="every child at the barrier")
            finally:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [BARRIER])
        return [read_message(proc, timeout)["results"] for proc in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            with ensure_ended(proc):
                send(proc, {"stop": True})
                _out, err = proc.communicate(timeout=30)
                assert proc.returncode == 0, err


@pytest.fixture
def children() -> Iterator[Any]:
    started: list[Children] = []

    def start(roles: list[tuple[str, str]]) -> Children:
        group = Children(roles)
        started.append(group)
        return group

    yield start
    for group in started:
        for proc in group.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def waiting_at_barrier() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            [BARRIER],
        )
        return int(cursor.fetchone()[0])


def windows_passed(keys: list[str]) -> bool:
    return not UniqueKey.objects.filter(key__in=keys, expires_at__gt=db_now()).exists()


def test_unique_for_admits_exactly_one_task_per_key_and_window(children: Any) -> None:
    keys = [f"report:{n}" for n in range(5)]
    group = children([("unique", f"u{n}") for n in range(PROCESSES)])
    # A window long enough that the round "still inside" it is, on a loaded machine too (at 1.5 s the
    # suite's Django 5.2 leg once ran the second round after the window had passed).
    spec = {"keys": keys, "calls": 3, "unique_for": 8.0}

    # Window 1: 8 processes x 3 calls per key, released together: one task per key, every call
    # answered with it.
    first = [row for results in group.round(spec) for row in results]
    assert len(first) == PROCESSES * 3 * len(keys)
    created = {key: [r[1] for r in first if r[0] == key and r[2]] for key in keys}
    assert all(len(ids) == 1 for ids in created.values()), created
    assert all(r[1] == created[r[0]][0] for r in first), "a duplicate was answered with another task"
    assert Task.objects.filter(queue="windows").count() == len(keys)

    # Still inside the window, every task finished: refused all the same (finished or not).
    Task.objects.filter(queue="windows").cancel()
    inside = [row for results in group.round({**spec, "calls": 1}) for row in results]
    assert not any(r[2] for r in inside), "a second task inside the window"
    assert Task.objects.filter(queue="windows").count() == len(keys)

    # The window passes on the database clock; the first key's task is left unfinished (requeued):
    # the dedup promise still holds for it, the other keys get exactly one new task each.
    wait_until(lambda: windows_passed(keys), 30, what="the windows to pass on the database clock")
    Task.objects.filter(pk=created[keys[0]][0]).requeue()
    second = [row for results in group.round(spec) for row in results]
    created_again = {key: {r[1] for r in second if r[0] == key and r[2]} for key in keys}
    assert created_again[keys[0]] == set(), "a second unfinished task of a key"
    assert all(r[1] == created[keys[0]][0] for r in second if r[0] == keys[0])
    for key in keys[1:]:
        assert len(created_again[key]) == 1, (key, created_again[key])
        assert all(r[1] in created_again[key] for r in second if r[0] == key)
    assert Task.objects.filter(queue="windows").count() == 2 * len(keys) - 1
    group.stop()


def test_debounce_folds_every_concurrent_enqueue_into_one_waiting_task(children: Any) -> None:
    keys = ["search:1", "search:2"]
    group = children([("debounce", f"d{n}") for n in range(PROCESSES)])
    rows = [
        row for results in group.round({"keys": keys, "calls": 4, "debounce": 30, "max_wait": 45}) for row in results
    ]
    assert len(rows) == PROCESSES * 4 * len(keys)
    for key in keys:
        mine = [r for r in rows if r[0] == key]
        created = [r for r in mine if r[2]]
        assert len(created) == 1, f"{key}: {len(created)} tasks"
        task = Task.objects.get(pk=created[0][1])
        assert all(r[1] == task.pk for r in mine)
        assert task.debounces == len(mine) - 1
        assert task.kwargs["v"] in {r[3] for r in mine}
        # Pushed to now + 30 s at the last debounce, never past the first enqueue + 45 s.
        assert task.debounce_until == task.enqueued_at + dt.timedelta(seconds=45)
        assert task.enqueued_at + dt.timedelta(seconds=30) <= task.run_after <= task.debounce_until
    assert Task.objects.filter(queue="windows").count() == len(keys)
    group.stop()


def test_a_debounce_never_changes_the_arguments_of_a_claimed_attempt(children: Any) -> None:
    """8 processes debounce one key (5 ms, at most 20 ms after its first enqueue: each task comes due
    while the enqueues keep coming) while 2 others claim from its queue for 3 s:
    every claimed attempt keeps the arguments it was claimed with; every task holds the value of
    an enqueue that was folded into it (or created it); each claim left the next enqueue a new task."""
    roles = [("debounce-hammer", f"d{n}") for n in range(PROCESSES)] + [("claimer", f"w{n}") for n in range(2)]
    group = children(roles)
    results = group.round({"keys": ["feed"], "seconds": 3.0, "debounce": 0.005, "max_wait": 0.02, "queue": "windows"})
    enqueues = [row for rows in results[:PROCESSES] for row in rows]
    claims = [row for rows in results[PROCESSES:] for row in rows]
    assert len(claims) >= 20, f"only {len(claims)} claims: the race proved nothing"
    folded = sum(1 for r in enqueues if not r[1])
    assert folded >= 20, f"only {folded} enqueues were debounced: the race proved nothing"
    by_id = {task.pk: task for task in Task.objects.filter(queue="windows")}
    assert len(by_id) == sum(1 for r in enqueues if r[1]), "tasks other than those the enqueues created"
    values: dict[int, set[str]] = defaultdict(set)
    for task_id, _created, value in enqueues:
        values[task_id].add(value)
    for task_id, token, kwargs in claims:
        task = by_id[task_id]
        assert task.status == TaskStatus.RUNNING and task.token == token
        assert task.kwargs == kwargs, f"task {task_id} changed after its claim: {kwargs} -> {task.kwargs}"
    for task in by_id.values():
        assert task.kwargs["v"] in values[task.pk], f"task {task.pk} holds a value no enqueue gave it"
    # At most one task of the key waits; the rest were claimed.
    waiting = [t for t in by_id.values() if t.status in (TaskStatus.READY, TaskStatus.BLOCKED)]
    assert len(waiting) <= 1
    assert len(by_id) - len(waiting) == len(claims)
    group.stop()


def test_the_barrier_holds_every_child_until_the_test_lets_go() -> None:
    """The barrier itself: a child does nothing before the test lets go (no sleeps: the lock)."""
    proc = start_child("windows", "unique", "solo")
    with ensure_ended(proc):
        assert read_message(proc).get("ready")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [BARRIER])
            send(proc, {"keys": ["solo"], "calls": 1, "unique_for": 60})
            wait_until(lambda: waiting_at_barrier() == 1, 30, what="the child at the barrier")
            assert not Task.objects.filter(dedup_key="solo").exists()
            cursor.execute("SELECT pg_advisory_unlock(%s)", [BARRIER])
        assert read_message(proc)["results"][0][2] is True
        send(proc, {"stop": True})
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
