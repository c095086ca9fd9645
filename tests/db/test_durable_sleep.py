"""Durable sleeps (tasks/steps.py ``sleep``, ``sleep_until``, ``asleep``): the wake time is a step's
stored result on the database clock, the attempt that reaches it ends as a snooze until then (no
worker slot, connection or lease held meanwhile, no attempt charged), and the attempt that runs after
it gets the steps before it back stored.

Each verdict is an order or a state: the run after the sleep began at or after the stored wake time
(both read on the database clock), a task queued behind a sleeping one on a worker of one slot runs
while the sleeper waits."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from tasks.exceptions import Snooze, StepMismatch
from tasks.models import Task, TaskStep
from tasks.runtime import _set_current
from tasks.steps import sleep, sleep_until, step
from tests.db.test_steps import attempt, effect
from tests.helpers import wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "steps"


@pytest.fixture
def task_id() -> int:
    return Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id


def wake_of(task_id: int, name: str = "nap") -> dt.datetime:
    (stored,) = TaskStep.objects.filter(task_id=task_id, name=name).values_list("result", flat=True)
    return dt.datetime.fromisoformat(stored)


def test_a_sleep_stores_its_wake_on_the_database_clock_and_snoozes_until_it(task_id: int, current: None) -> None:
    execution = attempt(task_id, "w1")
    _set_current(execution)
    step("before", effect, "before")
    before = timezone.now()
    with pytest.raises(Snooze) as snoozed:
        sleep(dt.timedelta(hours=2), name="nap")
    after = timezone.now()
    assert 0 < snoozed.value.seconds <= 7200
    # The stored wake is two hours after a clock reading taken between the two of this process (the
    # test's database runs on this machine's clock; a second either way for its rounding).
    wake = wake_of(task_id)
    assert before + dt.timedelta(hours=2, seconds=-1) <= wake <= after + dt.timedelta(hours=2, seconds=1)
    assert list(TaskStep.objects.filter(task_id=task_id).order_by("position").values_list("name", flat=True)) == [
        "before",
        "nap",
    ]


def test_a_sleep_already_past_goes_on_without_a_snooze(task_id: int, current: None) -> None:
    _set_current(attempt(task_id, "w1"))
    sleep(0, name="zero")
    sleep_until(timezone.now() - dt.timedelta(days=1), name="yesterday")
    assert step("after", effect, "after") == {"phase": "after", "count": 1}
    assert list(TaskStep.objects.filter(task_id=task_id).values_list("name", flat=True).order_by("position")) == [
        "zero",
        "yesterday",
        "after",
    ]


@pytest.mark.parametrize(
    "call",
    [
        lambda: sleep(-1),
        lambda: sleep(math.nan),
        lambda: sleep(math.inf),
        lambda: sleep("60"),  # type: ignore[arg-type]
        lambda: sleep(400 * 24 * 3600),
        lambda: sleep_until(dt.datetime(2030, 1, 1)),  # naive: whose midnight?
        lambda: sleep_until(timezone.now() + dt.timedelta(days=400)),
        lambda: sleep_until("tomorrow"),  # type: ignore[arg-type]
    ],
    ids=["negative", "nan", "infinite", "string", "past-a-year", "naive", "until-past-a-year", "until-string"],
)
def test_a_sleep_no_database_can_keep_is_refused_and_stores_nothing(task_id: int, current: None, call: Any) -> None:
    _set_current(attempt(task_id, "w1"))
    with pytest.raises(ValueError, match="sleep"):
        call()
    assert not TaskStep.objects.filter(task_id=task_id).exists()


def test_a_sleep_where_an_earlier_attempt_recorded_a_step_is_a_mismatch(task_id: int, current: None) -> None:
    _set_current(attempt(task_id, "w1"))
    step("charge", effect, "charge")
    _set_current(None)
    Task.objects.filter(pk=task_id).update(status="READY", expires_at=timezone.now() - dt.timedelta(seconds=5))
    _set_current(attempt(task_id, "w2"))
    with pytest.raises(StepMismatch, match=r"'sleep'.*'charge'"):
        sleep(60)


@pytest.fixture
def worker(settings: Any) -> Iterator[Any]:
    from tasks.worker.process import Worker
    from tests.helpers import worker_in_thread

    running = Worker(concurrency=1, ttl=5, poll_interval=0.05, install_signal_handlers=False, worker_id="sleeps")
    with worker_in_thread(running):
        yield running


@pytest.mark.parametrize(
    ("path", "phases"),
    [
        ("tests.testapp.handlers.sleeper", ("before-sleep", "after-sleep")),
        ("tests.testapp.handlers.async_sleeper", ("abefore-sleep", "aafter-sleep")),
    ],
)
def test_a_worker_runs_a_sleeping_task_again_after_its_wake_and_not_its_steps_before(
    worker: Any, path: str, phases: tuple[str, str]
) -> None:
    task_id = Task.objects.enqueue(path, kwargs={"seconds": 0.5}).id
    task = wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 60, what="the task")
    before, after = phases
    assert (task.attempts, task.snoozes, task.failures) == (1, 1, 0), "the sleep is not charged as an attempt"
    assert task.return_value == [{"phase": before, "attempt": 1}, {"phase": after, "attempt": 1}]
    assert sorted(Effect.objects.filter(task_id=task_id).values_list("phase", flat=True)) == [after, before]
    assert task.last_attempted_at >= wake_of(task_id), "the run after the sleep began at its wake or later"


def test_a_sleeping_task_holds_no_slot_of_its_worker(worker: Any) -> None:
    """A worker of one slot: the task queued behind an hour's sleeper runs, while the sleeper waits
    unheld for its wake (had the sleep held the slot, the second task would never start)."""
    sleeping = Task.objects.enqueue("tests.testapp.handlers.sleeper", kwargs={"seconds": 3600}).id
    wait_until(lambda: TaskStep.objects.filter(task_id=sleeping, name="nap").exists(), 60, what="the sleep")
    behind = Task.objects.enqueue("tests.testapp.handlers.noop").id
    wait_until(lambda: Task.objects.filter(pk=behind, status="SUCCESSFUL").exists(), 60, what="the task behind")
    row = Task.objects.get(pk=sleeping)
    assert (row.status, row.snoozes, row.attempts) == ("READY", 1, 0)
    assert row.run_after >= wake_of(sleeping)
    assert row.expires_at is not None and row.expires_at <= timezone.now(), "its lease was given back"


def test_a_sleeping_task_cancelled_or_run_now_keeps_its_steps_and_its_wake(worker: Any) -> None:
    """An operator's "run now" of a sleeping task runs it at once: its steps before the sleep come
    back stored and it sleeps again until the same wake (the wake is the code's promise); a cancel
    ends it unrun."""
    napping = [Task.objects.enqueue("tests.testapp.handlers.sleeper", kwargs={"seconds": 3600}).id for _ in range(2)]
    asleep = Task.objects.filter(pk__in=napping, snoozes=1, status="READY")
    wait_until(lambda: asleep.count() == 2, 60, what="both sleeps")
    woken, cancelled = napping
    wake = wake_of(woken)
    assert Task.objects.filter(pk=woken).retry_now() == 1
    wait_until(lambda: Task.objects.filter(pk=woken, snoozes=2, status="READY").exists(), 60, what="a second sleep")
    assert wake_of(woken) == wake
    assert Task.objects.get(pk=woken).run_after >= wake
    assert Effect.objects.filter(task_id=woken, phase="before-sleep").count() == 1
    assert Task.objects.filter(pk=cancelled).cancel() == 1
    assert Task.objects.get(pk=cancelled).status == "CANCELLED"
    assert not Effect.objects.filter(phase="after-sleep").exists()


def test_the_how_to_s_onboarding_sleeps_three_days_and_sends_each_message_once(worker: Any) -> None:
    """docs/howto/durable-steps.md's sleep block, as written, on a real worker: the welcome is sent,
    the task sleeps three days unheld; its wake moved into the past (three days gone by), it sends the
    tips and not the welcome again."""
    import re
    import sys
    import types

    from tests.helpers import ROOT

    page = ROOT / "docs" / "howto" / "durable-steps.md"
    [block] = re.findall(
        r"<!-- tested: tests/db/test_durable_sleep.py[^>]*-->\n```python\n(.*?)```", page.read_text(), re.S
    )
    sent: list[tuple[str, int]] = []
    module = types.ModuleType("sleep_doc_example")
    module.__dict__.update(
        send_welcome=lambda user_id: sent.append(("welcome", user_id)),
        send_tips=lambda user_id: sent.append(("tips", user_id)),
    )
    exec(compile(block, str(page), "exec"), module.__dict__)
    sys.modules[module.__name__] = module
    try:
        task_id = Task.objects.enqueue("sleep_doc_example.onboard", args=[7]).id
        wait_until(lambda: Task.objects.filter(pk=task_id, snoozes=1, status="READY").exists(), 60, what="the sleep")
        row = Task.objects.get(pk=task_id)
        wake = wake_of(task_id, "sleep")
        assert dt.timedelta(days=3) - dt.timedelta(seconds=5) <= wake - row.snoozed_at <= dt.timedelta(days=3)
        assert sent == [("welcome", 7)]
        past = wake - dt.timedelta(days=3, seconds=1)
        TaskStep.objects.filter(task_id=task_id, name="sleep").update(result=past.isoformat())
        Task.objects.filter(pk=task_id).update(run_after=past)
        wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").exists(), 60, what="the wake")
        assert sent == [("welcome", 7), ("tips", 7)]
    finally:
        del sys.modules[module.__name__]
