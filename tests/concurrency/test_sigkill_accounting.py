"""What a SIGKILL leaves behind, by a real worker process draining short tasks: an attempt whose
handler may have run is never recorded as never started (invariant 14), and what the kill sends to
be run again is bounded (docs/explanation/fault-model.md, "Attempt accounting").

Each handler commits a side effect (an ``Effect`` row with its attempt's token) before it returns, so
the test knows which attempts of the killed worker really ran. Waits poll the database; nothing
sleeps to synchronise.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from typing import Any

import pytest

from tasks.models import Task, TaskStatus
from tests.helpers import wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

TASKS = 1500  # the kill comes after 300: the rest are still queued, by far
CONCURRENCY = 8
BATCH = 8


def kill_mid_drain(workers: Workers, name: str, *args: str) -> int:
    """Start ``name``, SIGKILL it once it has finished a few hundred tasks; returns its pid."""
    proc = workers.start(name, *args)
    done_before = Task.objects.filter(status=TaskStatus.SUCCESSFUL).count()
    wait_until(
        lambda: Task.objects.filter(status=TaskStatus.SUCCESSFUL).count() >= done_before + 300,
        60,
        what=f"{name} to finish 300 tasks",
    )
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    return proc.pid


def recovery_entries(worker_id: str) -> dict[int, dict[str, Any]]:
    """Run recovery until nothing the killed worker held is RUNNING; the recovery entry of each
    attempt it held (task id -> entry). Read once recovery is done, not at the kill: a statement the
    worker sent just before it died still commits (the server runs it to the end), and recovery
    waits for the lease, longer than any of them."""

    def recovered() -> bool:
        Task.objects.recover_expired()
        return not Task.objects.filter(status=TaskStatus.RUNNING, holder=worker_id).exists()

    wait_until(recovered, 30, interval=0.2, what="recovery of the killed worker's attempts")
    entries = {}
    for task in Task.objects.filter(errors__contains=[{"worker": worker_id}]):
        [entry] = [e for e in task.errors if e.get("worker") == worker_id]
        entries[task.id] = entry
    return entries


def test_a_sigkill_records_every_attempt_that_ran_as_a_crash_and_reruns_a_bounded_few(workers: Workers) -> None:
    ids = Task.objects.bulk_enqueue("tests.testapp.handlers.record", [{}] * TASKS)
    pid = kill_mid_drain(workers, "doomed", "--concurrency", str(CONCURRENCY), "--batch-size", str(BATCH))
    entries = recovery_entries(workers.ids["doomed"])
    assert entries, "the kill found the worker holding nothing"
    held = {task_id: entry["token"] for task_id, entry in entries.items()}
    ran = set(Effect.objects.filter(pid=pid, task_id__in=held).values_list("task_id", "token"))
    ran_held = {task_id for task_id, token in ran if held[task_id] == token}

    kinds = Counter(entry["kind"] for entry in entries.values())
    # Invariant 14: an attempt whose handler committed its side effect is recorded as the crash of
    # an attempt (charged: counted in ``attempts``, its worker in ``worker_ids``), never as a claim
    # returned unstarted.
    wrongly_unstarted = sorted(t for t in ran_held if entries[t]["kind"] == "returned")
    assert not wrongly_unstarted, (
        f"{len(wrongly_unstarted)} of the {len(ran_held)} attempts that ran were recorded as never started "
        f"(recovered: {dict(kinds)})"
    )
    for task in Task.objects.filter(pk__in=ran_held):
        assert task.unstarted_returns == 0
        assert task.attempts == 1, (task.id, task.attempts)
        assert task.worker_ids[-1] == workers.ids["doomed"]
        assert entries[task.id]["attempt"] == 1
    # Invariant 10 the other way round: what is returned uncharged had not been handed to a handler.
    returned = {t for t, entry in entries.items() if entry["kind"] == "returned"}
    assert not returned & ran_held
    for task in Task.objects.filter(pk__in=returned):
        assert (task.attempts, task.unstarted_returns) == (0, 1)

    # The bound: a kill runs again only what its executors had been handed (docs/explanation/fault-model.md):
    # the attempts running, and the handed ones whose outcome had not been written yet.
    charged = {t for t, entry in entries.items() if entry["kind"] in ("crash", "vanished")}
    assert ran_held <= charged
    assert len(charged) <= CONCURRENCY + 2 * BATCH, (len(charged), dict(kinds))

    rescuer = workers.start("rescuer", "--concurrency", str(CONCURRENCY), "--batch-size", str(BATCH))
    wait_until(
        lambda: not Task.objects.filter(pk__in=ids).exclude(status=TaskStatus.SUCCESSFUL).exists(),
        120,
        what="the rest of the queue to drain",
    )
    assert rescuer.poll() is None
    runs = Counter(Effect.objects.filter(task_id__in=ids).values_list("task_id", flat=True))
    assert set(runs) == set(ids)
    rerun = {task_id for task_id, n in runs.items() if n > 1}
    assert rerun == ran_held  # only the attempts of the killed worker whose outcome was not written
    # Every run of a task is counted in its attempts (one more only where a handed attempt had not begun).
    for task in Task.objects.filter(pk__in=ids).only("id", "attempts"):
        assert task.attempts >= runs[task.id], (task.id, task.attempts, runs[task.id])
    print(f"held {len(held)}, ran {len(ran_held)}, recovered {dict(kinds)}")
