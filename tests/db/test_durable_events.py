"""Durable events (tasks/steps.py ``wait_for_event``, ``await_event``, ``send_event``, and the JSON
API's ``POST /api/tasks/<id>/events``): a task suspends, unheld, until its event is sent or its
timeout passes; the first payload sent under a name is the one it gets; a task that had its event
sent while it ran is woken by the recovery round once it waits.

Verdicts are states and orders: the suspended task is READY and snoozed, its event made it due, the
steps before the wait ran once."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from tasks.exceptions import Snooze, TaskError, UnstorableResult
from tasks.lifecycle.policy import MAX_DELAY
from tasks.maintenance.recovery import recover_once, wake_for_events
from tasks.models import Task, TaskEvent, TaskStep
from tasks.runtime import _set_current
from tasks.steps import send_event, wait_for_event
from tests.db.test_steps import attempt
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "steps"


@pytest.fixture
def task_id() -> int:
    return Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id


def steps_of(task_id: int) -> list[str]:
    return list(TaskStep.objects.filter(task_id=task_id).order_by("position").values_list("name", flat=True))


def test_a_wait_without_its_event_snoozes_to_its_deadline_and_records_only_the_deadline(
    task_id: int, current: None
) -> None:
    _set_current(attempt(task_id, "w1"))
    with pytest.raises(Snooze) as snoozed:
        wait_for_event("paid", timeout=dt.timedelta(hours=1))
    assert 0 < snoozed.value.seconds <= 3600
    assert steps_of(task_id) == ["wait:paid"]
    other = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    _set_current(None)
    _set_current(attempt(other, "w2"))
    with pytest.raises(Snooze) as forever:
        wait_for_event("shipped")
    assert forever.value.seconds == MAX_DELAY, "no timeout: suspended until the event comes"


def attempt_again(task_id: int, worker: str = "w2") -> Any:
    _set_current(None)
    Task.objects.filter(pk=task_id).update(status="READY", expires_at=timezone.now() - dt.timedelta(seconds=5))
    return attempt(task_id, worker)


def test_an_event_sent_first_is_returned_and_stored_as_the_wait_s_step(task_id: int, current: None) -> None:
    assert send_event(task_id, "paid", {"amount": 12})
    assert not send_event(task_id, "paid", {"amount": 99}), "the first payload stands"
    _set_current(attempt(task_id, "w1"))
    assert wait_for_event("paid", timeout=60) == {"amount": 12}
    assert steps_of(task_id) == ["wait:paid", "event:paid"]
    # A later attempt gets the same payload back from its step, whatever was sent since.
    _set_current(attempt_again(task_id))
    assert wait_for_event("paid", timeout=60) == {"amount": 12}


def test_a_wait_past_its_deadline_returns_none_and_keeps_that_answer(task_id: int, current: None) -> None:
    _set_current(attempt(task_id, "w1"))
    assert wait_for_event("paid", timeout=0) is None
    assert TaskStep.objects.get(task_id=task_id, name="event:paid").result == {"timed_out": True}
    assert send_event(task_id, "paid", {"late": True})
    _set_current(attempt_again(task_id))
    assert wait_for_event("paid", timeout=0) is None, "a later attempt gets the timeout it recorded"


def test_sends_that_cannot_reach_a_task_are_refused_and_store_nothing(task_id: int) -> None:
    with pytest.raises(Task.DoesNotExist):
        send_event(task_id + 1000, "paid")
    with pytest.raises(UnstorableResult):
        send_event(task_id, "paid", math.nan)
    for name in ("", "   ", "x" * 151, 7):
        with pytest.raises(ValueError, match="event's name"):
            send_event(task_id, name)  # type: ignore[arg-type]
    Task.objects.filter(pk=task_id).cancel()
    with pytest.raises(TaskError, match="cancelled"):
        send_event(task_id, "paid")
    assert not TaskEvent.objects.exists()


def test_an_event_sent_while_the_task_ran_wakes_it_at_the_next_recovery_round(task_id: int, current: None) -> None:
    """The race the send cannot close alone: the attempt looked for the event and found none, the
    event is sent while the task is still RUNNING (nothing to make due), then the attempt's snooze
    puts it to sleep for an hour. The recovery round makes it due, once."""
    _set_current(attempt(task_id, "w1"))
    with pytest.raises(Snooze):
        wait_for_event("paid", timeout=3600)
    assert send_event(task_id, "paid", "yes")
    assert not TaskEvent.objects.get(task_id=task_id).delivered
    assert wake_for_events() == [], "still RUNNING: left for a later round"
    later = timezone.now() + dt.timedelta(hours=1)
    Task.objects.filter(pk=task_id).update(status="READY", run_after=later, snoozes=1)  # the snooze landed
    report = recover_once()
    assert report.woken_for_events == [task_id]
    assert Task.objects.get(pk=task_id).run_after <= timezone.now()
    assert TaskEvent.objects.get(task_id=task_id).delivered
    Task.objects.filter(pk=task_id).update(run_after=later)
    assert wake_for_events() == [], "woken once"


@pytest.fixture
def worker(settings: Any) -> Iterator[Any]:
    from tasks.worker.process import Worker
    from tests.helpers import worker_in_thread

    running = Worker(concurrency=1, ttl=5, poll_interval=0.05, install_signal_handlers=False, worker_id="events")
    with worker_in_thread(running):
        yield running


@pytest.mark.parametrize("path", ["tests.testapp.handlers.event_waiter", "tests.testapp.handlers.async_event_waiter"])
def test_a_worker_suspends_a_task_until_its_event_and_resumes_it_after_its_steps(worker: Any, path: str) -> None:
    task_id = Task.objects.enqueue(path, kwargs={"event": "approved"}).id
    waiting = Task.objects.filter(pk=task_id, status="READY", snoozes=1)
    wait_until(waiting.exists, 60, what="the task to suspend")
    behind = Task.objects.enqueue("tests.testapp.handlers.noop").id
    wait_until(Task.objects.filter(pk=behind, status="SUCCESSFUL").exists, 60, what="the task behind it")
    assert waiting.exists(), "it waits unheld: the task behind it ran on the worker's one slot"
    assert send_event(task_id, "approved", {"by": "ops"})
    task = wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 60, what="the task")
    assert task.return_value == {"payload": {"by": "ops"}}
    assert (task.attempts, task.snoozes) == (1, 1)
    assert sorted(Effect.objects.filter(task_id=task_id).values_list("phase", flat=True)) == [
        "after-event",
        "before-event",
    ]


def test_a_worker_resumes_a_task_whose_wait_timed_out_with_none(worker: Any) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.event_waiter", kwargs={"event": "never", "timeout": 0.2}).id
    task = wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 60, what="the task")
    assert task.return_value == {"payload": None}
    with pytest.raises(TaskError, match="successful"):
        send_event(task_id, "never")


def test_cancel_ends_a_waiting_task_and_its_event_is_refused_after(worker: Any, client: Any, api_token: None) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.event_waiter", kwargs={"event": "approved"}).id
    wait_until(Task.objects.filter(pk=task_id, status="READY", snoozes=1).exists, 60, what="the task to suspend")
    assert Task.objects.filter(pk=task_id).cancel() == 1
    status, body = Api(client).call("POST", f"/api/tasks/{task_id}/events", {"name": "approved"})
    assert status == 409, body
    assert not TaskEvent.objects.exists()
    assert not Effect.objects.filter(phase="after-event").exists()


def test_the_api_sends_an_event_once_and_refuses_what_it_cannot_store(
    client: Any, api_token: None, task_id: int
) -> None:
    api = Api(client)
    url = f"/api/tasks/{task_id}/events"
    assert api.call("POST", url, {"name": "paid", "payload": {"amount": 3}}) == (
        201,
        {"task_id": task_id, "event": "paid"},
    )
    status, body = api.call("POST", url, {"name": "paid", "payload": {"amount": 4}})
    assert (status, body["field"]) == (409, "name"), body
    for bad in ({}, {"name": ""}, {"name": "  "}, {"name": "x" * 151}, {"name": 3}, {"name": "a", "extra": 1}):
        status, body = api.call("POST", url, bad)
        assert status == 400, (bad, body)
    status, body = api.call("POST", url, raw='{"name": "n", "payload": NaN}')
    assert status == 400, body
    assert api.call("POST", f"/api/tasks/{task_id + 1000}/events", {"name": "paid"})[0] == 404
    assert list(TaskEvent.objects.values_list("name", "payload")) == [("paid", {"amount": 3})]


def test_the_how_to_s_checkout_waits_for_its_webhook_and_ships_once(worker: Any, rf: Any) -> None:
    """docs/howto/durable-steps.md's checkout, as written, on a real worker: it reserves and charges,
    suspends for the webhook, and ships once the webhook view (called as Django would) sends the event;
    a second delivery of the webhook changes nothing."""
    import json
    import re
    import sys
    import types

    from tests.helpers import ROOT

    page = ROOT / "docs" / "howto" / "durable-steps.md"
    pattern = r"<!-- tested: tests/db/test_durable_events.py[^>]*-->\n```python\n(.*?)```"
    [block] = re.findall(pattern, page.read_text(), re.S)
    calls: list[tuple[str, Any]] = []
    charged: list[dict[str, Any]] = []

    class Payments:
        def charge(self, order_id: int, idempotency_key: str, metadata: dict[str, Any]) -> str:
            charged.append({"key": idempotency_key, **metadata})
            return f"pay-{order_id}"

    module = types.ModuleType("checkout_doc_example")
    module.__dict__.update(
        payments=Payments(),
        reserve_stock=lambda order_id: calls.append(("reserve", order_id)),
        release_stock=lambda order_id: calls.append(("release", order_id)),
        ship=lambda order_id, payment: calls.append(("ship", payment)),
    )
    exec(compile(block, str(page), "exec"), module.__dict__)
    sys.modules[module.__name__] = module
    try:
        task_id = Task.objects.enqueue("checkout_doc_example.checkout", args=[5]).id
        wait_until(Task.objects.filter(pk=task_id, status="READY", snoozes=1).exists, 60, what="the wait")
        assert [c["task"] for c in charged] == [task_id]
        webhook = json.dumps({"payment": "pay-5", "metadata": {"task": task_id}})
        for _delivery in range(2):  # the provider delivers its webhook twice
            request = rf.post("/webhooks/payments", data=webhook, content_type="application/json")
            assert module.payment_webhook(request).status_code == 204
        task = wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 60, what="the task")
        assert task.return_value == "shipped"
        assert calls == [("reserve", 5), ("ship", "pay-5")]
        assert len(charged) == 1
    finally:
        del sys.modules[module.__name__]
