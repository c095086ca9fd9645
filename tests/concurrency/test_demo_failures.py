"""The demo handler's failure injection, on real worker processes."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.models import Task
from tests.helpers import start_manage, stop_process, wait_until, worker_names, worker_row

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *extra: str, **env: str) -> subprocess.Popen[bytes]:
        args = ["--worker-id", name, "--ttl", "1", "--recovery-interval", "0.2", "--poll-interval", "0.2", "-v", "2"]
        args += extra
        proc = start_manage(tmp_path / f"{name}.log", "run_worker", *args, **env)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        stop_process(proc)


def test_injected_crash_kills_the_worker_and_the_task_is_recovered(spawn: Any) -> None:
    task_id = Task.objects.enqueue("tasks.demo.sleep", kwargs={"sleep_duration_seconds": 0.3}, max_attempts=3).id
    crasher = spawn("crasher", TASKS_DEMO_CRASH_RATE="1.0")
    assert crasher.wait(30) == -9  # killed by its own injected SIGKILL
    spawn("healthy")
    done = wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 30, what="recovery")
    # The crash came within milliseconds of the start, before the start marker, but the worker had
    # named the attempt on its row before handing it to an executor: recovery records the crash of an
    # attempt that ran (invariant 14), counted in attempts and charged to no one (a shared crash: the
    # process died with the attempt in it, nothing says the attempt stalled); the task is a suspect,
    # so the healthy worker marked its attempt before running it.
    assert (done.attempts, done.unstarted_returns, done.shared_crashes, done.crashes, done.failures) == (2, 0, 1, 0, 0)
    assert worker_names(done.worker_ids) == ["crasher", "healthy"]
    assert [(e["kind"], *worker_names([e["worker"]])) for e in done.errors] == [("vanished", "crasher")]


def test_injected_stall_makes_only_that_task_miss_its_heartbeats(spawn: Any) -> None:
    task_id = Task.objects.enqueue("tasks.demo.sleep", kwargs={"sleep_duration_seconds": 0.3}).id
    # One executor: while its attempt stalls, the staller has no free slot to win the task back, so
    # the healthy worker takes it over (a staller that won it back would stall it again: each of
    # those stalls is charged to the task, and five in a row would end it FAILED, rightly).
    # A 4 s TTL (a 6 s stall): the healthy worker, started after the claim, is serving before the
    # staller's slot frees on any machine (with 1 s, a loaded one started it after the staller had won
    # the task back and stalled again, until its crashes ended it FAILED).
    staller = spawn("staller", "--concurrency", "1", "--ttl", "4", TASKS_DEMO_STALL_RATE="1.0", TASKS_TTL="4")
    wait_until(lambda: Task.objects.filter(pk=task_id, holder__startswith="staller:").exists(), 30, what="the claim")
    seen = worker_row("staller").last_seen_at
    spawn("healthy")
    done = wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 120, what="takeover")
    assert worker_names(done.worker_ids)[0] == "staller"
    assert worker_names(done.worker_ids)[-1] == "healthy"
    # The stalled attempt's worker lived on: the crash is the attempt's own, charged; not a failure.
    # (Once more per time the staller won the task back before the healthy worker, started after the
    # claim, was polling: on a loaded machine its start can outlast a stall.)
    assert done.crashes >= 1 and done.failures == 0, (done.crashes, done.failures)
    assert [(e["kind"], *worker_names([e["worker"]])) for e in done.errors] == [("crash", "staller")] * done.crashes
    # The process itself never froze: it went on heartbeating while the stalled attempt's lease lapsed.
    assert worker_row("staller").last_seen_at > seen

    # The stalled attempt wakes after 1.5 x TTL and finds its claim gone: its own check raises and
    # its report is rejected. The worker carries on.
    def noticed() -> bool:
        stats = worker_row("staller").stats or {}
        return stats.get("rejected", 0) + stats.get("lost", 0) >= 1

    wait_until(noticed, 30, what="the stale attempt to be refused")
    assert staller.poll() is None
