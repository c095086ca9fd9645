"""The operator's cancel (CANCEL_SET, one ORM UPDATE) interleaved with the worker's own end of the same
attempt on two real connections, each order: the first holds the row in an open transaction, the
second's statement is seen waiting on its lock (pg_locks), then the first commits. Whoever wins, the
row is final once, the loser changes nothing, the attempts table shows one outcome per attempt, and the
capped error list and ``errors_dropped`` are exact, on rows with 9, 10 and 30 prior failures (0, 1
and 20 entries dropped before the race)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, connections, transaction

from tasks.lifecycle.fragments import MAX_ERRORS
from tasks.models import Failure, Task
from tests.db.test_attempt_history_attacks import QUEUE, claim, end, table
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "tests.testapp.handlers.noop"
WORKER = "racer"

#: The worker's end of the attempt (task id, token) -> whether it landed, and what it leaves when it
#: does, the operator's cancel coming second: (status, entry kinds appended by the worker, cancel count).
ENDS: dict[str, tuple[Callable[[int, int], Any], str, list[str], int]] = {
    "complete": (lambda i, t: Task.objects.complete(i, WORKER, t, {"ok": True}), "SUCCESSFUL", [], 0),
    "fail-retried": (
        lambda i, t: Task.objects.fail(Failure(i, t, "builtins.RuntimeError", "again", "", delay=3600), WORKER),
        "CANCELLED",
        ["failure"],
        1,
    ),
    "fail-final": (
        lambda i, t: Task.objects.fail(Failure(i, t, "builtins.RuntimeError", "last", "", retry=False), WORKER),
        "FAILED",
        ["failure"],
        0,
    ),
    "handler-cancel": (
        lambda i, t: Task.objects.fail(Failure(i, t, "tasks.exceptions.Cancel", "mine", "", kind="cancel"), WORKER),
        "CANCELLED",
        ["cancel"],
        0,
    ),
    "snooze": (
        lambda i, t: Task.objects.fail(
            Failure(i, t, "builtins.RuntimeError", "nap", "", kind="snooze", delay=3600), WORKER
        ),
        "CANCELLED",
        [],
        1,
    ),
    "hand-back": (lambda i, t: Task.objects.hand_back(WORKER, [(i, t)]), "CANCELLED", ["shutdown"], 1),
}


def waiting_on_a_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT FROM pg_locks WHERE pid = %s AND NOT granted)", [pid])
        return bool(cursor.fetchone()[0])


def second(action: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``action`` on a thread (its own connection); returns once it waits on a lock."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                result["pid"] = cursor.fetchone()[0]
            result["value"] = action()
        except BaseException as exc:  # reported by the test
            result["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: "pid" in result or "error" in result, what="the second connection")
    wait_until(lambda: waiting_on_a_lock(result["pid"]) or not thread.is_alive(), what="the lock wait")
    result["waited"] = thread.is_alive()
    return thread, result


def prepared(prior: int) -> tuple[int, int]:
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=prior + 5).id
    for number in range(prior):
        end(task_id, f"w{number}", f"failure {number + 1}")
    return task_id, claim(task_id, WORKER)


@pytest.mark.parametrize("prior", [9, 10, 30])
@pytest.mark.parametrize("worker_end", list(ENDS))
@pytest.mark.parametrize("first", ["cancel", "worker"])
def test_cancel_and_the_workers_end_race_in_either_order(first: str, worker_end: str, prior: int) -> None:
    task_id, token = prepared(prior)
    before = Task.objects.get(pk=task_id)
    assert (len(before.errors), before.errors_dropped) == (min(prior, MAX_ERRORS), max(prior - MAX_ERRORS, 0))
    act, status, kinds, cancels = ENDS[worker_end]

    def cancel() -> int:
        return Task.objects.filter(kwargs={}, queue=QUEUE, pk=task_id).cancel()

    def finish() -> Any:
        return act(task_id, token)

    with transaction.atomic():
        won = cancel() if first == "cancel" else finish()
        thread, result = second(finish if first == "cancel" else cancel)
    thread.join(30)
    assert result["waited"] and not thread.is_alive() and "error" not in result, result
    after = Task.objects.get(pk=task_id)
    appended = [e["kind"] for e in after.errors[len(before.errors) :]] if len(before.errors) < MAX_ERRORS else None
    if first == "cancel":
        assert won == 1 and not result["value"]  # the worker's late end is refused
        assert after.status == "CANCELLED" and after.errors[-1]["kind"] == "cancel"
        expected_kinds = ["cancel"]
    else:
        assert won and result["value"] == cancels
        assert after.status == status
        expected_kinds = kinds
    entries = min(prior, MAX_ERRORS) + len(expected_kinds)
    assert len(after.errors) == min(entries, MAX_ERRORS)
    assert after.errors_dropped == prior + len(expected_kinds) - min(entries, MAX_ERRORS)
    if appended is not None:
        assert appended == expected_kinds
    elif expected_kinds:
        assert [e["kind"] for e in after.errors[-len(expected_kinds) :]] == expected_kinds
    assert after.errors[0]["message"] == "failure 1"  # the first entry is kept
    numbers = [number for number, _, _ in table(task_id)]
    assert numbers == sorted(set(numbers))  # one outcome per attempt
    # Final once: a second cancel changes nothing.
    assert Task.objects.filter(pk=task_id).cancel() == (0 if after.status != "READY" else 1)
