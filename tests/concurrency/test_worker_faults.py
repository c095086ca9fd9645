"""A fault matrix against real worker processes (``manage.py run_worker``).

Whatever a handler or the network does, the attempt ends recorded (invariant 9) and is charged to
the right counter (invariant 10: ``failures`` for the handler's own outcome; ``crashes`` for a
death that is the attempt's own, ``shared_crashes`` for a worker that vanished with several attempts;
nothing for a claim that never started), and then:

- the same worker process goes on serving: a normal task enqueued afterwards succeeds, with that
  worker's id in its ``worker_ids``;
- SIGTERM still stops it, exit code 0 (``STOP_WITHIN``: a hang guard, not a deadline).

Every row starts its own worker(s), so each can fail on its own. Waits poll the database with
deadlines; nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.test import Client

from tasks.models import FINISHED, Task, TaskStatus, Worker
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers import wait_until, worker_names, worker_row
from tests.helpers.pgproxy import PgProxy
from tests.helpers.workers import STOP_WITHIN, Workers
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."
API_TOKEN = "fault-matrix-token"


# -- workers ----------------------------------------------------------------------------------


def url_with(url: str, **options: str) -> str:
    extra = "&".join(f"{key}={value}" for key, value in options.items())
    return f"{url}{'&' if '?' in url else '?'}{extra}"


# -- assertions -------------------------------------------------------------------------------


def wait_for_end(task_id: int, timeout: float = 30) -> Task:
    return wait_until(
        lambda: Task.objects.filter(pk=task_id, status__in=FINISHED).first(), timeout, what=f"task {task_id} to end"
    )


def all_ended(ids: list[int]) -> bool:
    return ended_at_least(ids, len(ids))


def ended_at_least(ids: list[int], count: int) -> bool:
    return Task.objects.filter(pk__in=ids, status__in=FINISHED).count() >= count


def exited_or_failed(proc: subprocess.Popen[bytes], task_id: int) -> bool:
    return proc.poll() is not None or Task.objects.filter(pk=task_id, status=TaskStatus.FAILED).exists()


def connection_errors_above(name: str, seen: int) -> int:
    """The worker's reported connection errors once more than ``seen`` (its heartbeat writes them)."""
    errors = int((worker_row(name).stats or {}).get("connection_errors", 0))
    return errors if errors > seen else 0


def assert_serves(name: str) -> None:
    """(b) The worker takes and finishes a normal task after the fault."""
    task_id = Task.objects.enqueue(H + "echo", kwargs={"value": f"served by {name}"}).id
    task = wait_for_end(task_id)
    assert (task.status, task.return_value, worker_names(task.worker_ids), task.attempts) == (
        TaskStatus.SUCCESSFUL,
        f"served by {name}",
        [name],
        1,
    )


def assert_stops(proc: subprocess.Popen[bytes], name: str) -> dict[str, Any]:
    """(c) SIGTERM stops the worker cleanly within the grace period; returns its final stats."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(STOP_WITHIN) == 0
    row = worker_row(name)
    assert row.stopped_at is not None
    assert row.stop_reason == "stopped"
    stats: dict[str, Any] = row.stats
    return stats


def assert_storable_text(entry: dict[str, Any]) -> None:
    for key in ("exception_class_path", "message", "traceback"):
        assert "\x00" not in entry[key]
        entry[key].encode("utf-8")  # no lone surrogate survived


def charges(task: Task) -> tuple[int, int, int, int, int]:
    """(attempts, failures, crashes, shared_crashes, unstarted_returns): what each attempt cost."""
    return (task.attempts, task.failures, task.crashes, task.shared_crashes, task.unstarted_returns)


def effects(task_id: int, phase: str) -> int:
    return Effect.objects.filter(task_id=task_id, phase=phase).count()


# -- what a handler does ----------------------------------------------------------------------

UNSTORABLE = "tasks.exceptions.UnstorableResult"


@dataclass(frozen=True)
class HandlerFault:
    handler: str
    kwargs: dict[str, Any]
    exception_class_path: str
    message: str  # expected in every stored error message
    #: How many attempts run, every one of them a failure of the handler's own.
    attempts: int
    max_attempts: int


def unstorable(kind: str, message: str) -> HandlerFault:
    # max_attempts 3, one attempt: an unstorable result is not retried.
    return HandlerFault(H + "unstorable_result", {"kind": kind}, UNSTORABLE, message, attempts=1, max_attempts=3)


def raising(kind: str, path: str, message: str, handler: str = "raise_base") -> HandlerFault:
    # max_attempts 2, two attempts: the failure is retried, in the same process.
    return HandlerFault(H + handler, {"kind": kind}, path, message, attempts=2, max_attempts=2)


HANDLER_FAULTS = {
    "result-nan": unstorable("nan", "not JSON-serialisable"),
    "result-inf": unstorable("inf", "not JSON-serialisable"),
    "result-nul": unstorable("nul", "NUL character"),
    "result-lone-surrogate": unstorable("surrogate", "lone surrogate"),
    "result-object": unstorable("object", "not JSON-serialisable"),
    "result-circular": unstorable("circular", "Circular reference"),
    "result-huge-int": unstorable("huge_int", "not JSON-serialisable"),
    "result-too-deep": unstorable("deep", "not JSON-serialisable"),
    "raise-nul-message": raising("nul_message", "builtins.ValueError", "before\\x00after"),
    "raise-lone-surrogate-message": raising("surrogate_message", "builtins.ValueError", "lone \\ud800 surrogate"),
    "raise-SystemExit": raising("system_exit", "builtins.SystemExit", "7"),
    "raise-KeyboardInterrupt": raising("keyboard_interrupt", "builtins.KeyboardInterrupt", "interrupted by"),
    "raise-CancelledError": raising("cancelled", "asyncio.exceptions.CancelledError", "cancelled by the handler"),
    "raise-CancelledError-in-coroutine": raising(
        "", "asyncio.exceptions.CancelledError", "cancelled inside a coroutine", handler="async_cancelled"
    ),
    "raise-GeneratorExit": raising("generator_exit", "builtins.GeneratorExit", "closed by the handler"),
}


@pytest.mark.parametrize("fault", list(HANDLER_FAULTS.values()), ids=list(HANDLER_FAULTS))
def test_handler_fault_is_a_recorded_failure_and_the_worker_serves_on(workers: Workers, fault: HandlerFault) -> None:
    proc = workers.start("w", "--concurrency", "2")
    task_id = Task.objects.enqueue(fault.handler, kwargs=fault.kwargs, max_attempts=fault.max_attempts).id

    task = wait_for_end(task_id)
    assert task.status == TaskStatus.FAILED
    assert charges(task) == (fault.attempts, fault.attempts, 0, 0, 0)
    assert task.return_value is None
    assert worker_names(task.worker_ids) == ["w"] * fault.attempts
    assert len(task.errors) == fault.attempts
    for number, entry in enumerate(task.errors, 1):
        assert entry["exception_class_path"] == fault.exception_class_path
        assert (entry["kind"], entry["attempt"], *worker_names([entry["worker"]])) == ("failure", number, "w")
        assert fault.message in entry["message"], entry["message"]
        assert_storable_text(entry)
    if fault.exception_class_path == UNSTORABLE:
        assert task.errors[0]["message"].startswith("the return value cannot be stored")
    assert len({entry["token"] for entry in task.errors}) == fault.attempts  # one grant per attempt

    assert_serves("w")
    stats = assert_stops(proc, "w")
    log = workers.log("w")
    assert "executor error" not in log  # the worker's own code never saw the exception
    assert "refused by the database" not in log  # decided in Python, not by a failing statement
    assert (stats["failed"], stats["retried"], stats["rejected"]) == (1, fault.attempts - 1, 0)


# -- timeouts ---------------------------------------------------------------------------------


def test_overrunning_attempt_is_recorded_at_once_and_a_fresh_thread_runs_the_retry(workers: Workers) -> None:
    Gate.objects.create(key="late")
    # One executor: the retry (and the task after it) can only run on a thread that replaced the stuck one.
    proc = workers.start("w", "--concurrency", "1")
    task_id = Task.objects.enqueue(H + "slow_first", kwargs={"gate": "late"}, timeout=0.5, max_attempts=2).id

    task = wait_for_end(task_id)
    assert task.status == TaskStatus.SUCCESSFUL
    assert task.return_value == {"attempt": 2}
    assert (task.attempts, task.failures, task.crashes) == (2, 1, 0)
    assert worker_names(task.worker_ids) == ["w", "w"]
    [timeout] = task.errors
    assert (timeout["exception_class_path"], timeout["kind"], timeout["attempt"]) == (
        "tasks.exceptions.TaskTimeout",
        "failure",
        1,
    )
    assert "timeout of 0.5s" in timeout["message"]
    assert timeout["token"] < task.token  # attempt 1 and attempt 2: two keys in the worker's ledger

    # Attempt 1's handler is still running in its abandoned thread: let it return. Its result is dropped.
    Gate.objects.filter(key="late").update(open=True)
    wait_until(lambda: "late result of an abandoned attempt dropped" in workers.log("w"), what="the late result")
    after = Task.objects.get(pk=task_id)
    assert (after.status, after.return_value, after.token) == (TaskStatus.SUCCESSFUL, {"attempt": 2}, task.token)

    assert_serves("w")
    stats = assert_stops(proc, "w")
    assert (stats["timed_out"], stats["late_results_dropped"], stats["rejected"]) == (1, 1, 0)


# -- a handler that kills its process -----------------------------------------------------------


def test_handler_killing_a_busy_worker_is_a_shared_crash_and_another_worker_finishes(workers: Workers) -> None:
    """A worker dies with three attempts running: nobody can tell which one killed it, so each is a
    shared crash (``vanished``), charged to no one, never a failure; a second worker finishes all."""
    Gate.objects.create(key="hold")
    Gate.objects.create(key="die")
    # max_attempts 1: an attempt wrongly charged as a failure would end the task FAILED.
    neighbours = [Task.objects.enqueue(H + "block", kwargs={"gate": "hold"}, max_attempts=1).id for _ in range(2)]
    killer = Task.objects.enqueue(H + "exit_after_start", kwargs={"code": 3, "gate": "die"}, max_attempts=1).id
    doomed = workers.start("doomed", "--concurrency", "3")
    everything = [*neighbours, killer]
    wait_until(
        lambda: Task.objects.filter(pk__in=everything, holder__startswith="doomed:", attempt_started=True).count() == 3,
        what="all three attempts to be started",
    )

    Gate.objects.filter(key="die").update(open=True)
    assert doomed.wait(30) == 3
    Gate.objects.filter(key="hold").update(open=True)
    rescuer = workers.start("rescuer", "--concurrency", "3")
    wait_until(lambda: all_ended(everything), 30, what="the rescuer to finish every task")

    for task_id in everything:
        task = Task.objects.get(pk=task_id)
        assert task.status == TaskStatus.SUCCESSFUL, task.errors
        assert charges(task) == (2, 0, 0, 1, 0)
        assert worker_names(task.worker_ids) == ["doomed", "rescuer"]
        [vanished] = task.errors
        assert (vanished["kind"], vanished["exception_class_path"], vanished["attempt"], vanished["worker"]) == (
            "vanished",
            "tasks.exceptions.TaskLeaseLost",
            1,
            task.worker_ids[0],
        )
        assert "not charged" in vanished["message"]
    assert Task.objects.get(pk=killer).return_value == {"attempt": 2}
    for neighbour in neighbours:
        return_value = Task.objects.get(pk=neighbour).return_value
        assert isinstance(return_value, dict)
        assert return_value["pid"] == rescuer.pid
        assert (effects(neighbour, "started"), effects(neighbour, "finished")) == (2, 1)

    wait_until(
        lambda: Worker.objects.filter(name="doomed", stopped_at__isnull=False, stop_reason__startswith="presumed dead"),
        20,
        what="the dead worker to be recorded as dead",
    )
    assert_serves("rescuer")
    assert assert_stops(rescuer, "rescuer")["rejected"] == 0


def test_poison_pill_that_kills_every_worker_ends_failed_after_max_crashes(workers: Workers) -> None:
    """Its first ISOLATE_AFTER deaths are shared crashes (not charged); from then on it runs
    isolated, each death is charged, and after MAX_CRASHES it is FAILED. Every try is recorded."""
    max_crashes = 3
    isolate_after = 2  # the default of ISOLATE_AFTER
    tries = isolate_after + max_crashes
    pill = Task.objects.enqueue(H + "exit_after_start", kwargs={"code": 3, "every_time": True}, max_attempts=1).id
    deaths: list[int | None] = []
    survivor: tuple[str, subprocess.Popen[bytes]] | None = None
    # Restart a worker whenever the pill killed the last one; a bounded loop, whatever happens.
    for number in range(tries + 1):
        name = f"pill-{number}"
        proc = workers.start(name, may_die=True, TASKS_MAX_CRASHES=str(max_crashes))
        wait_until(partial(exited_or_failed, proc, pill), 30, what=f"{name} to die or the pill to be stopped")
        if proc.poll() is None:
            survivor = (name, proc)
            break
        deaths.append(proc.returncode)

    assert deaths == [3] * tries
    assert survivor is not None
    task = Task.objects.get(pk=pill)
    assert task.status == TaskStatus.FAILED
    assert charges(task) == (tries, 0, max_crashes, isolate_after, 0)
    dead = [f"pill-{number}" for number in range(tries)]
    assert worker_names(task.worker_ids) == dead
    kinds = ["vanished"] * isolate_after + ["crash"] * max_crashes
    assert [(entry["kind"], entry["worker"]) for entry in task.errors] == list(zip(kinds, task.worker_ids, strict=True))
    assert {entry["exception_class_path"] for entry in task.errors} == {"tasks.exceptions.TaskLeaseLost"}
    assert effects(pill, "started") == tries  # one try per recorded error entry, none unrecorded

    name, proc = survivor
    assert_serves(name)
    assert_stops(proc, name)


# -- the network --------------------------------------------------------------------------------

MARKER = "reply-lost-marker"


@pytest.mark.parametrize("executor", ["threads", "async"])
@pytest.mark.parametrize(
    ("pattern", "finishes"),
    [(MARKER.encode(), True), (b"WITH finished AS", False)],
    ids=["finish-and-claim", "first-claim"],
)
def test_lost_reply_to_a_committed_round_loses_nothing_and_charges_nothing(
    proxy: PgProxy, workers: Workers, pattern: bytes, finishes: bool, executor: str
) -> None:
    """finish-and-claim: the round that finishes the marker task (and claims the next batch) commits
    but its reply never arrives. first-claim: the worker's very first claim does the same.

    "threads": the thread executor alone, whose claims are sized by free threads only, so the lost
    round always claims something the worker never hears of. "async": the default worker, beside an
    event loop whose claims follow the observed mix (and may probe): whether the lost round claimed
    anything depends on timing, but nothing is lost or charged either way."""
    Gate.objects.create(key="after")
    with transaction.atomic():
        marker = Task.objects.enqueue(H + "echo", kwargs={"value": MARKER}, priority=10).id
        blocked = [Task.objects.enqueue(H + "block", kwargs={"gate": "after"}).id for _ in range(6)]
    everything = [marker, *blocked]
    fault = proxy.drop_reply_after(pattern)
    options = ["--async-concurrency", "0"] if executor == "threads" else []
    proc = workers.start(
        "lossy", "--concurrency", "2", "--batch-size", "4", *options, DATABASE_URL=proxy.url_for(database_url())
    )
    assert fault.fired.wait(30)
    assert fault.status == b"I"  # no transaction open: the round committed

    if executor == "threads":
        # Claims the worker never heard of go back at once (not after the TTL), uncharged.
        wait_until(
            lambda: (worker_row("lossy").stats or {}).get("claims_returned", 0) >= 1,
            what="the unknown claims to be handed back (worker stats)",
        )
    else:
        wait_until(
            lambda: (worker_row("lossy").stats or {}).get("connection_errors", 0) >= 1,
            what="the worker to notice the lost reply (worker stats)",
        )
    assert not Task.objects.filter(pk__in=blocked, attempt_started=False).exclude(attempts=0).exists()
    Gate.objects.filter(key="after").update(open=True)
    wait_until(lambda: all_ended(everything), 30, what="every task to end")

    for task in Task.objects.filter(pk__in=everything):
        assert task.status == TaskStatus.SUCCESSFUL, task.errors
        # Exactly one charged attempt each: nothing lost, nothing run twice, no crash, no return.
        assert charges(task) == (1, 0, 0, 0, 0)
        assert (task.errors, worker_names(task.worker_ids)) == ([], ["lossy"])
    assert Task.objects.get(pk=marker).return_value == MARKER
    assert effects(marker, "done") == 1
    assert all(effects(task_id, "finished") == 1 for task_id in blocked)

    assert_serves("lossy")
    stats = assert_stops(proc, "lossy")
    assert stats["connection_errors"] >= 1
    if executor == "threads":
        assert stats["claims_returned"] >= 1
    assert stats["rejected"] == 0
    if finishes:
        assert stats["reconciled"] >= 1  # the marker's completion had landed: found, not re-sent


def worker_backends(application_name: str, where: str = "true") -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND"
            f" application_name = %s AND pid <> pg_backend_pid() AND {where}",
            [application_name],
        )
        return [row[0] for row in cursor.fetchall()]


def terminate(pids: list[int]) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM unnest(%s::int[]) AS pid", [pids])
        return int(cursor.fetchone()[0])


def test_backends_terminated_in_the_middle_of_a_round_lose_nothing(workers: Workers) -> None:
    app = "fault-terminated"
    Gate.objects.create(key="finish")
    # A TTL of 12 s: the round's lock wait lasts its longest (2 s, tasks/worker/session.py) before the
    # worker defers the finish, time for this test to see it waiting on a loaded machine (at 2 s a
    # wait of 333 ms could pass between two looks, and the deferred writes wait 50 ms at a time).
    proc = workers.start(
        "terminated", "--concurrency", "1", "--ttl", "12", DATABASE_URL=url_with(database_url(), application_name=app)
    )
    held = Task.objects.enqueue(H + "block", kwargs={"gate": "finish"}).id
    wait_until(
        lambda: Task.objects.filter(pk=held, attempt_started=True).exists() and effects(held, "started"),
        what="the held task to start",
    )
    # Lock the running task's row: the round that finishes it (and claims what follows) must wait
    # inside the server, so the termination lands in the middle of that statement.
    with psycopg.connect(database_url()) as locker:
        locker.execute("SELECT id FROM tasks_task WHERE id = %s FOR UPDATE", [held])
        behind = Task.objects.bulk_enqueue(H + "record", [{}] * 10)
        Gate.objects.filter(key="finish").update(open=True)
        # The round waits for the lock up to 2 s, then the worker defers the finish and retries it
        # every round (a 50 ms wait each) while the lock is held: any of these waits is a statement
        # finishing the task cut in the middle. (Only the round's 2 s were looked for: a test process
        # starved of the CPU for 2 s on a loaded machine missed them.)
        stuck = wait_until(
            lambda: worker_backends(app, "wait_event_type = 'Lock' AND query LIKE '%%tasks_task%%'"),
            120,
            interval=0.005,
            what="a statement finishing the task to wait on the row lock",
        )
        # Every backend of the worker: the stuck round, the heartbeat, the listener, recovery.
        assert terminate(worker_backends(app)) >= len(stuck) + 1
        locker.rollback()
    everything = [held, *behind]
    wait_until(lambda: all_ended(everything), 30, what="every task to end")

    for task in Task.objects.filter(pk__in=everything):
        assert task.status == TaskStatus.SUCCESSFUL, task.errors
        assert charges(task) == (1, 0, 0, 0, 0)
        assert (task.errors, worker_names(task.worker_ids)) == ([], ["terminated"])
    assert effects(held, "finished") == 1
    assert all(effects(task_id, "done") == 1 for task_id in behind)

    assert_serves("terminated")
    stats = assert_stops(proc, "terminated")
    assert stats["connection_errors"] >= 1
    assert (stats["rejected"], stats["lost"]) == (0, 0)
    assert "failed (connection)" in workers.log("terminated")


def test_connections_cut_repeatedly_under_load_lose_nothing(proxy: PgProxy, workers: Workers) -> None:
    ids = Task.objects.bulk_enqueue(H + "work", [{"seconds": 0.05}] * 60)
    proc = workers.start("cut", "--concurrency", "2", DATABASE_URL=proxy.url_for(database_url()))
    errors_seen = 0
    for finished in (10, 25, 40):
        wait_until(partial(ended_at_least, ids, finished), 30, what=f"{finished} tasks to finish")
        assert proxy.kill_connections() >= 1
        # The dispatcher notices (its next round fails) and the heartbeat comes back before the next cut.
        errors_seen = wait_until(partial(connection_errors_above, "cut", errors_seen), what="the cut to be noticed")
    wait_until(lambda: all_ended(ids), 60, what="every task to end")

    for task in Task.objects.filter(pk__in=ids):
        assert task.status == TaskStatus.SUCCESSFUL, task.errors
        assert charges(task) == (1, 0, 0, 0, 0)
        assert worker_names(task.worker_ids) == ["cut"]

    assert_serves("cut")
    stats = assert_stops(proc, "cut")
    assert stats["connection_errors"] >= 3
    assert stats["rejected"] == 0


# -- fencing: a stale token renews nothing ------------------------------------------------------


def test_stale_token_heartbeats_renew_nothing_and_change_nothing(
    workers: Workers, client: Client, settings: Any
) -> None:
    settings.LEASING_API_TOKENS = [API_TOKEN]
    app = "fault-stale"
    Gate.objects.create(key="release")
    proc = workers.start("fenced", DATABASE_URL=url_with(database_url(), application_name=app))
    task_id = Task.objects.enqueue(H + "fail_first_then_block", kwargs={"gate": "release"}, max_attempts=2).id
    wait_until(
        lambda: (
            Task.objects.filter(pk=task_id, attempts=2, attempt_started=True).exists()
            and Effect.objects.filter(task_id=task_id, attempt=2, phase="started").exists()
        ),
        what="attempt 2 to run",
    )
    running = Task.objects.get(pk=task_id)
    stale = running.errors[0]["token"]  # attempt 1's grant
    assert stale < running.token

    def snapshot() -> tuple[Any, Any]:
        return Task.objects.filter(pk=task_id).values().get(), Worker.objects.filter(name="fenced").values().get()

    # Pause the worker so that nothing but the stale calls writes to its rows, then compare exactly.
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not worker_backends(app, "state = 'active'"), what="the worker's statements to end")
        before = snapshot()

        assert Task.objects.heartbeat("fenced", [(task_id, stale)], ttl=600) == {(task_id, stale)}
        assert snapshot() == before

        response = client.put(
            f"/api/tasks/{task_id}/heartbeat",
            data=json.dumps({"worker": "fenced", "token": stale, "ttl": 600, "progress": {"stale": True}}),
            content_type="application/json",
            headers={"Authorization": f"Bearer {API_TOKEN}"},
        )
        assert response.status_code == 409, response.content
        assert "heartbeat rejected" in response.json()["error"]
        assert snapshot() == before
    finally:
        os.kill(proc.pid, signal.SIGCONT)

    Gate.objects.filter(key="release").update(open=True)
    task = wait_for_end(task_id)
    assert task.status == TaskStatus.SUCCESSFUL
    assert task.return_value == {"attempt": 2, "token": running.token}
    assert (task.attempts, task.failures, task.crashes, task.progress) == (2, 1, 0, None)
    assert_serves("fenced")
    assert_stops(proc, "fenced")
