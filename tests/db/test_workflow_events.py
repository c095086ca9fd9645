"""An event to every unfinished member of a workflow (tasks/steps.py ``send_workflow_event``, the
handle's ``send_event``, ``POST /api/workflows/<id>/events``; issue 58): each member waiting for it
resumes, a running one reads it when it reaches its wait, a member that had one of the name keeps its
first payload, a finished one gets none; and beside the workflow's cancel, on two connections in
either order, neither waits forever and no cancelled member runs on."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from tasks.lifecycle.workflows import WorkflowStatus
from tasks.models import Task, TaskEvent, Workflow
from tasks.steps import send_event, send_workflow_event
from tasks.workflows import EnqueuedWorkflow, group, step
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

WAITER = "tests.testapp.handlers.event_waiter"


@pytest.fixture
def worker(settings: Any) -> Iterator[Any]:
    from tasks.worker.process import Worker
    from tests.helpers import worker_in_thread

    running = Worker(concurrency=2, ttl=5, poll_interval=0.05, install_signal_handlers=False, worker_id="wf-events")
    with worker_in_thread(running):
        yield running


def waiting_group(n: int, event: str = "go") -> EnqueuedWorkflow:
    return group([step(WAITER, event=event) for _ in range(n)], name="waiters").enqueue()


def suspended(ids: list[int]) -> bool:
    return Task.objects.filter(pk__in=ids, status="READY", snoozes=1).count() == len(ids)


def test_every_waiting_member_resumes_with_the_payload_and_the_workflow_ends(worker: Any) -> None:
    flow = waiting_group(3)
    wait_until(lambda: suspended(flow.task_ids), 60, what="the three members to suspend")
    assert flow.send_event("go", {"by": "ops"}) == sorted(flow.task_ids)
    wait_until(lambda: flow.refresh().status == WorkflowStatus.SUCCESSFUL, 60, what="the workflow to end")
    for task in Task.objects.filter(pk__in=flow.task_ids):
        assert task.return_value == {"payload": {"by": "ops"}}
        assert (task.attempts, task.snoozes) == (1, 1)
    assert Effect.objects.filter(phase="after-event").count() == 3
    # Ended: nothing left to reach.
    assert send_workflow_event(flow.id, "go") == []


def test_a_member_that_had_the_event_keeps_its_payload_and_a_finished_one_gets_none() -> None:
    flow = group([step("tests.testapp.handlers.noop") for _ in range(4)], name="mixed").enqueue()
    first, second, done, cancelled = flow.task_ids
    assert send_event(first, "go", {"n": 1})
    Task.objects.filter(pk=done).update(status="SUCCESSFUL", finished_at=timezone.now())
    assert Task.objects.filter(pk=cancelled).cancel() == 1
    later = timezone.now() + dt.timedelta(hours=1)
    Task.objects.filter(pk=second).update(run_after=later)  # not waiting for this event: left where it is
    assert send_workflow_event(flow.id, "go", {"n": 2}) == [second]
    assert dict(TaskEvent.objects.values_list("task_id", "payload")) == {first: {"n": 1}, second: {"n": 2}}
    assert Task.objects.get(pk=second).run_after == later
    with pytest.raises(Workflow.DoesNotExist):
        send_workflow_event(flow.id + 1000, "go")
    with pytest.raises(ValueError, match="event"):
        send_workflow_event(flow.id, " ")
    assert TaskEvent.objects.count() == 2


def test_a_send_that_meets_a_cancel_in_flight_waits_for_it_and_reaches_no_member() -> None:
    flow = waiting_group(3)
    cancel_holds, release = threading.Event(), threading.Event()

    def cancel() -> int:
        with transaction.atomic():
            cancelled = Workflow.objects.filter(pk=flow.id).cancel()
            cancel_holds.set()
            assert release.wait(60)
        return cancelled

    canceller = OnItsOwnConnection(cancel)
    canceller.start()
    assert cancel_holds.wait(60)
    sender = OnItsOwnConnection(lambda: send_workflow_event(flow.id, "go"))
    sender.start()
    sender.ready.wait(60)
    wait_until(lambda: waits_for_a_lock(sender.pid), 60, what="the send to wait for the cancel's locks")
    release.set()
    assert canceller.outcome() == 3
    assert sender.outcome() == [], "every member was cancelled before the send read it"
    assert not TaskEvent.objects.exists()
    assert flow.refresh().status == WorkflowStatus.CANCELLED


def test_a_cancel_that_meets_a_send_in_flight_waits_for_it_and_cancels_every_member() -> None:
    flow = waiting_group(3)
    send_holds, release = threading.Event(), threading.Event()

    def send() -> list[int]:
        with transaction.atomic():
            stored = send_workflow_event(flow.id, "go", {"k": 1})
            send_holds.set()
            assert release.wait(60)
        return stored

    sender = OnItsOwnConnection(send)
    sender.start()
    assert send_holds.wait(60)
    canceller = OnItsOwnConnection(lambda: Workflow.objects.filter(pk=flow.id).cancel())
    canceller.start()
    canceller.ready.wait(60)
    wait_until(lambda: waits_for_a_lock(canceller.pid), 60, what="the cancel to wait for the send's locks")
    release.set()
    assert sender.outcome() == sorted(flow.task_ids)
    assert canceller.outcome() == 3
    assert set(Task.objects.filter(pk__in=flow.task_ids).values_list("status", flat=True)) == {"CANCELLED"}
    assert flow.refresh().status == WorkflowStatus.CANCELLED
    assert TaskEvent.objects.count() == 3  # stored before the cancel; no cancelled task reads them


def test_the_api_sends_to_a_workflow_and_refuses_what_it_cannot_store(client: Any, api_token: None) -> None:
    api = Api(client)
    flow = group([step("tests.testapp.handlers.noop") for _ in range(2)], name="api").enqueue()
    url = f"/api/workflows/{flow.id}/events"
    for bad in ({}, {"name": ""}, {"name": "x" * 151}, {"name": 3}, {"name": "a", "extra": 1}):
        status, body = api.call("POST", url, bad)
        assert status == 400, (bad, body)
    status, body = api.call("POST", url, raw='{"name": "n", "payload": NaN}')
    assert status == 400, body
    assert api.call("POST", f"/api/workflows/{flow.id + 1000}/events", {"name": "paid"})[0] == 404
    assert not TaskEvent.objects.exists(), "a refused request stores nothing"
    assert api.call("POST", url, {"name": "paid", "payload": {"amount": 3}}) == (
        201,
        {"workflow_id": flow.id, "event": "paid", "task_ids": sorted(flow.task_ids)},
    )
    status, body = api.call("POST", url, {"name": "paid", "payload": {"amount": 4}})
    assert status == 409 and "first payload" in body["error"], body
    assert sorted(TaskEvent.objects.values_list("task_id", "payload")) == [
        (task_id, {"amount": 3}) for task_id in sorted(flow.task_ids)
    ]
