"""The async executor against real worker processes (``manage.py run_worker``): ``async def``
handlers run as coroutines on one event loop per process, on the same ledger, heartbeat and outcome
path as the threads. Whatever a coroutine does ends as a recorded outcome, exactly as on a thread,
and the worker goes on serving and stops cleanly. Waits poll the database with deadlines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models import Max, Min

from tasks.compat import default_task_backend
from tasks.models import FINISHED, Task, TaskStatus
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers import wait_until, worker_names, worker_row
from tests.helpers.pgproxy import PgProxy
from tests.helpers.workers import STOP_WITHIN, Workers
from tests.testapp import handlers
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."


def all_ended(ids: list[int]) -> bool:
    return Task.objects.filter(pk__in=ids, status__in=FINISHED).count() == len(ids)


def wait_for_end(task_id: int, timeout: float = 30) -> Task:
    return wait_until(
        lambda: Task.objects.filter(pk=task_id, status__in=FINISHED).first(), timeout, what=f"task {task_id} to end"
    )


def charges(task: Task) -> tuple[int, int, int]:
    return (task.failures, task.crashes, task.shared_crashes)


def effects(task_id: int, phase: str) -> int:
    return Effect.objects.filter(task_id=task_id, phase=phase).count()


def assert_serves(name: str) -> None:
    """The worker still runs a sync task (threads) and a coroutine (the loop) after the fault."""
    echo = Task.objects.enqueue(H + "echo", kwargs={"value": name}).id
    slept = Task.objects.enqueue(H + "async_sleep", kwargs={"seconds": 0.01}).id
    for task_id in (echo, slept):
        task = wait_for_end(task_id)
        assert (task.status, worker_names(task.worker_ids)) == (TaskStatus.SUCCESSFUL, [name]), task.errors


def assert_stops(proc: subprocess.Popen[bytes], name: str) -> dict[str, Any]:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(STOP_WITHIN) == 0
    row = worker_row(name)
    assert (row.stop_reason, row.stopped_at is not None) == ("stopped", True)
    stats: dict[str, Any] = row.stats
    return stats


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (a sweep over start and end events)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = best = 0
    for _at, step in events:
        open_now += step
        best = max(best, open_now)
    return best


# -- parallelism and identity -------------------------------------------------------------------


def test_two_hundred_sleeping_coroutines_run_at_once_in_one_process(workers: Workers) -> None:
    proc = workers.start("aio", "--concurrency", "2", "--async-concurrency", "200", "--batch-size", "50")
    ids = Task.objects.bulk_enqueue(H + "async_sleep", [{"seconds": 0.5}] * 200)
    wait_until(lambda: all_ended(ids), 60, what="the 200 coroutines to finish")

    values = [t.return_value for t in Task.objects.filter(pk__in=ids)]
    results = [r for r in values if isinstance(r, dict)]
    assert len(results) == 200
    assert {r["pid"] for r in results} == {proc.pid}
    assert {r["thread"] for r in results} == {"async-loop-1"}  # one loop thread, not 200 threads
    # With 2 executor threads a serial run would overlap at most 2; the loop runs far more at once.
    assert max_overlap([(r["start"], r["end"]) for r in results]) >= 100
    assert not Task.objects.filter(pk__in=ids).exclude(status=TaskStatus.SUCCESSFUL).exists()
    stats = assert_stops(proc, "aio")
    assert (stats["succeeded"], stats["failed"], stats["rejected"]) == (200, 0, 0)


def test_claims_fill_each_kind_of_slot_and_hoard_nothing(workers: Workers) -> None:
    """1 thread and 3 coroutine slots, a queue of both kinds interleaved: the worker runs 1 sync and
    3 async tasks at once, and holds nothing it cannot start (a claim cannot choose by kind: what
    does not fit goes back at once, uncharged)."""
    Gate.objects.create(key="mix")
    proc = workers.start("mix", "--concurrency", "1", "--async-concurrency", "3", "--batch-size", "16")
    with transaction.atomic():
        ids = []
        for _ in range(6):
            ids.append(Task.objects.enqueue(H + "block", kwargs={"gate": "mix"}).id)
            ids.append(Task.objects.enqueue(H + "async_gate", kwargs={"gate": "mix"}).id)

    def started(path: str) -> int:
        return Effect.objects.filter(
            task_id__in=Task.objects.filter(pk__in=ids, task_path=H + path).values("pk")
        ).count()

    wait_until(lambda: started("block") == 1 and started("async_gate") == 3, 30, what="1 sync + 3 async to run")
    held = Task.objects.filter(pk__in=ids, holder__startswith="mix:", status=TaskStatus.RUNNING)
    assert held.count() == 4, list(held.values_list("task_path", "attempt_started"))
    Gate.objects.filter(key="mix").update(open=True)
    wait_until(lambda: all_ended(ids), 60, what="every task to finish")
    for task in Task.objects.filter(pk__in=ids):
        assert (task.status, task.attempts, charges(task), worker_names(task.worker_ids)) == (
            TaskStatus.SUCCESSFUL,
            1,
            (0, 0, 0),
            ["mix"],
        ), task.errors
    assert_stops(proc, "mix")


def test_each_coroutine_sees_its_own_current_task(workers: Workers) -> None:
    proc = workers.start("ident", "--async-concurrency", "150", "--batch-size", "50")
    ids = Task.objects.bulk_enqueue(H + "async_identity", [{"pause": 0.1}] * 150)
    wait_until(lambda: all_ended(ids), 60, what="every coroutine to finish")
    for task in Task.objects.filter(pk__in=ids):
        assert task.status == TaskStatus.SUCCESSFUL, task.errors
        assert task.return_value == {"before": task.id, "after": task.id, "inside": task.id, "token": task.token}
    assert_stops(proc, "ident")


def test_async_checkpoint_is_kept_for_the_retry(workers: Workers) -> None:
    proc = workers.start("ckpt")
    task = wait_for_end(Task.objects.enqueue(H + "async_resume", max_attempts=2).id)
    assert task.status == TaskStatus.SUCCESSFUL, task.errors
    assert task.return_value == {"resumed_from": 3, "attempt": 2}
    assert "checkpoint saved: True" in task.errors[0]["message"]
    assert_stops(proc, "ckpt")


@pytest.mark.parametrize(("async_concurrency", "on_loop"), [("100", True), ("0", False)])
def test_django_async_task_through_the_lease_backend(workers: Workers, async_concurrency: str, on_loop: bool) -> None:
    """On the loop by default; with --async-concurrency 0 on a thread (async_to_sync), as before."""
    name = f"dj-{async_concurrency}"
    proc = workers.start(name, "--async-concurrency", async_concurrency)
    Gate.objects.create(key="dj-label")
    result = handlers.async_context_task.enqueue("dj-label")
    task = wait_for_end(int(result.id))
    assert task.status == TaskStatus.SUCCESSFUL, task.errors
    value = task.return_value
    assert isinstance(value, dict)
    assert value["thread"].startswith("async-loop-") == on_loop, value
    assert (value["attempt"], value["token"], value["label"], value["gates"]) == (1, task.token, "dj-label", 1)
    assert task.progress == {"label": "dj-label"}
    fetched = default_task_backend.get_result(result.id)
    assert (fetched.status, fetched.return_value) == ("SUCCESSFUL", value)
    assert_stops(proc, name)


# -- what a coroutine can do wrong ----------------------------------------------------------------

RAISED = {
    "system_exit": ("builtins.SystemExit", "7"),
    "keyboard_interrupt": ("builtins.KeyboardInterrupt", "interrupted by"),
    "generator_exit": ("builtins.GeneratorExit", "closed by the handler"),
    "cancelled": ("asyncio.exceptions.CancelledError", "cancelled by the handler"),
    "nul_message": ("builtins.ValueError", "before\\x00after"),
}
UNSTORABLE = ["nan", "inf", "nul", "surrogate", "object", "circular", "huge_int", "deep"]


def test_every_base_exception_and_unstorable_result_of_a_coroutine_is_a_recorded_failure(workers: Workers) -> None:
    proc = workers.start("faulty", "--async-concurrency", "20")
    raised = {
        kind: Task.objects.enqueue(H + "async_raise", kwargs={"kind": kind}, max_attempts=2).id for kind in RAISED
    }
    unstorable = {
        kind: Task.objects.enqueue(H + "async_unstorable", kwargs={"kind": kind}, max_attempts=3).id
        for kind in UNSTORABLE
    }
    wait_until(lambda: all_ended([*raised.values(), *unstorable.values()]), 60, what="every faulty task to end")

    for kind, task_id in raised.items():
        task = Task.objects.get(pk=task_id)
        path, message = RAISED[kind]
        assert (task.status, task.attempts, charges(task)) == (TaskStatus.FAILED, 2, (2, 0, 0)), (kind, task.errors)
        assert [e["exception_class_path"] for e in task.errors] == [path, path]
        assert all(message in e["message"] for e in task.errors), task.errors
    for kind, task_id in unstorable.items():
        task = Task.objects.get(pk=task_id)
        # Not retried: the same value would come back every time.
        assert (task.status, task.attempts, charges(task)) == (TaskStatus.FAILED, 1, (1, 0, 0)), (kind, task.errors)
        [entry] = task.errors
        assert entry["exception_class_path"] == "tasks.exceptions.UnstorableResult"
        assert entry["message"].startswith("the return value cannot be stored")

    assert_serves("faulty")
    stats = assert_stops(proc, "faulty")
    assert (stats["failed"], stats["rejected"]) == (len(RAISED) + len(UNSTORABLE), 0)
    assert "executor error" not in workers.log("faulty")


def test_coroutine_past_its_timeout_is_cancelled_and_recorded(workers: Workers) -> None:
    proc = workers.start("late")
    task_id = Task.objects.enqueue(H + "async_wait_cancelled", timeout=0.5, max_attempts=1).id
    task = wait_for_end(task_id)
    assert (task.status, charges(task)) == (TaskStatus.FAILED, (1, 0, 0))
    [entry] = task.errors
    assert entry["exception_class_path"] == "tasks.exceptions.TaskTimeout"
    assert "timeout of 0.5s" in entry["message"]
    # Cancelled cooperatively: the coroutine saw the CancelledError and ran its cleanup.
    wait_until(lambda: effects(task_id, "cancelled") == 1, what="the coroutine to be cancelled")
    wait_until(lambda: "late result of an abandoned coroutine dropped" in workers.log("late"), what="the late end")
    assert_serves("late")
    stats = assert_stops(proc, "late")
    assert (stats["timed_out"], stats["late_results_dropped"], stats["rejected"]) == (1, 1, 0)


def test_coroutine_whose_lease_is_taken_away_is_cancelled_and_handed_back_with_the_reason(workers: Workers) -> None:
    # No recovery here: the hand-back, not a recovery pass, must be what puts the task back.
    proc = workers.start("robbed", "--no-recovery")
    task_id = Task.objects.enqueue(H + "async_wait_cancelled", kwargs={"only_first": True}, max_attempts=1).id
    wait_until(
        lambda: effects(task_id, "started") and Task.objects.filter(pk=task_id, attempt_started=True).exists(),
        what="the coroutine to start",
    )
    token = Task.objects.get(pk=task_id).token
    # The lease ends in the database: the next heartbeat renews nothing for it.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET expires_at = clock_timestamp() WHERE id = %s", [task_id])

    wait_until(lambda: effects(task_id, "cancelled") == 1, what="the coroutine to be cancelled")
    task = wait_for_end(task_id)
    assert task.status == TaskStatus.SUCCESSFUL, task.errors  # its retry (a new grant) ran to the end
    assert task.token is not None and token is not None and task.token > token
    assert charges(task) == (0, 0, 0)  # a lost lease is not the handler's failure
    [entry] = task.errors
    assert (entry["kind"], entry["token"]) == ("shutdown", token)
    assert "cancelled: the lease was lost" in entry["message"]
    assert "heartbeat rejected" in entry["message"]
    assert_serves("robbed")
    stats = assert_stops(proc, "robbed")
    assert stats["lost"] == 1


def test_coroutine_blocking_the_loop_is_abandoned_and_its_neighbours_go_on(workers: Workers) -> None:
    Gate.objects.create(key="neighbours")
    proc = workers.start("blocked", TASKS_ASYNC_BLOCK_LIMIT="1")
    neighbours = [Task.objects.enqueue(H + "async_gate", kwargs={"gate": "neighbours"}).id for _ in range(3)]
    wait_until(lambda: sum(effects(n, "started") for n in neighbours) == 3, what="the neighbours to start")
    blocker = Task.objects.enqueue(H + "async_block_loop", kwargs={"seconds": 5}, max_attempts=2).id

    task = wait_for_end(blocker)
    assert task.status == TaskStatus.SUCCESSFUL, task.errors
    assert task.return_value == "attempt 2"  # the retry ran on the new loop while the old one was stuck
    assert charges(task) == (1, 0, 0)
    [entry] = task.errors
    assert entry["exception_class_path"] == "tasks.exceptions.EventLoopBlocked"
    assert "blocked the event loop" in entry["message"]

    # Neighbours: handed back uncharged and started again on the new loop.
    wait_until(lambda: sum(effects(n, "started") for n in neighbours) == 6, what="the neighbours to restart")
    Gate.objects.filter(key="neighbours").update(open=True)
    wait_until(lambda: all_ended(neighbours), 30, what="the neighbours to finish")
    for neighbour in Task.objects.filter(pk__in=neighbours):
        assert neighbour.status == TaskStatus.SUCCESSFUL, neighbour.errors
        assert charges(neighbour) == (0, 0, 0)
        # Nothing expired: the heartbeat thread renewed every lease while the loop was blocked.
        assert [e["kind"] for e in neighbour.errors] == ["shutdown"]
        assert "the event loop it ran on was blocked" in neighbour.errors[0]["message"]
    wait_until(lambda: "late result of an abandoned coroutine dropped" in workers.log("blocked"), what="old loop end")
    assert_serves("blocked")
    stats = assert_stops(proc, "blocked")
    assert stats["rejected"] == 0


def test_a_paused_process_is_not_taken_for_a_blocked_loop(workers: Workers) -> None:
    """A process stopped longer than ASYNC_BLOCK_LIMIT (SIGSTOP here; a starved machine on CI) stops the
    loop and the watchdog alike, and the watchdog may wake first: it must not take the pause for a
    coroutine blocking the loop (it abandoned whichever attempt the loop was in, charged, and handed the
    others back; issue 56's CI log blamed an attempt that only awaits asyncio.sleep)."""
    ids = [Task.objects.enqueue(H + "async_sleep", kwargs={"seconds": 0.3}).id for _ in range(60)]
    proc = workers.start("paused", "--async-concurrency", "8", "--ttl", "10", TASKS_ASYNC_BLOCK_LIMIT="1")
    done = Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL)
    for pause in range(1, 5):
        wanted = 8 * pause
        wait_until(lambda: done.count() >= wanted, 30, what="coroutines running")  # noqa: B023 (called here)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(2)  # the fault itself: paused past the block limit (1 s), well within the TTL (10 s)
        os.kill(proc.pid, signal.SIGCONT)
    wait_until(lambda: done.count() == len(ids), 60, what="every task done")
    assert "has not turned" not in workers.log("paused")
    for task in Task.objects.filter(pk__in=ids):
        assert charges(task) == (0, 0, 0), task.errors
    assert_stops(proc, "paused")


def test_shutdown_lets_coroutines_finish_within_the_grace_then_cancels_and_hands_back(workers: Workers) -> None:
    Gate.objects.create(key="soon")
    proc = workers.start("drain", "--shutdown-grace", "2")
    finishing = Task.objects.enqueue(H + "async_gate", kwargs={"gate": "soon"}).id
    # Their cleanup awaits longer than the loop's tick (aio.TICK): the shutdown, which asks to cancel
    # from stop() and again from the ticker, cancels each coroutine once, so the cleanup runs to its
    # end (a second cancel cut it short: one of three such writes was lost on CI's Python 3.10 leg).
    stuck = [Task.objects.enqueue(H + "async_wait_cancelled", kwargs={"cleanup": 0.5}).id for _ in range(3)]
    everything = [finishing, *stuck]
    wait_until(
        lambda: (
            sum(effects(t, "started") for t in everything) == 4
            and Task.objects.filter(pk__in=everything, attempt_started=True).count() == 4
        ),
        what="every coroutine to start",
    )
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining" in workers.log("drain"), what="the worker to drain")
    Gate.objects.filter(key="soon").update(open=True)  # finishes within the grace period
    assert proc.wait(STOP_WITHIN) == 0

    assert Task.objects.get(pk=finishing).status == TaskStatus.SUCCESSFUL
    for task in Task.objects.filter(pk__in=stuck):
        assert task.status == TaskStatus.READY  # back in the queue, uncharged
        assert charges(task) == (0, 0, 0)
        [entry] = task.errors
        assert (entry["kind"], entry["exception_class_path"]) == ("shutdown", "tasks.exceptions.WorkerShutdown")
        assert effects(task.id, "cancelled") == 1  # cancelled cooperatively after the hand-back
    row = worker_row("drain")
    assert row.stop_reason == "stopped"
    assert row.stats["failed"] == 0


# -- invariant 8 ------------------------------------------------------------------------------------


def test_one_heartbeat_statement_renews_every_held_coroutine(workers: Workers) -> None:
    held = 120
    Gate.objects.create(key="held")
    with PgProxy.from_database_url(database_url()) as proxy:
        proc = workers.start(
            "beats", "--async-concurrency", str(held), "--batch-size", "40", DATABASE_URL=proxy.url_for(database_url())
        )
        with transaction.atomic():
            ids = [Task.objects.enqueue(H + "async_gate", kwargs={"gate": "held"}).id for _ in range(held)]
        wait_until(
            lambda: Task.objects.filter(pk__in=ids, attempt_started=True).count() == held, 30, what="all to start"
        )
        before_renewals = Task.objects.filter(pk__in=ids).aggregate(least=Min("renewals"))["least"]
        proxy.count(b"WITH mine AS")  # start counting heartbeat statements now
        wait_until(
            lambda: Task.objects.filter(pk__in=ids).aggregate(least=Min("renewals"))["least"] >= before_renewals + 3,
            30,
            what="every held attempt to be renewed three more times",
        )
        statements = proxy.count(b"WITH mine AS")
        most = Task.objects.filter(pk__in=ids).aggregate(most=Max("renewals"))["most"]
        # One statement per beat renews all 120: the statements sent while counting are at most the
        # beats any attempt gained since (+1 for a beat sent and not yet committed), however long the
        # beats took on a loaded machine. A statement per attempt would send 120 a beat.
        assert 2 <= statements <= most - before_renewals + 1, (statements, most, before_renewals)
        Gate.objects.filter(key="held").update(open=True)
        wait_until(lambda: all_ended(ids), 30, what="every coroutine to finish")
        assert_stops(proc, "beats")
