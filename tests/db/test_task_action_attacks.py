"""Attacks on the dashboard's task actions (POST /dashboard/tasks/action/, issue 41): two operators
acting on the same tasks at once on two real connections, a button whose task moved after its page
was drawn, forged requests. A refused request is a 409 (or a 400 / 403) and changes nothing."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone

from tasks.models import Failure, Task
from tests.factories import StaffFactory
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock

PATH = "tests.testapp.handlers.noop"
ACTION = "/dashboard/tasks/action/"


def snapshot(ids: list[int]) -> list[tuple[Any, ...]]:
    return list(Task.objects.filter(pk__in=ids).order_by("pk").values_list("pk", "status", "run_after", "attempts"))


def later(ids: list[int]) -> None:
    Task.objects.filter(pk__in=ids).update(run_after=timezone.now() + dt.timedelta(hours=1))


@pytest.mark.django_db(transaction=True)  # two connections: each sees what the other committed
def test_run_now_waiting_behind_a_cancel_is_refused_whole_when_the_cancel_commits() -> None:
    """Operator A cancels two of three pending tasks; operator B, on a page drawn before, asks to
    run all three now. B's statement waits on A's row locks; when A commits, two rows no longer fit:
    B's whole request is a 409 naming them, and the third task is not run now either."""
    ids = [Task.objects.enqueue(PATH, queue="ops").id for _ in range(3)]
    later(ids)
    staff = Client()
    staff.force_login(StaffFactory.create())
    locked, go = threading.Event(), threading.Event()

    def cancel_two() -> int:
        with transaction.atomic():
            cancelled = Task.objects.filter(pk__in=ids[:2]).cancel()
            locked.set()
            assert go.wait(60)
        return cancelled

    operator_a = OnItsOwnConnection(cancel_two)
    operator_a.start()
    assert locked.wait(60)
    before = snapshot(ids)
    operator_b = OnItsOwnConnection(lambda: staff.post(ACTION, {"action": "run_now", "ids": ids}))
    operator_b.start()
    assert operator_b.ready.wait(60)
    wait_until(lambda: waits_for_a_lock(operator_b.pid), timeout=30)
    go.set()
    assert operator_a.outcome() == 2
    response = operator_b.outcome()
    assert response.status_code == 409
    body = response.content.decode()
    assert f"task {ids[0]} is Cancelled" in body and f"task {ids[1]} is Cancelled" in body
    assert "Nothing changed" in body
    after = snapshot(ids)
    assert after[2] == before[2], "the task that still fitted was run now by a refused request"
    assert [row[1] for row in after] == ["CANCELLED", "CANCELLED", "READY"]


@pytest.mark.django_db(transaction=True)
def test_two_operators_retrying_the_same_failed_tasks_requeue_each_once() -> None:
    """Both press Retry on the same failed tasks: one requeues them, the other waits on the row locks
    and is refused whole; every task is requeued once (its attempts reset once, not twice)."""
    ids = []
    for _ in range(2):
        task_id = Task.objects.enqueue(PATH, queue="ops2", max_attempts=1).id
        claimed = Task.objects.claim("w1", limit=1, queues=["ops2"], ttl=30)[0]
        assert claimed.id == task_id
        assert Task.objects.fail(Failure(claimed.id, claimed.token, "builtins.ValueError", "no", retry=False), "w1")
        ids.append(task_id)
    staff = Client()
    staff.force_login(StaffFactory.create())
    locked, go = threading.Event(), threading.Event()

    def retry_in_open_transaction() -> int:
        with transaction.atomic():
            requeued = Task.objects.filter(pk__in=ids, status="FAILED").requeue()
            locked.set()
            assert go.wait(60)
        return requeued

    operator_a = OnItsOwnConnection(retry_in_open_transaction)
    operator_a.start()
    assert locked.wait(60)
    operator_b = OnItsOwnConnection(lambda: staff.post(ACTION, {"action": "retry", "ids": ids}))
    operator_b.start()
    assert operator_b.ready.wait(60)
    wait_until(lambda: waits_for_a_lock(operator_b.pid), timeout=30)
    go.set()
    assert operator_a.outcome() == 2
    response = operator_b.outcome()
    assert response.status_code == 409 and "is Ready" in response.content.decode()
    assert [row[1] for row in snapshot(ids)] == ["READY", "READY"]


@pytest.mark.django_db
def test_a_button_drawn_before_its_task_moved_is_a_409_that_changes_nothing(staff: Client) -> None:
    ids = [Task.objects.enqueue(PATH, queue="stale").id for _ in range(2)]
    later(ids)
    page = staff.get("/dashboard/tasks/pending/")
    assert 'value="cancel"' in page.content.decode()  # the page offered Cancel for both
    # Between the page and the press, a worker claims one of them.
    Task.objects.filter(pk=ids[0]).update(run_after=timezone.now() - dt.timedelta(hours=2), priority=9)
    claimed = Task.objects.claim("w1", limit=1, queues=["stale"], ttl=30)
    assert [c.id for c in claimed] == [ids[0]]
    before = snapshot(ids)
    for action in ("run_now", "retry", "run_again"):
        response = staff.post(ACTION, {"action": action, "ids": ids})
        assert response.status_code == 409, action
    assert snapshot(ids) == before
    # Cancel fits a running task too (its worker loses it): that is a change, and it is whole.
    response = staff.post(ACTION, {"action": "cancel", "ids": ids})
    assert response.status_code == 302
    assert [row[1] for row in snapshot(ids)] == ["CANCELLED", "CANCELLED"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "form",
    [
        {"action": "delete"},
        {"action": "cancel; DROP TABLE tasks_task"},
        {"action": "CANCEL"},
        {"action": ["cancel", "run_now"]},
        {"action": "cancel", "ids": ["1 OR 1=1"]},
        {"action": "cancel", "ids": ["-1"]},
        {"action": "cancel", "ids": ["0"]},
        {"action": "cancel", "ids": ["99999999999999999999999"]},
        {"action": "cancel", "ids": ["1e3"]},
        {"action": "cancel", "ids": ["\x00"]},
        {"action": "cancel", "ids": [""]},
    ],
)
def test_a_forged_action_or_id_is_refused_and_changes_nothing(staff: Client, form: dict[str, Any]) -> None:
    ids = [Task.objects.enqueue(PATH, queue="forged").id for _ in range(2)]
    later(ids)
    before = snapshot(ids)
    data = {"ids": [str(i) for i in ids], **form}
    if "ids" in form:
        data["ids"] = [*form["ids"], *[str(i) for i in ids]]
    response = staff.post(ACTION, data)
    assert response.status_code in (400, 409), response.status_code
    if response.status_code == 400:
        assert response.content  # a page saying why
    assert snapshot(ids) == before


@pytest.mark.django_db
def test_an_action_without_its_csrf_token_is_refused(staff: Client) -> None:
    ids = [Task.objects.enqueue(PATH, queue="csrf").id]
    later(ids)
    before = snapshot(ids)
    forged = Client(enforce_csrf_checks=True)
    forged.force_login(StaffFactory.create())
    assert forged.post(ACTION, {"action": "cancel", "ids": ids}).status_code == 403
    assert snapshot(ids) == before
