"""Concurrency keys with real worker processes: the limit holds on the database's clock across
workers, other work keeps flowing past a full key, and every way out of RUNNING (success, failure
and retry, cancel, hand-back on shutdown, SIGKILL and recovery) gives the slot back."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
from django.db import connections

from tasks.models import Task, TaskStatus
from tests.helpers import stop_process, wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

FAST = ["--ttl", "1", "--recovery-interval", "0.2", "--poll-interval", "0.2"]
SPAN = "tests.testapp.handlers.span"


class Sampler(threading.Thread):
    """Reads, from its own connection and as fast as it can, how many tasks of ``key`` are RUNNING
    and how many hold a slot (READY or RUNNING): the database's truth, not the workers' view."""

    def __init__(self, key: str) -> None:
        super().__init__(daemon=True)
        self.key = key
        self.stopped = threading.Event()
        self.max_running = 0
        self.max_admitted = 0
        self.samples = 0

    def run(self) -> None:
        try:
            with connections["default"].cursor() as cursor:
                while not self.stopped.is_set():
                    cursor.execute(
                        "SELECT count(*) FILTER (WHERE status = 'RUNNING'), count(*) FROM tasks_task"
                        " WHERE concurrency_key = %s AND status IN ('READY', 'RUNNING')",
                        [self.key],
                    )
                    running, admitted = cursor.fetchone()
                    self.max_running = max(self.max_running, running)
                    self.max_admitted = max(self.max_admitted, admitted)
                    self.samples += 1
        finally:
            connections["default"].close()

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.join(10)


def max_overlap(key: str) -> int:
    """The most attempts of ``key`` that were between their start and end marks at one instant of the
    database clock (a start at the very instant of another's end does not overlap it)."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            """
            SELECT COALESCE(max(running), 0) FROM (
                SELECT sum(CASE WHEN e.phase = 'started' THEN 1 ELSE -1 END)
                       OVER (ORDER BY e.created_at, e.phase = 'started', e.id ROWS UNBOUNDED PRECEDING) AS running
                FROM testapp_effect AS e JOIN tasks_task AS t ON t.id = e.task_id
                WHERE t.concurrency_key = %s
            ) AS steps
            """,
            [key],
        )
        return cursor.fetchone()[0]


def keyed(n: int, key: str, limit: int, **kwargs: Any) -> list[int]:
    return Task.objects.bulk_enqueue(SPAN, [kwargs] * n, concurrency_key=key, concurrency_limit=limit, priority=10)


def all_finished(ids: list[int]) -> bool:
    return not Task.objects.filter(pk__in=ids).exclude(status__in=["SUCCESSFUL", "FAILED", "CANCELLED"]).exists()


def test_two_hundred_tasks_on_a_key_of_two_never_run_more_than_two_while_other_work_flows(workers: Workers) -> None:
    limited = keyed(200, "limited", 2, seconds=0.01)
    others = [
        *Task.objects.bulk_enqueue(SPAN, [{"seconds": 0.01}] * 40),
        *(
            t
            for i in range(4)
            for t in Task.objects.bulk_enqueue(
                SPAN, [{"seconds": 0.01}] * 10, concurrency_key=f"other-{i}", concurrency_limit=5
            )
        ),
    ]
    with Sampler("limited") as sampler:
        for i in range(3):
            workers.start(f"w{i}", *FAST, "--concurrency", "4")
        wait_until(lambda: all_finished(limited + others), 180, 0.2, what="the keyed backlog to drain")
    assert Task.objects.filter(pk__in=limited + others, status=TaskStatus.SUCCESSFUL).count() == 280
    assert Effect.objects.filter(task_id__in=limited, phase="ended").count() == 200
    assert sampler.samples > 100
    assert sampler.max_running <= 2 and sampler.max_admitted <= 2, (sampler.max_running, sampler.max_admitted)
    # On the database clock, handler spans of the key never overlapped more than two deep, and did
    # reach two (the limit is used, not just respected).
    assert max_overlap("limited") == 2
    assert all(max_overlap(f"other-{i}") <= 5 for i in range(4))
    # The other tasks finished while the keyed backlog was still waiting.
    last_other = Effect.objects.filter(task_id__in=others, phase="ended").order_by("-created_at")[0].created_at
    last_limited = Effect.objects.filter(task_id__in=limited, phase="started").order_by("-created_at")[0].created_at
    assert last_other < last_limited
    assert Effect.objects.filter(task_id__in=limited, phase="started", created_at__gt=last_other).count() > 50


def test_a_sigkilled_worker_gives_its_slots_back_through_recovery(workers: Workers) -> None:
    Gate.objects.create(key="g")
    ids = keyed(10, "k", 2, gate="g")
    with Sampler("k") as sampler:
        doomed = workers.start("doomed", *FAST, "--concurrency", "4", "--no-recovery")
        wait_until(lambda: Effect.objects.filter(phase="started").count() == 2, 30, what="two attempts to start")
        held = set(Task.objects.filter(status="RUNNING").values_list("id", flat=True))
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait(10)
        workers.start("rescuer", *FAST, "--concurrency", "4")
        # Recovery requeues the two (their slots stay with them: runnable at once) and the rescuer
        # runs them; nothing else of the key starts meanwhile.
        wait_until(
            lambda: Effect.objects.filter(phase="started", task_id__in=held).count() == 4, 30, what="recovered reruns"
        )
        assert Effect.objects.filter(phase="started").exclude(task_id__in=held).count() == 0
        Gate.objects.filter(key="g").update(open=True)
        wait_until(lambda: all_finished(ids), 60, 0.1, what="the backlog to drain")
    assert Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL).count() == 10
    assert sampler.max_admitted <= 2, sampler.max_admitted
    assert not Task.objects.filter(concurrency_key="k", status__in=["BLOCKED", "READY", "RUNNING"]).exists()


def test_failures_cancels_and_hand_backs_keep_the_bookkeeping_right(workers: Workers) -> None:
    Gate.objects.create(key="hold")
    gated = keyed(2, "k", 2, gate="hold")  # admitted first (enqueued first, same priority)
    failing = keyed(12, "k", 2, fail_first=True, seconds=0.01)
    waiting_gated = keyed(2, "k", 2, gate="hold")
    Task.objects.filter(pk=waiting_gated[0]).cancel()  # a waiting task: frees nothing
    assert Task.objects.get(pk=waiting_gated[0]).status == TaskStatus.CANCELLED
    with Sampler("k") as sampler:
        first = workers.start("first", *FAST, "--concurrency", "4", "--shutdown-grace", "0.3")
        wait_until(lambda: Effect.objects.filter(phase="started", task_id__in=gated).count() == 2, 30, what="gated")
        Task.objects.filter(pk=gated[0]).cancel()  # a running task: its slot goes to the next one
        # Each failing task fails once (giving its slot up while it backs off); then the second
        # gated task, never run and so first in line, takes the freed slot: both slots are gated.
        wait_until(lambda: Task.objects.filter(pk__in=failing, failures=1).count() == 12, 60, what="first failures")
        wait_until(lambda: Effect.objects.filter(task_id=waiting_gated[1], phase="started").exists(), 30, what="gate")
        assert Task.objects.filter(pk__in=failing, status="BLOCKED").count() == 12
        # Graceful shutdown while both gated tasks run: they are handed back, keeping their slots.
        stop_process(first)
        assert list(Task.objects.filter(pk__in=[gated[1], waiting_gated[1]]).values_list("status", flat=True)) == [
            "READY",
            "READY",
        ]
        workers.start("second", *FAST, "--concurrency", "4")
        Gate.objects.filter(key="hold").update(open=True)
        wait_until(lambda: all_finished(gated + failing + waiting_gated), 120, 0.1, what="the key to drain")
    final = dict(Task.objects.filter(concurrency_key="k").values_list("id", "status"))
    assert [final[i] for i in gated] == ["CANCELLED", "SUCCESSFUL"]
    assert [final[i] for i in waiting_gated] == ["CANCELLED", "SUCCESSFUL"]
    assert all(final[i] == "SUCCESSFUL" for i in failing)
    assert all(t.failures == 1 for t in Task.objects.filter(pk__in=failing))
    assert sampler.max_admitted <= 2, sampler.max_admitted
    assert not Task.objects.filter(concurrency_key="k", status__in=["BLOCKED", "READY", "RUNNING"]).exists()
