"""Lease-guarded Celery tasks with a real Redis broker and real worker processes.

The broker redelivers any message not acknowledged within 2 s (the visibility timeout), so a body
that runs longer is delivered again while it still runs: the duplicate must not run it.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from typing import Any

import pytest

from leasing.celery import lease_key_for
from tests.celery.conftest import settled
from tests.helpers import wait_until
from tests.testapp.models import Effect, FencedRecord

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LONG_JOB = "tests.testapp.tasks.long_job"


def phases() -> Counter[str]:
    return Counter(Effect.objects.values_list("phase", flat=True))


def test_redelivered_message_does_not_run_the_body_twice(
    celery_app: Any, celery_workers: Any, redis_client: Any
) -> None:
    celery_workers("w1")
    celery_workers("w2")
    celery_app.send_task(LONG_JOB, kwargs={"job": "r1", "seconds": 6})
    wait_until(lambda: phases()["finished"] == 1, 60, what="the body to finish")
    wait_until(lambda: settled(redis_client) and phases()["held:done"] >= 1, 60, what="the duplicates to settle")
    counts = phases()
    assert counts["started"] == 1, counts
    assert counts["finished"] == 1, counts
    assert counts["held:deferred"] >= 1, "the broker should have redelivered the running message"


def test_skip_mode_acknowledges_duplicates_without_running(
    celery_app: Any, celery_workers: Any, redis_client: Any
) -> None:
    celery_workers("w1")
    celery_workers("w2")
    celery_app.send_task("tests.testapp.tasks.skipping_job", kwargs={"job": "s1", "seconds": 5})
    wait_until(lambda: phases()["finished"] == 1 and settled(redis_client), 60, what="the body to finish")
    counts = phases()
    assert (counts["started"], counts["finished"]) == (1, 1), counts
    assert counts["held:skipped"] >= 1, counts


def test_sigkilled_worker_message_runs_once_after_the_lease_expires(
    celery_app: Any, celery_workers: Any, redis_client: Any
) -> None:
    workers = {proc.pid: proc for proc in (celery_workers("w1"), celery_workers("w2"))}
    celery_app.send_task(LONG_JOB, kwargs={"job": "c1", "seconds": 4})
    first = wait_until(lambda: Effect.objects.filter(phase="started").first(), 60, what="the body to start")
    workers[first.pid].send_signal(signal.SIGKILL)
    workers[first.pid].wait(10)
    wait_until(lambda: phases()["finished"] == 1, 60, what="the redelivered message to run")
    wait_until(lambda: settled(redis_client), 60, what="the queue to settle")
    runs = list(Effect.objects.filter(phase__in=["started", "finished"]).values_list("phase", "pid", "token"))
    assert Counter(phase for phase, _, _ in runs) == {"started": 2, "finished": 1}
    survivor = next(pid for pid in workers if pid != first.pid)
    assert {pid for phase, pid, _ in runs if phase == "finished"} == {survivor}
    assert max(token for _, _, token in runs) > first.token  # a new grant, after the dead holder's expired


def test_stale_body_cannot_write_through_the_fence(celery_app: Any, celery_workers: Any, redis_client: Any) -> None:
    FencedRecord.objects.create(key="f1")
    workers = {proc.pid: proc for proc in (celery_workers("w1"), celery_workers("w2"))}
    celery_app.send_task(LONG_JOB, kwargs={"job": "f1", "seconds": 3, "record_key": "f1", "check": False})
    first = wait_until(lambda: Effect.objects.filter(phase="started").first(), 60, what="the body to start")
    os.kill(first.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: phases()["finished"] == 1, 60, what="another worker to run the body")
    finally:
        os.kill(first.pid, signal.SIGCONT)
    winner = Effect.objects.get(phase="finished")
    assert winner.pid != first.pid
    assert winner.token > first.token
    log = celery_workers.logs / "w1.log" if next(iter(workers)) == first.pid else celery_workers.logs / "w2.log"
    wait_until(lambda: "StaleTokenError" in log.read_text(), 60, what="the stale body's write to be refused")
    record = FencedRecord.objects.get(key="f1")
    assert (record.value, record.fence_token) == (f"pid {winner.pid}", winner.token)
    assert phases()["finished"] == 1


def test_lease_keys() -> None:
    assert lease_key_for("t", "order", (7,), {}, ["order", "force"]) == 'celery:t:{"order": 7}'
    assert lease_key_for("t", ["a", "b"], (), {"b": 2, "a": 1}, ["a", "b"]) == 'celery:t:{"a": 1, "b": 2}'
    assert lease_key_for("t", lambda order, **_: f"order-{order}", (7,), {}, ["order"]) == "celery:t:order-7"
    assert lease_key_for("t", None, (1,), {"x": 2}, ["y", "x"]) == 'celery:t:{"args": [1], "kwargs": {"x": 2}}'
    assert len(lease_key_for("t", None, ("x" * 500,), {}, ["y"])) < 80
    with pytest.raises(ValueError, match="not called with"):
        lease_key_for("t", "missing", (1,), {}, ["order"])


def test_beat_task_runs_one_recovery_round() -> None:
    import datetime as dt

    from django.utils import timezone

    from tasks.celery import recover_expired
    from tasks.models import Task

    task_id = Task.objects.enqueue("tests.testapp.handlers.noop").id
    Task.objects.claim("dead-worker", limit=1)
    Task.objects.filter(pk=task_id).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    result = recover_expired()
    assert result.pop("history_hours") > 0  # the history window's hours, counted (empty) the first time
    assert result == {
        "requeued": 1,
        "failed": 0,
        "orphans_expired": 0,
        "stray_leases_released": 0,
        "repaired": 0,
        "bulk_changed": 0,
        "keyless_adopted": 0,
        "archived": 0,  # the mover is off (ARCHIVE_AFTER unset)
        "errors": [],  # every duty ran
    }
    assert Task.objects.get(pk=task_id).status == "READY"
