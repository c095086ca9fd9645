"""Long-running commands called in-process (``call_command``) return to their caller.

A worker started by ``manage.py run_worker`` may end its process hard once it has stopped (task code
can leave non-daemon threads behind); the same command called from a test or from a user's code must
not: ``os._exit`` there ended a whole pytest run at that test with status 0, the remaining tests never
run. Every command also puts the caller's signal handlers back.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, cast

import pytest
from django.core.management import call_command
from django.db import connection

from leasing.bounds import StatementBounds
from leasing.models import Lease
from tasks.maintenance.recovery import RECOVERY_LEASE
from tasks.models import Task, TaskStatus
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WORKER_ARGS = ("--no-recovery", "--no-scheduler", "--poll-interval", "0.05", "--concurrency", "2", "-v", "0")


def test_run_worker_returns_to_its_caller_twice_in_one_process() -> None:
    handlers_before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    for round_number in (1, 2):
        ids = [
            Task.objects.enqueue("tests.testapp.handlers.add", kwargs={"a": round_number, "b": i}).id for i in range(3)
        ]

        call_command("run_worker", "--max-tasks", "3", *WORKER_ARGS)

        # Reached only because the command returned; every task it claimed is finished and stored.
        done = dict(Task.objects.filter(pk__in=ids).values_list("pk", "status"))
        assert done == dict.fromkeys(ids, TaskStatus.SUCCESSFUL)
        results = sorted(
            cast(int, value) for value in Task.objects.filter(pk__in=ids).values_list("return_value", flat=True)
        )
        assert results == [round_number + i for i in range(3)]
        assert {signum: signal.getsignal(signum) for signum in handlers_before} == handlers_before
    # The hard-exit timer of a main program was never armed: no thread is left waiting to end us.
    # And the caller's connection is its own again: no worker bounds left on it.
    assert not [w for w in connection.execute_wrappers if isinstance(w, StatementBounds)]
    assert not [thread for thread in threading.enumerate() if thread.name == "hard-exit"]


def test_recover_tasks_stops_on_sigterm_and_gives_the_signal_back() -> None:
    """The loop commands stop on SIGTERM while they run, then leave the caller's handler in place."""
    calls: list[int] = []

    def callers_handler(signum: int, frame: Any) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:

        def stop_when_leading() -> None:
            # The command's own handler replaces the caller's while it runs; SIGTERM goes only then.
            try:
                wait_until(lambda: signal.getsignal(signal.SIGTERM) is not callers_handler, 20, what="the handler")
                wait_until(lambda: Lease.objects.active().filter(resource=RECOVERY_LEASE).exists(), 20, what="leading")
                os.kill(os.getpid(), signal.SIGTERM)
            finally:
                connection.close()  # this thread's own

        sender = threading.Thread(target=stop_when_leading)
        sender.start()
        call_command("recover_tasks", "--interval", "0.05", "-v", "0")
        sender.join(20)
        assert not sender.is_alive()

        assert signal.getsignal(signal.SIGTERM) is callers_handler
        assert calls == []  # the command's handler took that SIGTERM, not the caller's
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: calls == [signal.SIGTERM], 5, what="the caller's handler")
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_run_worker_from_a_non_main_thread_returns_and_leaves_that_threads_connection_unbounded() -> None:
    """Off the main thread no signal handler can be set: the command runs without them, returns after
    --max-tasks, and the calling thread's connection is neither bounded nor left with session state."""
    handlers_before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    ids = [Task.objects.enqueue("tests.testapp.handlers.add", kwargs={"a": 7, "b": i}).id for i in range(3)]
    seen: dict[str, Any] = {}

    def caller() -> None:
        try:
            for _ in range(2):  # twice in the same thread
                call_command("run_worker", "--max-tasks", "3" if not seen else "1", *WORKER_ARGS)
                seen.setdefault("returned", 0)
                seen["returned"] += 1
                if seen["returned"] == 1:
                    Task.objects.enqueue("tests.testapp.handlers.add", kwargs={"a": 8, "b": 0})
            seen["wrappers"] = [w for w in connection.execute_wrappers if isinstance(w, StatementBounds)]
            with connection.cursor() as cursor:
                cursor.execute("SELECT current_setting('statement_timeout'), current_setting('lock_timeout')")
                seen["settings"] = cursor.fetchone()
        except BaseException as exc:  # reported below
            seen["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=caller, name="breaker-caller")
    thread.start()
    wait_until(lambda: not thread.is_alive(), 60, what="the command to return in its thread")
    assert "error" not in seen, seen.get("error")
    assert seen["returned"] == 2
    assert seen["wrappers"] == []
    assert seen["settings"] == ("0", "0")
    assert Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL).count() == 3
    assert {signum: signal.getsignal(signum) for signum in handlers_before} == handlers_before
