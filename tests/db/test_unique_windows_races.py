"""Uniqueness windows and debounce against what other transactions do meanwhile (breaker 32's findings,
issue 24): an enqueue that waited for the key's row starts its window when it was accepted, not when it
began waiting; a debounce that pushes an admitted task's start gives its concurrency slot to the next
waiting task; a requeue that meets the key's newer waiting task says so and leaves the caller's
transaction usable. Each race is played with real connections on threads of their own, synchronised
on what PostgreSQL shows (a backend waiting for a lock, the database clock), never on sleeps."""

from __future__ import annotations

import datetime as dt
import json
import threading
from typing import Any

import pytest
from django.db import transaction

from tasks.exceptions import TaskError
from tasks.lifecycle import concurrency
from tasks.maintenance.retention import prune
from tasks.models import Task, TaskStatus, UniqueKey
from tests.helpers import db_now, wait_until
from tests.helpers.api import check_answer
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def let_the_clock_pass(seconds: float) -> None:
    """Poll the database clock until ``seconds`` went by on it (a condition, not a pause)."""
    until = db_now() + dt.timedelta(seconds=seconds)
    wait_until(lambda: db_now() > until, seconds + 30, what=f"{seconds} s on the database clock")


def enqueue_unique(key: str, window: float) -> Any:
    return Task.objects.enqueue(NOOP, dedup_key=key, unique_for=window)


# -- 1. a window starts when its enqueue was accepted ------------------------------------------------

WINDOW = 2.0


def assert_the_window_starts_at_its_acceptance(waiter: OnItsOwnConnection, released_at: dt.datetime) -> None:
    """The waiting enqueue got the key: its window starts no earlier than the moment the other
    transaction let the key go, and a third enqueue inside it is answered with the waiter's task, even
    once that task finished (the window's promise, not the dedup key's)."""
    got = waiter.outcome()
    assert got.created
    key = UniqueKey.objects.get(key="k")
    assert key.task_id == got.id
    assert key.accepted_at >= released_at, f"the window starts at {key.accepted_at}, before {released_at}"
    assert (key.expires_at - key.accepted_at).total_seconds() == pytest.approx(WINDOW, abs=0.01)
    Task.objects.filter(pk=got.id).cancel()
    tasks = Task.objects.filter(dedup_key="k").count()
    assert db_now() < key.expires_at, "the machine took longer than the window to get here: nothing proved"
    third = enqueue_unique("k", WINDOW)
    assert (third.id, third.created) == (got.id, False), "a second task inside the window"
    assert Task.objects.filter(dedup_key="k").count() == tasks


def test_an_enqueue_that_waited_for_a_rolled_back_insert_of_its_key_opens_its_window_when_accepted() -> None:
    """One transaction holds an uncommitted windowed enqueue of the key; another connection's enqueue
    of the key waits for it, longer than the window; the first rolls back. The waiter's window was
    read before its wait: it ended before the enqueue was accepted, and a third enqueue slipped in."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> Any:
        with transaction.atomic():
            got = enqueue_unique("k", WINDOW)
            holding.set()
            assert release.wait(120)
            transaction.set_rollback(True)
        return got

    holder = OnItsOwnConnection(hold)
    holder.start()
    assert holding.wait(60)
    waiter = OnItsOwnConnection(lambda: enqueue_unique("k", WINDOW))
    waiter.start()
    wait_until(lambda: waits_for_a_lock(waiter.pid), 30, what="the second enqueue waiting for the key")
    let_the_clock_pass(WINDOW * 1.5)  # longer than the window: a window read before the wait has passed
    released_at = db_now()
    release.set()
    assert holder.outcome().created
    assert_the_window_starts_at_its_acceptance(waiter, released_at)


def test_an_enqueue_racing_the_prune_of_its_keys_passed_window_opens_its_window_when_accepted() -> None:
    """Retention deletes the key's passed window in a transaction still open while the key's next
    enqueue comes (it waits for the delete's row lock); the prune commits: the new window starts then."""
    first = enqueue_unique("k", 60)
    Task.objects.filter(pk=first.id).cancel()
    UniqueKey.objects.filter(key="k").update(expires_at=db_now() - dt.timedelta(seconds=1))
    pruning, release = threading.Event(), threading.Event()

    def prune_and_hold() -> Any:
        with transaction.atomic():
            deleted = prune({"UNIQUE_KEYS": dt.timedelta(0)})
            pruning.set()
            assert release.wait(120)
        return deleted

    pruner = OnItsOwnConnection(prune_and_hold)
    pruner.start()
    assert pruning.wait(60)
    waiter = OnItsOwnConnection(lambda: enqueue_unique("k", WINDOW))
    waiter.start()
    wait_until(lambda: waits_for_a_lock(waiter.pid), 30, what="the enqueue waiting for the prune")
    let_the_clock_pass(WINDOW * 1.5)
    released_at = db_now()
    release.set()
    assert pruner.outcome() == {"UNIQUE_KEYS": 1}
    assert_the_window_starts_at_its_acceptance(waiter, released_at)


def test_an_enqueue_racing_a_committed_window_of_its_key_is_refused() -> None:
    """The other side of the same wait: the first transaction commits its window, so the waiter is a
    duplicate (answered with the first task; no second window, no second task)."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> Any:
        with transaction.atomic():
            got = enqueue_unique("k", 60)
            holding.set()
            assert release.wait(120)
        return got

    holder = OnItsOwnConnection(hold)
    holder.start()
    assert holding.wait(60)
    waiter = OnItsOwnConnection(lambda: enqueue_unique("k", 60))
    waiter.start()
    wait_until(lambda: waits_for_a_lock(waiter.pid), 30, what="the second enqueue waiting for the key")
    release.set()
    first = holder.outcome()
    second = waiter.outcome()
    assert (second.id, second.created) == (first.id, False)
    assert UniqueKey.objects.get(key="k").task_id == first.id
    assert Task.objects.count() == 1


def test_enqueues_of_other_keys_never_wait_for_an_open_transaction_of_one_key() -> None:
    holding, release = threading.Event(), threading.Event()

    def hold() -> Any:
        with transaction.atomic():
            got = enqueue_unique("held", 60)
            holding.set()
            assert release.wait(120)
        return got

    holder = OnItsOwnConnection(hold)
    holder.start()
    try:
        assert holding.wait(60)
        others = [enqueue_unique(f"other-{n}", 60) for n in range(20)]
        assert all(got.created for got in others)
    finally:
        release.set()
    assert holder.outcome().created


# -- 2. a pushed debounce gives its concurrency slot up -----------------------------------------------


def keyed(**kwargs: Any) -> Any:
    return Task.objects.enqueue(NOOP, concurrency_key="c", concurrency_limit=1, **kwargs)


def admitted_debounced_task(**windows: Any) -> int:
    """A debounced task of key "c" (limit 1) that came due and was admitted: READY, holding the slot."""
    first = keyed(kwargs={"v": 1}, dedup_key="d", **windows)
    wait_until(lambda: Task.objects.filter(pk=first.id, run_after__lte=db_now()).exists(), 10, what="due")
    concurrency.admit(["c"])
    assert Task.objects.get(pk=first.id).status == TaskStatus.READY
    return int(first.id)


def slots_taken() -> int:
    return Task.objects.filter(concurrency_key="c", status__in=[TaskStatus.READY, TaskStatus.RUNNING]).count()


def test_a_debounce_pushing_an_admitted_task_gives_its_slot_to_the_next_waiting_task() -> None:
    debounced = admitted_debounced_task(debounce=0.001, max_wait=600)
    other = keyed(kwargs={"v": "other"})
    assert Task.objects.get(pk=other.id).status == TaskStatus.BLOCKED  # the key is full
    again = keyed(kwargs={"v": 2}, dedup_key="d", debounce=30, max_wait=600)
    assert (again.id, again.created) == (debounced, False)
    pushed = Task.objects.get(pk=debounced)
    assert (pushed.status, pushed.kwargs, pushed.debounces) == (TaskStatus.BLOCKED, {"v": 2}, 1)
    assert pushed.run_after > db_now() + dt.timedelta(seconds=25)
    # In the same statement: the key's next waiting task has the slot, and the limit holds.
    assert Task.objects.get(pk=other.id).status == TaskStatus.READY
    assert slots_taken() == 1
    assert [c.id for c in Task.objects.claim("w1", limit=5)] == [other.id]


def test_a_debounce_capped_at_a_start_already_due_keeps_the_slot() -> None:
    """max_wait already passed: the debounce replaces the arguments but the start stays due, so the
    task keeps its slot (giving it up would only hand it to whoever is first in line)."""
    debounced = admitted_debounced_task(debounce=0.001, max_wait=0.001)
    other = keyed(kwargs={"v": "other"})
    again = keyed(kwargs={"v": 2}, dedup_key="d", debounce=30, max_wait=30)
    assert (again.id, again.created) == (debounced, False)
    task = Task.objects.get(pk=debounced)
    assert (task.status, task.kwargs) == (TaskStatus.READY, {"v": 2})
    assert task.run_after <= db_now()
    assert Task.objects.get(pk=other.id).status == TaskStatus.BLOCKED
    assert [c.id for c in Task.objects.claim("w1", limit=5)] == [debounced]


def test_a_debounce_of_an_unkeyed_task_leaves_it_ready() -> None:
    first = Task.objects.enqueue(NOOP, kwargs={"v": 1}, dedup_key="d", debounce=0.001)
    wait_until(lambda: Task.objects.filter(pk=first.id, run_after__lte=db_now()).exists(), 10, what="due")
    Task.objects.enqueue(NOOP, kwargs={"v": 2}, dedup_key="d", debounce=30)
    task = Task.objects.get(pk=first.id)
    assert (task.status, task.kwargs) == (TaskStatus.READY, {"v": 2})
    assert task.run_after > db_now() + dt.timedelta(seconds=25)


# -- 3. a requeue that meets a newer task of its key --------------------------------------------------


def cancelled_beside_a_newer_debounced_task() -> tuple[int, int]:
    """A debounced task cancelled before any claim, and the task its key's next enqueue created."""
    old = Task.objects.enqueue(NOOP, kwargs={"v": 1}, dedup_key="feed:7", debounce=30)
    Task.objects.filter(pk=old.id).cancel()
    newer = Task.objects.enqueue(NOOP, kwargs={"v": 2}, dedup_key="feed:7", debounce=30)
    assert newer.created
    return int(old.id), int(newer.id)


def test_a_requeue_beside_the_keys_newer_debounced_task_names_the_key_and_that_task() -> None:
    old, newer = cancelled_beside_a_newer_debounced_task()
    with pytest.raises(TaskError) as raised:
        Task.objects.filter(pk=old).requeue()
    message = str(raised.value)
    assert "debounce key 'feed:7'" in message and f"task {newer}" in message and f"task {old}" in message
    assert "dedup key" not in message
    assert Task.objects.get(pk=old).status == TaskStatus.CANCELLED  # a refused requeue changed nothing
    assert Task.objects.get(pk=newer).status == TaskStatus.READY


def test_a_refused_requeue_leaves_the_callers_transaction_usable() -> None:
    old, newer = cancelled_beside_a_newer_debounced_task()
    plain = Task.objects.enqueue(NOOP, dedup_key="report")
    Task.objects.filter(pk=plain.id).cancel()
    holder = Task.objects.enqueue(NOOP, dedup_key="report")
    with transaction.atomic():
        kept = Task.objects.enqueue(NOOP, kwargs={"v": "inside"})
        with pytest.raises(TaskError, match="debounce key"):
            Task.objects.filter(pk=old).requeue()
        with pytest.raises(TaskError, match=rf"dedup key 'report'.*task {holder.id}"):
            Task.objects.filter(pk=plain.id).requeue()
        # The transaction goes on: a read, a write, and a requeue that can succeed.
        assert Task.objects.filter(pk=kept.id).exists()
        Task.objects.filter(pk=newer).cancel()
        assert Task.objects.filter(pk=old).requeue() == 1
    assert Task.objects.get(pk=kept.id).status == TaskStatus.READY
    assert Task.objects.get(pk=old).status == TaskStatus.READY
    assert Task.objects.get(pk=newer).status == TaskStatus.CANCELLED


def test_the_api_answers_a_refused_requeue_with_409_naming_the_key_and_its_task(client: Any, settings: Any) -> None:
    settings.LEASING_API_TOKENS = ["races-token"]
    old, newer = cancelled_beside_a_newer_debounced_task()
    response = client.post(f"/api/tasks/{old}/requeue", headers={"Authorization": "Bearer races-token"})
    body = json.loads(response.content)
    assert response.status_code == 409, body
    check_answer(response)
    assert "debounce key 'feed:7'" in body["error"] and f"task {newer}" in body["error"]
    assert Task.objects.get(pk=old).status == TaskStatus.CANCELLED
