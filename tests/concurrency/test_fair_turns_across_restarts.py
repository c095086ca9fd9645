"""A fair queue's turns across worker restarts, with real ``manage.py run_worker``
processes on the test database.

A worker keeps where its turns go on (``fair_after``, FAIR_CURSOR) in its own memory. A fleet whose
workers are recycled (``--max-tasks``, a crash loop, a deploy, SIGKILL and restart) starts every new
process from the first key again. The promise under test (docs/howto/pausing-and-keys.md, "Fair
queues"): every tenant with due tasks gets a start within a bounded number of claims, whatever the
other tenants hold; here a bound of ``keys / claim size`` claims, twice over.


Found by breaker 33 (the bug hunt on fair queues, unique windows and debounce)."""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable

import pytest

from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

QUEUE = "tenants33"
#: Twelve tenants: six lives a test (each a worker's start, a second or more of a loaded machine's
#: CPU) where 24 took twelve, for the same two laps of the keys.
KEYS = [f"t{n:02d}" for n in range(12)]
CLAIM = 4  # --batch-size and --max-tasks: one claim per worker life
LIVES = 2 * len(KEYS) // CLAIM  # twice the claims a lap of the keys needs
ARGS = ("--queues", QUEUE, "--concurrency", str(CLAIM), "--batch-size", str(CLAIM), "--no-scheduler")


def started_keys() -> Counter[str | None]:
    rows = Task.objects.filter(queue=QUEUE, started_at__isnull=False)
    return Counter(rows.values_list("fair_key", flat=True))


def started_since(before: int) -> Callable[[], bool]:
    """A condition: a claim's worth of tasks started since ``before`` were."""
    return lambda: sum(started_keys().values()) >= before + CLAIM


def enqueue_tenants() -> None:
    for key in KEYS:
        Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue=QUEUE, fair_key=key)


def test_tenants_get_turns_when_workers_are_recycled_by_max_tasks(workers: Workers) -> None:
    """Each worker life claims one batch (--max-tasks = --batch-size) and exits, as a supervisor's
    recycled workers do; the next life starts from the first key again. After enough claims for two
    laps of the keys, every tenant must have started a task."""
    enqueue_tenants()
    for life in range(LIVES):
        proc = workers.start(
            f"recycled-{life}", *ARGS, "--max-tasks", str(CLAIM), may_die=True, LEASING_TEST_FAIR_QUEUES=QUEUE
        )
        proc.wait(180)  # it exits by itself after its claim's tasks
        assert proc.returncode == 0, workers.log(f"recycled-{life}")
    starts = started_keys()
    assert sum(starts.values()) == LIVES * CLAIM
    starved = [key for key in KEYS if starts[key] == 0]
    assert not starved, f"{len(starved)} of {len(KEYS)} tenants never started a task in {LIVES} claims: {dict(starts)}"


def test_tenants_get_turns_when_a_worker_is_killed_and_restarted(workers: Workers) -> None:
    """SIGKILL of a worker (mid-claim or between claims) and a restart under the same --worker-id:
    its cursor is gone. Each life is killed once it has started a claim's worth of tasks."""
    enqueue_tenants()
    for _life in range(LIVES):
        before = sum(started_keys().values())
        proc = workers.start("killed", *ARGS, LEASING_TEST_FAIR_QUEUES=QUEUE)
        wait_until(started_since(before), 180, what="a claim started")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    starts = started_keys()
    starved = [key for key in KEYS if starts[key] == 0]
    assert not starved, f"{len(starved)} of {len(KEYS)} tenants never started a task: {dict(starts)}"


def test_one_long_lived_worker_serves_every_tenant_in_the_same_number_of_claims(workers: Workers) -> None:
    """The case shows what the two above measure: one worker that keeps its cursor, limited to the
    same number of tasks, starts every tenant."""
    enqueue_tenants()
    proc = workers.start("kept", *ARGS, "--max-tasks", str(LIVES * CLAIM), may_die=True, LEASING_TEST_FAIR_QUEUES=QUEUE)
    proc.wait(120)  # it exits by itself after its tasks
    starts = started_keys()
    assert sum(starts.values()) == LIVES * CLAIM
    assert not [key for key in KEYS if starts[key] == 0], dict(starts)
