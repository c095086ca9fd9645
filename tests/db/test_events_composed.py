"""Durable events and sleeps composed with a real worker (in a thread): idle workers, keyed, paused
and fair queues."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from tasks.models import QueueControl, Task
from tasks.steps import send_event
from tests.helpers import wait_until, worker_in_thread
from tests.testapp.models import Gate

pytestmark = pytest.mark.django_db(transaction=True)


def run_worker(worker_id: str, **options: Any) -> Any:
    from tasks.worker.process import Worker

    defaults = {"concurrency": 2, "ttl": 5, "poll_interval": 0.05, "install_signal_handlers": False}
    return Worker(worker_id=worker_id, **{**defaults, **options})


@pytest.fixture
def worker() -> Iterator[Any]:
    with worker_in_thread(run_worker("attack")) as running:
        yield running


def suspended(task_id: int, status: str = "READY") -> None:
    wait_until(Task.objects.filter(pk=task_id, status=status, snoozes=1).exists, 60, what=f"task {task_id} to suspend")


def done(task_id: int, ceiling: float = 60) -> Task:
    return wait_until(
        lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), ceiling, what=f"task {task_id} to succeed"
    )


def test_an_idle_worker_with_a_long_poll_runs_a_task_its_event_made_due_at_once() -> None:
    """A worker that LISTENs polls every POLL_INTERVAL (here 300 s) and is woken at once by NOTIFY:
    an enqueue runs within seconds. A send_event that made a waiting task due must too."""
    with worker_in_thread(run_worker("long-poll", poll_interval=300)):
        task_id = Task.objects.enqueue("tests.testapp.handlers.event_waiter", kwargs={"event": "go"}).id
        suspended(task_id)
        control = Task.objects.enqueue("tests.testapp.handlers.noop").id
        done(control, 60)  # an enqueue wakes the idle worker at once (NOTIFY)
        assert send_event(task_id, "go", 1)
        started = time.monotonic()
        try:
            done(task_id, 60)
        except AssertionError:
            raise AssertionError(
                "send_event made the task due (run_after <= now) but the idle worker was not woken: it"
                " runs only at the worker's next poll (POLL_INTERVAL)"
            ) from None
        print(f"ran {time.monotonic() - started:.2f}s after the send")


def test_a_keyed_task_waiting_for_its_event_gives_its_slot_back_and_is_admitted_by_the_send(worker: Any) -> None:
    waiter = Task.objects.enqueue(
        "tests.testapp.handlers.event_waiter", kwargs={"event": "go"}, concurrency_key="k", concurrency_limit=1
    ).id
    suspended(waiter, status="BLOCKED")
    other = Task.objects.enqueue("tests.testapp.handlers.noop", concurrency_key="k", concurrency_limit=1).id
    done(other)  # the waiter holds no slot
    holder = Task.objects.enqueue(
        "tests.testapp.handlers.block", kwargs={"gate": "hold"}, concurrency_key="k", concurrency_limit=1
    ).id
    wait_until(Task.objects.filter(pk=holder, status="RUNNING").exists, 60, what="the holder to run")
    assert send_event(waiter, "go", {"v": 1})
    task = Task.objects.get(pk=waiter)
    assert task.status == "BLOCKED", "the key is full: the woken waiter waits for the slot"
    Gate.objects.create(key="hold", open=True)
    done(holder)
    assert done(waiter).return_value == {"payload": {"v": 1}}


def test_a_waiting_task_in_a_paused_queue_stays_put_after_its_event_until_the_resume(worker: Any) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.event_waiter", kwargs={"event": "go"}, queue="default").id
    suspended(task_id)
    QueueControl.objects.pause("default")
    assert send_event(task_id, "go", 2)
    marker = Task.objects.enqueue("tests.testapp.handlers.noop", queue="other").id
    # the worker only claims "default" by default; the marker is not claimed. Observe the waiter
    # stays READY for as long as a claim of the paused queue has had the chance to run:
    other_worker_done = Task.objects.enqueue("tests.testapp.handlers.noop", queue="default").id
    assert Task.objects.filter(pk=other_worker_done, status="READY").exists()
    assert Task.objects.get(pk=task_id).status == "READY"
    QueueControl.objects.resume("default")
    assert done(task_id).return_value == {"payload": 2}
    done(other_worker_done)
    Task.objects.filter(pk=marker).cancel()


def test_a_fair_queue_s_waiting_task_runs_after_its_event(fair_queues: None) -> None:
    with worker_in_thread(run_worker("fair", queues=["fair"])):
        ids = [
            Task.objects.enqueue(
                "tests.testapp.handlers.event_waiter", kwargs={"event": "go"}, queue="fair", fair_key=f"t{i}"
            ).id
            for i in range(3)
        ]
        for task_id in ids:
            suspended(task_id)
        for n, task_id in enumerate(ids):
            assert send_event(task_id, "go", n)
        for n, task_id in enumerate(ids):
            assert done(task_id).return_value == {"payload": n}


# -- workflows, bulk operations ---------------------------------------------------------------------

from tasks import workflows  # noqa: E402
from tasks.exceptions import TaskError  # noqa: E402
from tasks.maintenance.bulk import BulkRunner  # noqa: E402
from tasks.maintenance.recovery import recover_once  # noqa: E402
from tasks.models import BulkOperation, Repair, TaskEvent  # noqa: E402


def test_a_chain_member_waiting_for_its_event_then_the_workflow_cancelled(worker: Any) -> None:
    flow = workflows.chain(
        workflows.step("tests.testapp.handlers.event_waiter", event="go"),
        workflows.step("tests.testapp.handlers.noop"),
        pipe=False,
    ).enqueue()
    first, second = flow.task_ids
    suspended(first)
    assert Task.objects.get(pk=second).status == "AWAITING"
    assert flow.cancel() >= 1
    assert set(Task.objects.filter(pk__in=flow.task_ids).values_list("status", flat=True)) == {"CANCELLED"}
    with pytest.raises(TaskError):
        send_event(first, "go")
    recover_once(repair=True)
    assert not Repair.objects.exists()


def test_an_event_sent_early_to_an_awaiting_chain_member_is_returned_when_it_runs(worker: Any) -> None:
    flow = workflows.chain(
        workflows.step("tests.testapp.handlers.block", gate="first"),
        workflows.step("tests.testapp.handlers.event_waiter", event="go"),
        pipe=False,
    ).enqueue()
    _first, second = flow.task_ids
    assert send_event(second, "go", "early")
    recover_once(repair=True)  # delivers it (AWAITING: nothing to wake)
    assert TaskEvent.objects.get(task_id=second).delivered
    Gate.objects.create(key="first", open=True)
    task = done(second)
    assert task.return_value == {"payload": "early"} and task.snoozes == 0
    recover_once(repair=True)
    assert not Repair.objects.exists()


def test_bulk_cancel_then_bulk_retry_of_waiting_tasks_resumes_them_at_their_waits(worker: Any) -> None:
    ids = [
        Task.objects.enqueue("tests.testapp.handlers.event_waiter", kwargs={"event": "go"}, queue="bulkq").id
        for _ in range(3)
    ]
    with worker_in_thread(run_worker("bulk", queues=["bulkq"])):
        for task_id in ids:
            suspended(task_id)
        BulkOperation.objects.request("cancel", {"queue": "bulkq"})
        BulkRunner().run_until_idle()
        assert set(Task.objects.filter(pk__in=ids).values_list("status", flat=True)) == {"CANCELLED"}
        BulkOperation.objects.request("retry", {"queue": "bulkq"})
        BulkRunner().run_until_idle()
        wait_until(
            lambda: (
                Task.objects.filter(pk__in=ids, status="READY", snoozes__gte=1, run_after__gt=timezone.now()).count()
                == 3
            ),
            60,
            what="all three to wait again",
        )
        for n, task_id in enumerate(ids):
            assert send_event(task_id, "go", n)
        for n, task_id in enumerate(ids):
            task = done(task_id)
            assert task.return_value == {"payload": n}
    from tests.testapp.models import Effect

    for task_id in ids:
        assert Effect.objects.filter(task_id=task_id, phase="before-event").count() == 1, (
            "the step before the wait ran twice"
        )
