"""Durable steps (tasks/steps.py): a step's result is stored with its writes in one transaction,
fenced by the attempt's lease; a later attempt gets it back without running the step again.

The attempts here are real claims of real rows, run in this process (an Execution set as the current
task, as an executor sets it); the stale attempt's step runs on a second thread with its own
connection, held inside its step while the test takes the task from it."""

from __future__ import annotations

import datetime as dt
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction
from django.utils import timezone

from leasing import clock
from tasks.exceptions import StepMismatch, TaskLeaseLost, UnstorableResult
from tasks.models import Task, TaskStep
from tasks.runtime import Execution, _set_current
from tasks.steps import astep, step, step_key
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "steps"


def attempt(task_id: int, worker: str) -> Execution:
    """Claim ``task_id`` for ``worker`` and begin its attempt as an executor does."""
    Task.objects.filter(pk=task_id).update(run_after=timezone.now() - dt.timedelta(hours=1))
    [claimed] = Task.objects.claim(worker, limit=1, queues=[QUEUE], ttl=30)
    assert claimed.id == task_id
    execution = Execution(claimed, worker, 30, clock.monotonic())
    started = Task.objects.start(task_id, worker, claimed.token)
    assert started is not None
    execution.begin(started)
    return execution


def take_away(task_id: int) -> None:
    """The attempt's lease lapses and recovery requeues the task (a new claim gets a new token)."""
    Task.objects.filter(pk=task_id).update(expires_at=timezone.now() - dt.timedelta(seconds=5))
    assert [r.id for r in Task.objects.recover_expired()] == [task_id]


@pytest.fixture
def task_id() -> int:
    return Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id


def effect(phase: str) -> dict[str, Any]:
    Effect.objects.create(task_id=0, token=0, attempt=0, phase=phase, pid=0)
    return {"phase": phase, "count": Effect.objects.filter(phase=phase).count()}


def test_a_later_attempt_gets_each_stored_step_back_without_running_it(task_id: int, current: None) -> None:
    first = attempt(task_id, "w1")
    _set_current(first)
    assert step("charge", effect, "charge") == {"phase": "charge", "count": 1}
    take_away(task_id)  # the attempt crashed after its first step
    second = attempt(task_id, "w2")
    _set_current(second)
    assert step("charge", effect, "charge") == {"phase": "charge", "count": 1}  # stored, not run
    assert step("ship", effect, "ship") == {"phase": "ship", "count": 1}
    assert Effect.objects.filter(phase="charge").count() == 1
    stored = list(TaskStep.objects.filter(task_id=task_id).values_list("position", "name", "attempt", "token"))
    assert stored == [(0, "charge", first.attempt, first.token), (1, "ship", second.attempt, second.token)]


def test_a_step_of_an_attempt_that_lost_the_task_is_rolled_back_with_its_writes(task_id: int) -> None:
    """The zombie: a worker inside a step while its lease lapses and another worker takes the task.
    Its step's row writes and its result go back together; it learns it lost the task."""
    stale = attempt(task_id, "w1")
    inside, release = threading.Event(), threading.Event()
    outcome: list[BaseException | Any] = []

    def paused(phase: str) -> dict[str, Any]:
        written = effect(phase)
        inside.set()
        assert release.wait(30)
        return written

    def run() -> None:
        _set_current(stale)
        try:
            outcome.append(step("charge", paused, "zombie"))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            _set_current(None)
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(30)
    take_away(task_id)
    fresh = attempt(task_id, "w2")
    release.set()
    thread.join(30)
    assert not thread.is_alive()
    [result] = outcome
    assert isinstance(result, TaskLeaseLost), result
    assert stale.lost
    assert not Effect.objects.filter(phase="zombie").exists()
    assert not TaskStep.objects.filter(task_id=task_id).exists()
    _set_current(fresh)
    try:
        assert step("charge", effect, "fresh") == {"phase": "fresh", "count": 1}
    finally:
        _set_current(None)
    assert list(TaskStep.objects.filter(task_id=task_id).values_list("token", flat=True)) == [fresh.token]


@pytest.mark.parametrize("taken", ["cancelled", "requeued", "taken over"])
def test_a_step_fenced_after_an_operator_took_the_task_is_rolled_back(task_id: int, taken: str) -> None:
    """Every way the row leaves the attempt (an operator's cancel or requeue, a new holder finishing
    it) ends the step the same way: nothing of it stays."""
    stale = attempt(task_id, "w1")
    _set_current(stale)
    try:

        def act(phase: str) -> dict[str, Any]:
            written = effect(phase)
            # On another connection, as an operator's request or another worker would.
            other = connections.create_connection("default")
            try:
                with other.cursor() as cursor:
                    if taken == "cancelled":
                        cursor.execute(
                            "UPDATE tasks_task SET status = 'CANCELLED', finished_at = now() WHERE id = %s", [task_id]
                        )
                    elif taken == "requeued":
                        cursor.execute(
                            "UPDATE tasks_task SET status = 'READY', holder = NULL, token = token + 1 WHERE id = %s",
                            [task_id],
                        )
                    else:
                        cursor.execute(
                            "UPDATE tasks_task SET holder = 'w2', token = token + 1,"
                            " expires_at = now() + interval '30 s' WHERE id = %s",
                            [task_id],
                        )
            finally:
                other.close()
            return written

        with pytest.raises(TaskLeaseLost):
            step("charge", act, taken)
    finally:
        _set_current(None)
    assert not Effect.objects.filter(phase=taken).exists()
    assert not TaskStep.objects.filter(task_id=task_id).exists()


def test_a_changed_sequence_of_steps_is_refused_naming_both(task_id: int, current: None) -> None:
    _set_current(attempt(task_id, "w1"))
    step("charge", effect, "charge")
    take_away(task_id)
    _set_current(attempt(task_id, "w2"))
    with pytest.raises(StepMismatch, match=r"'refund' at position 0.*'charge'"):
        step("refund", effect, "refund")
    assert not Effect.objects.filter(phase="refund").exists()


def test_an_unstorable_result_rolls_the_step_back(task_id: int, current: None) -> None:
    _set_current(attempt(task_id, "w1"))

    def unstorable() -> Any:
        effect("unstorable")
        return {"when": object()}

    with pytest.raises(UnstorableResult):
        step("charge", unstorable)
    assert not Effect.objects.filter(phase="unstorable").exists()
    assert not TaskStep.objects.exists()
    # the step was not recorded: the next call at its place runs it
    assert step("charge", effect, "charge") == {"phase": "charge", "count": 1}


def test_a_step_that_raises_is_not_recorded_and_runs_again_with_the_same_key(task_id: int, current: None) -> None:
    keys: list[str] = []

    def flaky(fail: bool) -> str:
        keys.append(step_key())
        effect("flaky")
        if fail:
            raise ConnectionError("the payment provider hung up")
        return "paid"

    _set_current(attempt(task_id, "w1"))
    with pytest.raises(ConnectionError):
        step("charge", flaky, True)
    take_away(task_id)
    _set_current(attempt(task_id, "w2"))
    assert step("charge", flaky, False) == "paid"
    assert keys == [f"task-{task_id}-step-0-charge"] * 2
    assert Effect.objects.filter(phase="flaky").count() == 1  # the failed try's write went back


def test_a_step_inside_an_open_transaction_is_refused(task_id: int, current: None) -> None:
    _set_current(attempt(task_id, "w1"))
    with transaction.atomic(), pytest.raises(RuntimeError, match="inside an open transaction"):
        step("charge", effect, "charge")
    assert not TaskStep.objects.exists()


def test_step_names_and_step_key_outside_a_step_are_refused(task_id: int, current: None) -> None:
    _set_current(attempt(task_id, "w1"))
    for name in ["", "x" * 201, None]:
        with pytest.raises(ValueError, match="a step's name"):
            step(name, effect, "x")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="only available inside a step"):
        step_key()
    _set_current(None)
    with pytest.raises(RuntimeError, match="only available inside a task"):
        step("charge", effect, "charge")


def test_a_step_from_async_code_is_fenced_and_stored_the_same(task_id: int, current: None) -> None:
    import asyncio

    execution = attempt(task_id, "w1")

    async def handler() -> Any:
        from concurrent.futures import ThreadPoolExecutor

        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))  # one database thread, as the worker's small pool
        _set_current(execution)
        try:
            first = await astep("charge", effect, "async")
            again = await astep("ship", effect, "async")
        finally:
            await loop.run_in_executor(None, connections.close_all)  # that thread's connection
        return first, again

    assert asyncio.run(handler()) == ({"phase": "async", "count": 1}, {"phase": "async", "count": 2})
    assert list(TaskStep.objects.filter(task_id=task_id).values_list("name", flat=True)) == ["charge", "ship"]


def test_the_fence_holds_the_task_row_until_the_step_commits(task_id: int) -> None:
    """Between the fence and the step's commit nothing can take the task: the statement's share lock
    on the row makes recovery's (and any operator's) update of it wait for the commit. Two real
    connections, the step's transaction held open after its fence."""
    from tasks.lifecycle import statements as sql

    execution = attempt(task_id, "w1")
    stepper = connections.create_connection("default")
    operator = connections.create_connection("default")
    try:
        stepper.set_autocommit(False)
        with stepper.cursor() as cursor:
            cursor.execute(
                sql.STEP_RECORD_SQL,
                {
                    "id": task_id,
                    "worker": "w1",
                    "token": execution.token,
                    "attempt": execution.attempt,
                    "position": 0,
                    "name": "charge",
                    "result": '"paid"',
                    "started_at": timezone.now(),
                },
            )
            assert cursor.fetchone() == (0,)
        with operator.cursor() as cursor:
            # the lock is held until the commit below, however long the wait: the verdict reads no clock
            cursor.execute("SET lock_timeout = '200ms'")
            for update in (
                "UPDATE tasks_task SET expires_at = now() - interval '5 s' WHERE id = %s",
                "UPDATE tasks_task SET status = 'CANCELLED', finished_at = now() WHERE id = %s",
            ):
                with pytest.raises(Exception, match="lock timeout"):
                    cursor.execute(update, [task_id])
        stepper.commit()
        with operator.cursor() as cursor:
            cursor.execute("UPDATE tasks_task SET expires_at = now() - interval '5 s' WHERE id = %s", [task_id])
            assert cursor.rowcount == 1
    finally:
        stepper.close()
        operator.close()
    assert list(TaskStep.objects.filter(task_id=task_id).values_list("name", "token")) == [("charge", execution.token)]


@pytest.fixture
def worker(settings: Any) -> Iterator[Any]:
    from tasks.worker.process import Worker
    from tests.helpers import worker_in_thread

    settings.LEASING_TASKS = {"BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05}
    running = Worker(concurrency=2, ttl=5, poll_interval=0.05, install_signal_handlers=False, worker_id="steps")
    with worker_in_thread(running):
        yield running


@pytest.mark.parametrize(
    ("path", "phases"),
    [
        ("tests.testapp.handlers.stepped", ("step-one", "step-two")),
        ("tests.testapp.handlers.async_stepped", ("astep-one", "astep-two")),
    ],
)
def test_a_worker_retries_a_task_from_its_first_step_not_done(worker: Any, path: str, phases: tuple[str, str]) -> None:
    from tests.helpers import wait_until

    task_id = Task.objects.enqueue(path, max_attempts=3).id
    task = wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 60, what="the task")
    one, two = phases
    assert task.attempts == 2
    assert task.return_value == [{"phase": one, "attempt": 1}, {"phase": two, "attempt": 2}]
    effects = sorted(Effect.objects.filter(task_id=task_id).values_list("phase", "attempt"))
    assert effects == [(one, 1), (two, 2)]


def test_a_django_task_s_steps_are_stored_the_same(worker: Any) -> None:
    from tests.helpers import wait_until
    from tests.testapp.handlers import stepped_django_task

    result = stepped_django_task.enqueue()
    task = wait_until(lambda: Task.objects.filter(pk=int(result.id), status="SUCCESSFUL").first(), 60, what="the task")
    assert [s["phase"] for s in task.return_value] == ["step-one", "step-two"]
    assert list(TaskStep.objects.filter(task_id=task.pk).values_list("name", "attempt")) == [("one", 1), ("two", 2)]


def test_the_task_page_lists_its_steps_in_order_redacted_as_its_arguments(
    task_id: int, current: None, staff: Any, settings: Any
) -> None:
    settings.LEASING_TASKS = {**getattr(settings, "LEASING_TASKS", {}), "REDACT_ARGUMENTS": ["card"]}
    first = attempt(task_id, "w1")
    _set_current(first)
    step("charge", lambda: {"payment": "pay-7", "card": {"number": "4242 4242 4242 4242"}})
    take_away(task_id)
    second = attempt(task_id, "w2")
    _set_current(second)
    step("charge", lambda: None)  # stored: not run
    step("ship", lambda: "parcel-7")
    page = staff.get(f"/dashboard/tasks/{task_id}/").content.decode()
    table = page.split('<table id="steps">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r'<tr data-step="(\d+)"><td>\d+</td><td class="mono">(.*?)</td><td>(\d+)</td>', table)
    assert [(position, re.sub("<wbr>", "", name), attempt) for position, name, attempt in rows] == [
        ("0", "charge", str(first.attempt)),
        ("1", "ship", str(second.attempt)),
    ]
    assert "pay-7" in table and "parcel-7" in table
    assert "4242" not in page and "[redacted]" in table


@pytest.mark.parametrize("returned", [float("nan"), {"total": float("inf")}])
def test_a_result_json_cannot_hold_rolls_the_step_back(task_id: int, current: None, returned: Any) -> None:
    _set_current(attempt(task_id, "w1"))

    def charge() -> Any:
        effect("nan")
        return returned

    with pytest.raises(UnstorableResult):
        step("charge", charge)
    assert not Effect.objects.filter(phase="nan").exists() and not TaskStep.objects.exists()


def test_a_base_exception_from_a_step_rolls_it_back_and_leaves_no_running_step(task_id: int, current: None) -> None:
    """Task code raising what is not an Exception (a KeyboardInterrupt, a SystemExit from a library):
    the step is not recorded, its writes go back, and step_key() is no longer the step's."""
    _set_current(attempt(task_id, "w1"))

    def interrupted() -> None:
        effect("interrupted")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        step("charge", interrupted)
    assert not Effect.objects.filter(phase="interrupted").exists() and not TaskStep.objects.exists()
    with pytest.raises(RuntimeError, match="only available inside a step"):
        step_key()
    assert step("charge", effect, "after") == {"phase": "after", "count": 1}  # the same position runs again
