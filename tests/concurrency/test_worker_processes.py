"""Real worker processes against a real server: crashes, pauses, shutdown, throughput, wake-up."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models import Count

from tasks.models import Task, TaskStatus, Worker
from tests.helpers import start_manage, stop_process, wait_until, worker_names, worker_row
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

FAST = ["--ttl", "1", "--recovery-interval", "0.2", "--poll-interval", "0.2", "-v", "2"]


@pytest.fixture
def bare_workers(tmp_path: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, worker_id: str | None = None) -> subprocess.Popen[bytes]:
        name = worker_id or f"worker-{len(started)}"
        proc = start_manage(tmp_path / f"{name}.log", "run_worker", "--worker-id", name, *args)
        started.append(proc)
        wait_until(lambda: Worker.objects.filter(name=name, last_seen_at__isnull=False).exists(), 30, what=f"{name} up")
        return proc

    start.logs = tmp_path  # type: ignore[attr-defined]
    yield start
    for proc in started:
        stop_process(proc)


def status_of(task_id: int) -> str:
    return Task.objects.get(pk=task_id).status


def wait_for_status(task_id: int, status: str, timeout: float = 20) -> None:
    wait_until(lambda: status_of(task_id) == status, timeout, what=f"task {task_id} to be {status}")


def started(task_id: int, attempt: int) -> bool:
    return Effect.objects.filter(task_id=task_id, attempt=attempt, phase="started").exists()


def test_sigkilled_worker_task_runs_again_and_finishes_exactly_once(bare_workers: Any) -> None:
    Gate.objects.create(key="g")
    task_id = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "g"}, max_attempts=3).id
    first = bare_workers(*FAST, worker_id="doomed")
    wait_until(lambda: started(task_id, 1), what="first attempt to start")
    wait_until(lambda: Task.objects.get(pk=task_id).attempt_started, what="the start to be recorded")

    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    Gate.objects.filter(key="g").update(open=True)
    bare_workers(*FAST, worker_id="rescuer")

    # A hang guard: how soon after the lease's TTL it runs again is the machine's load.
    wait_until(lambda: status_of(task_id) == TaskStatus.SUCCESSFUL, 120, what="the task to succeed")
    task = Task.objects.get(pk=task_id)
    assert task.attempts == 2
    assert worker_names(task.worker_ids) == ["doomed", "rescuer"]
    assert [e["message"][:13] for e in task.errors] == ["lease expired"]
    phases = Counter(Effect.objects.filter(task_id=task_id).values_list("phase", flat=True))
    assert phases == {"started": 2, "finished": 1}


def test_sigstopped_worker_loses_the_task_and_its_late_completion_is_rejected(bare_workers: Any) -> None:
    Gate.objects.create(key="g")
    task_id = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "g"}).id
    paused = bare_workers(*FAST, worker_id="paused")
    wait_until(lambda: started(task_id, 1), what="first attempt to start")
    # The start marker follows the start by one round: freeze the worker once it has landed.
    wait_until(lambda: Task.objects.get(pk=task_id).attempt_started, what="the start to be recorded")

    os.kill(paused.pid, signal.SIGSTOP)
    Gate.objects.filter(key="g").update(open=True)
    bare_workers(*FAST, worker_id="other")
    wait_until(lambda: status_of(task_id) == TaskStatus.SUCCESSFUL, 30, what="the other worker to finish")
    winner = Task.objects.get(pk=task_id).return_value
    assert isinstance(winner, dict)

    os.kill(paused.pid, signal.SIGCONT)
    # The paused worker's handler finishes too, but its completion is refused and counted.
    wait_until(
        lambda: (worker_row("paused").stats or {}).get("rejected", 0) >= 1,
        30,
        what="the stale completion to be rejected",
    )
    task = Task.objects.get(pk=task_id)
    assert task.return_value == winner
    assert winner["pid"] != paused.pid
    assert worker_names(task.worker_ids) == ["paused", "other"]
    finished_by = list(Effect.objects.filter(task_id=task_id, phase="finished").values_list("pid", "token"))
    assert sorted(pid for pid, _ in finished_by) == sorted([paused.pid, winner["pid"]])
    assert winner["token"] == max(token for _, token in finished_by)


def test_sigterm_drains_running_tasks_and_hands_back_the_unfinished_at_once(bare_workers: Any) -> None:
    Gate.objects.create(key="quick")
    Gate.objects.create(key="stuck")
    quick = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "quick"}).id
    stuck = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "stuck"}).id
    worker = bare_workers("--ttl", "60", "--concurrency", "2", "--shutdown-grace", "3", "-v", "2", worker_id="draining")
    wait_until(lambda: started(quick, 1) and started(stuck, 1), what="both tasks to start")

    worker.send_signal(signal.SIGTERM)
    Gate.objects.filter(key="quick").update(open=True)  # finishes within the grace period
    assert worker.wait(30) == 0

    assert status_of(quick) == TaskStatus.SUCCESSFUL
    handed_back = Task.objects.get(pk=stuck)
    assert handed_back.status == TaskStatus.READY
    # The interrupted attempt began (it is counted and named) but is neither a failure nor a crash.
    assert (handed_back.attempts, handed_back.failures, handed_back.crashes) == (1, 0, 0)
    assert handed_back.errors[-1]["exception_class_path"] == "tasks.exceptions.WorkerShutdown"
    assert handed_back.errors[-1]["kind"] == "shutdown"
    assert Task.objects.runnable().filter(pk=stuck).exists()  # at once, not after the 60 s TTL
    assert worker_row("draining").stopped_at is not None


def test_second_signal_hands_back_without_waiting_for_the_grace_period(bare_workers: Any) -> None:
    Gate.objects.create(key="never")
    task_id = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "never"}).id
    worker = bare_workers("--ttl", "60", "--shutdown-grace", "600", worker_id="impatient")
    wait_until(lambda: started(task_id, 1), what="the task to start")
    worker.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining" in (bare_workers.logs / "impatient.log").read_text(), what="drain to begin")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert status_of(task_id) == TaskStatus.READY


def test_four_worker_processes_drain_2000_tasks_each_exactly_once(bare_workers: Any) -> None:
    ids = Task.objects.bulk_enqueue("tests.testapp.handlers.record", [{}] * 2000)
    procs = [bare_workers("--concurrency", "4", "--batch-size", "16", "-v", "0", worker_id=f"w{i}") for i in range(4)]
    wait_until(
        lambda: not Task.objects.filter(status__in=["READY", "RUNNING"]).exists(), 120, what="the queue to drain"
    )
    for proc in procs:
        assert stop_process(proc) == 0
    assert Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL, attempts=1).count() == 2000
    per_task = Effect.objects.values("task_id").annotate(n=Count("id"))
    assert {row["n"] for row in per_task} == {1}
    assert per_task.count() == 2000
    assert len({worker for task in Task.objects.filter(pk__in=ids) for worker in task.worker_ids}) >= 2


def listening_backends() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND"
            " query LIKE 'LISTEN leasing_tasks%%'"
        )
        return int(cursor.fetchone()[0])


def test_listen_notify_wakes_an_idle_worker_far_sooner_than_its_poll(bare_workers: Any) -> None:
    bare_workers("--poll-interval", "30", worker_id="idle")
    wait_until(lambda: listening_backends() >= 1, what="the listener")
    latencies = []
    for _ in range(5):
        task_id = Task.objects.enqueue("tests.testapp.handlers.noop").id
        wait_for_status(task_id, TaskStatus.SUCCESSFUL)
        task = Task.objects.get(pk=task_id)
        assert task.started_at is not None
        latencies.append((task.started_at - task.enqueued_at).total_seconds())
    assert max(latencies) < 3.0, latencies  # polling alone would take up to 30 s


def test_drain_hands_back_prefetched_tasks_at_once(bare_workers: Any) -> None:
    Gate.objects.create(key="held")
    worker = bare_workers(
        "--ttl", "60", "--concurrency", "1", "--batch-size", "4", "--shutdown-grace", "30", worker_id="prefetcher"
    )
    # Prefetch follows observed durations: quick tasks first teach the worker that tasks are short.
    warm_up = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 5)
    wait_until(lambda: Task.objects.filter(pk__in=warm_up, status="SUCCESSFUL").count() == 5, what="the warm-up")
    with transaction.atomic():  # one statement's worth of work, so one claim sees all of it
        running = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "held"}, priority=10).id
        queued = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 3)
    wait_until(lambda: started(running, 1), what="the blocking task to start")
    prefetched = Task.objects.filter(pk__in=queued, status="RUNNING", holder__startswith="prefetcher:")
    assert prefetched.count() == 3

    worker.send_signal(signal.SIGTERM)
    # While the running task still has its grace period, the unstarted ones are already runnable.
    wait_until(lambda: Task.objects.runnable().filter(pk__in=queued).count() == 3, what="the hand-back")
    assert Task.objects.get(pk=running).status == "RUNNING"
    assert set(Task.objects.filter(pk__in=queued).values_list("attempts", flat=True)) == {0}
    Gate.objects.filter(key="held").update(open=True)
    assert worker.wait(30) == 0
    assert status_of(running) == TaskStatus.SUCCESSFUL


def test_a_paused_queue_is_left_alone_while_its_running_task_finishes_and_resume_is_prompt(bare_workers: Any) -> None:
    from tasks.models import QueueControl

    bare_workers("--queues", "mail,bulk", "--poll-interval", "30", "-v", "2", worker_id="pauser")
    running = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "paused-run"}, queue="mail").id
    wait_for_status(running, "RUNNING")
    QueueControl.objects.pause("mail", by="test")
    waiting = [Task.objects.enqueue("tests.testapp.handlers.record", queue="mail").id for _ in range(3)]
    flowing = [Task.objects.enqueue("tests.testapp.handlers.record", queue="bulk").id for _ in range(3)]
    # The bulk tasks, enqueued after the mail ones, are claimed and run: the worker has claimed since.
    for task_id in flowing:
        wait_for_status(task_id, "SUCCESSFUL")
    assert {status_of(task_id) for task_id in waiting} == {"READY"}
    Gate.objects.create(key="paused-run", open=True)
    wait_for_status(running, "SUCCESSFUL")  # a pause does not touch what already runs
    assert {status_of(task_id) for task_id in waiting} == {"READY"}
    QueueControl.objects.resume("mail", by="test")
    # The worker polls every 30 s: only the NOTIFY sent by resume can wake it this soon.
    for task_id in waiting:
        wait_for_status(task_id, "SUCCESSFUL", timeout=10)
