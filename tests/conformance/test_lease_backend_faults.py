"""LeaseBackend and the worker's django.tasks signals under faults (issue 10).

Real workers (threads and ``run_worker`` processes, killed and stopped mid-task), receivers that
raise, block or enqueue, bursts, async and retrying tasks. Each test states the invariant it attacks:

- a result's task keeps ``.using()`` through enqueue, get_result, refresh and every signal;
- ``task_finished`` is sent exactly once per attempt that sent ``task_started``, after the outcome is
  stored, with the stored status;
- ``TaskResult.attempts == len(worker_ids) == context.attempt``;
- what jsonb cannot hold never reaches the database, and a value that can never be stored is not
  retried;
- a stop is prompt.


Found by a bug hunt (breaker) on issue 10: the django.tasks backend."""

# Django TestCase style, as in the ported tests: unittest assertions.
# ruff: noqa: PT009, PT027

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import threading
from collections import Counter
from typing import Any, cast

from django.db import connections
from django.test import override_settings
from django.utils import timezone

from tasks.compat import TaskResult, TaskResultStatus, default_task_backend, task_enqueued, task_finished, task_started
from tasks.exceptions import TaskLeaseLost, TaskTimeout, WorkerShutdown
from tasks.models import Task as TaskRow
from tasks.worker.process import Worker
from tests.conformance import fault_tasks, lease_tasks
from tests.conformance import tasks as test_tasks
from tests.conformance.harness import (
    WAIT,
    BackendTestCase,
    ProcessWorkerTestCase,
    ThreadWorkerTestCase,
)
from tests.conformance.recorder import EVENTS_ENV
from tests.conformance.test_lease_backend import RETRYING, SETTINGS, start_worker
from tests.helpers import iso_time, start_manage, stop_process, wait_until, worker_names
from tests.testapp.models import Gate

#: A hang guard, not a deadline: a stopped worker still running this long later is hung.
STOP_HANG_GUARD = 120.0


def when(value: str | None) -> dt.datetime | None:
    return None if value is None else iso_time(value)


def close_in_time(a: dt.datetime | None, b: dt.datetime | None) -> bool:
    return a is not None and b is not None and abs(a - b) <= dt.timedelta(milliseconds=1)


class Receiver:
    """A receiver connected for the length of a ``with`` block (after the recorder: the recorder
    sees every signal before this one runs)."""

    def __init__(self, signal_: Any, func: Any) -> None:
        self.signal, self.func = signal_, func

    def __enter__(self) -> Receiver:
        self.signal.connect(self.func, weak=False)
        return self

    def __exit__(self, *exc: object) -> None:
        self.signal.disconnect(self.func)


@SETTINGS
class ThreadBreakerTestCase(ThreadWorkerTestCase):
    # -- receivers ------------------------------------------------------------------------------

    def test_a_finished_receiver_raising_anything_does_not_silence_later_signals(self):
        """Receivers are user code: one raising SystemExit or KeyboardInterrupt must not end the
        worker's task_finished for every later attempt."""
        raising = {"exception": ValueError("receiver fails"), "exit": SystemExit(3), "interrupt": KeyboardInterrupt()}

        def receiver(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:
            if task_result.args and task_result.args[0] in raising:
                raise raising[task_result.args[0]]

        with Receiver(task_finished, receiver):
            for name in raising:
                with self.subTest(name):
                    victim = lease_tasks.echo.enqueue(name)
                    finished = self.wait_finished(victim)
                    self.assertEqual((finished["status"], finished["stored_status"]), ("SUCCESSFUL", "SUCCESSFUL"))
                    after = lease_tasks.echo.enqueue(f"after {name}")
                    self.wait_finished(after)
                    self.assertEqual(after.return_value, f"after {name}")
                    self.assertEqual(len(self.events(victim.id, "finished")), 1)
                    self.assertEqual(len(self.events(after.id, "finished")), 1)

    def test_a_started_receiver_raising_system_exit_fails_that_attempt_only(self):
        def receiver(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:
            if task_result.args == ["doomed"]:
                raise SystemExit("a task_started receiver exits")

        with Receiver(task_started, receiver):
            doomed = lease_tasks.echo.enqueue("doomed")
            finished = self.wait_finished(doomed)
        self.assertEqual((finished["status"], finished["stored_status"]), ("FAILED", "FAILED"))
        self.assertEqual([e.exception_class_path for e in doomed.errors], ["builtins.SystemExit"])
        self.assertEqual(len(self.events(doomed.id, "finished")), 1)
        after = lease_tasks.echo.enqueue("after")
        self.wait_finished(after)
        self.assertEqual(after.status, TaskResultStatus.SUCCESSFUL)

    def test_a_blocked_finished_receiver_does_not_hold_up_the_worker(self):
        entered, release = threading.Event(), threading.Event()

        def receiver(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:
            if task_result.args == ["block"]:
                entered.set()
                release.wait(WAIT)

        with Receiver(task_finished, receiver):
            blocker = lease_tasks.echo.enqueue("block")
            try:
                self.assertTrue(entered.wait(WAIT))
                others = [lease_tasks.echo.using(priority=i % 3).enqueue(i) for i in range(20)]
                ids = [int(r.id) for r in others]
                wait_until(
                    lambda: TaskRow.objects.filter(pk__in=ids, status="SUCCESSFUL").count() == len(ids),
                    WAIT,
                    what="the worker to go on while a receiver blocks",
                )
            finally:
                release.set()
            for result in [blocker, *others]:
                finished = self.wait_finished(result)
                self.assertEqual((finished["status"], finished["stored_status"]), ("SUCCESSFUL", "SUCCESSFUL"))
                self.assertEqual(len(self.events(result.id, "finished")), 1)
                self.assertEqual(finished["task"]["priority"], result.task.priority)

    def test_a_started_receiver_blocking_past_the_timeout_ends_the_attempt_once(self):
        stalled, release = threading.Event(), threading.Event()

        def receiver(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:
            if task_result.args == ["stall"]:
                stalled.set()
                release.wait(WAIT)

        dropped = self.worker.stats["late_results_dropped"]
        with Receiver(task_started, receiver):
            try:
                result = lease_tasks.echo.using(backend="timed").enqueue("stall")
                finished = self.wait_finished(result)
            finally:
                release.set()
            wait_until(lambda: self.worker.stats["late_results_dropped"] > dropped, WAIT, what="the late return")
        self.assertTrue(stalled.is_set())
        self.assertEqual((finished["status"], finished["stored_status"]), ("FAILED", "FAILED"))
        self.assertEqual([e[0] for e in finished["errors"]], ["tasks.exceptions.TaskTimeout"])
        self.assertEqual(finished["task"]["backend"], "timed")
        self.assertEqual(len(self.events(result.id, "finished")), 1)
        self.assertIsNone(TaskRow.objects.get(pk=int(result.id)).return_value)

    def test_receivers_that_enqueue_chain_tasks_each_signalled_once(self):
        chained: list[TaskResult] = []
        lock = threading.Lock()

        def on_finished(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:
            args = task_result.args
            if task_result.task.name == "echo" and args and isinstance(args[0], int) and args[0] < 5:
                with lock:
                    chained.append(lease_tasks.echo.using(queue_name="queue_1", priority=7).enqueue(args[0] + 1))

        def on_started(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:
            if task_result.args == [0]:
                with lock:
                    chained.append(lease_tasks.echo.enqueue("from task_started"))

        with Receiver(task_finished, on_finished), Receiver(task_started, on_started):
            first = lease_tasks.echo.enqueue(0)
            self.wait_finished(first)
            wait_until(lambda: len(chained) == 6, WAIT, what="the chain of enqueues")
            for result in list(chained):
                self.wait_finished(result)
        self.assertEqual(sorted(r.return_value for r in chained if isinstance(r.return_value, int)), [1, 2, 3, 4, 5])
        for result in [first, *chained]:
            self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
            self.assertEqual([e["signal"] for e in self.events(result.id)], ["enqueued", "started", "finished"])
            if result is not first and isinstance(result.return_value, int):
                self.assertEqual((result.task.queue_name, result.task.priority), ("queue_1", 7))

    def test_an_enqueued_receiver_that_raises_leaves_no_task(self):
        def receiver(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:
            if task_result.args == ["refused"]:
                raise ValueError("a task_enqueued receiver refuses it")

        with Receiver(task_enqueued, receiver), self.assertRaisesMessage(ValueError, "refuses it"):
            lease_tasks.echo.enqueue("refused")
        self.assertFalse(TaskRow.objects.exists())
        after = lease_tasks.echo.enqueue("after")
        self.wait_finished(after)
        self.assertEqual(TaskRow.objects.count(), 1)

    # -- leases ---------------------------------------------------------------------------------

    def test_an_attempt_whose_lease_was_taken_over_finishes_once_as_far_as_it_went(self):
        gate = "taken-over"
        Gate.objects.create(key=gate)
        try:
            result = lease_tasks.block_first_attempt.using(priority=5).enqueue(gate)
            task_id = int(result.id)
            wait_until(
                lambda: TaskRow.objects.filter(pk=task_id, attempt_started=True).exists(), WAIT, what="attempt 1"
            )
            # Attempt 1's lease lapses (as if its heartbeats stopped getting through) and the task is
            # recovered; the same worker takes it again while attempt 1 is still blocked.
            TaskRow.objects.filter(pk=task_id).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
            self.assertEqual([r.id for r in TaskRow.objects.recover_expired()], [task_id])
            done = wait_until(lambda: self._finished_event(result.id), WAIT, what="attempt 2")
            self.assertEqual((done["status"], done["stored_status"], done["attempts"]), ("SUCCESSFUL", "SUCCESSFUL", 2))
        finally:
            Gate.objects.filter(key=gate).update(open=True)
        wait_until(lambda: len(self.events(result.id, "finished")) == 2, WAIT, what="attempt 1's late end")
        self.wait_finished(lease_tasks.echo.enqueue("a later task"))  # signals are sent in order
        first_end, late = self.events(result.id, "finished")
        self.assertEqual(first_end, done)
        self.assertEqual((late["status"], late["attempts"]), ("READY", 1))
        self.assertEqual([e[0] for e in late["errors"]], ["tasks.exceptions.TaskLeaseLost"])
        self.assertEqual(late["task"]["priority"], 5)
        result.refresh()
        self.assertEqual((result.status, result.attempts, len(result.worker_ids)), (TaskResultStatus.SUCCESSFUL, 2, 2))
        self.assertEqual(result.return_value["attempt"], 2)
        self.assertEqual(len(self.events(result.id, "started")), 2)

    # -- retries, timeouts, async ---------------------------------------------------------------

    @override_settings(LEASING_TASKS=RETRYING)
    def test_a_timed_out_attempt_that_is_retried_finishes_ready_then_the_retry_counts_two(self):
        result = fault_tasks.slow_first_attempt.using(backend="timed", priority=4).enqueue(1.0)
        self.wait_finished(result)
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        first, last = self.events(result.id, "finished")
        self.assertEqual((first["status"], first["attempts"], first["finished_at"]), ("READY", 1, None))
        self.assertEqual([e[0] for e in first["errors"]], ["tasks.exceptions.TaskTimeout"])
        self.assertEqual((last["status"], last["stored_status"], last["attempts"]), ("SUCCESSFUL", "SUCCESSFUL", 2))
        for event in (first, last):
            self.assertEqual((event["task"]["backend"], event["task"]["priority"]), ("timed", 4))
        inside = result.return_value
        self.assertEqual((inside["attempt"], inside["attempts"], result.attempts), (2, 2, 2))
        self.assertEqual(inside["worker_ids"], result.worker_ids)
        self.assertEqual(len(result.worker_ids), 2)
        self.assertEqual(inside["task"]["backend"], "timed")
        self.assertIs(result.errors[0].exception_class, TaskTimeout)

    @override_settings(LEASING_TASKS=RETRYING)
    def test_an_async_task_retried_sees_its_attempts_and_the_earlier_error(self):
        run_after = timezone.now()
        used = fault_tasks.async_fail_first_attempt.using(queue_name="queue_1", priority=-3, run_after=run_after)
        result = used.enqueue()
        self.wait_finished(result)
        self.assertEqual((result.status, result.task), (TaskResultStatus.SUCCESSFUL, used))
        first, last = self.events(result.id, "finished")
        self.assertEqual(first["status"], "READY")
        self.assertIn("async attempt 1 fails on purpose", first["errors"][0][1])
        self.assertEqual((last["status"], last["attempts"]), ("SUCCESSFUL", 2))
        inside: dict[str, Any] = cast(Any, result.return_value)  # what the coroutine returned
        self.assertEqual((inside["attempt"], inside["attempts"], len(inside["worker_ids"])), (2, 2, 2))
        self.assertEqual(inside["errors"], ["builtins.ValueError"])
        self.assertEqual(
            inside["task"],
            {"priority": -3, "queue_name": "queue_1", "run_after": run_after.isoformat(), "backend": "default"},
        )
        started = self.events(result.id, "started")
        self.assertEqual([s["attempts"] for s in started], [1, 2])
        self.assertEqual(when(started[1]["started_at"]), result.started_at)
        self.assertTrue(close_in_time(when(inside["last_attempted_at"]), result.last_attempted_at))

    # -- what reaches the database --------------------------------------------------------------

    @override_settings(LEASING_TASKS=RETRYING)
    def test_return_values_that_can_never_be_stored_fail_once_and_store_nothing(self):
        results: list[TaskResult] = [fault_tasks.return_unstorable.enqueue(kind) for kind in fault_tasks.UNSTORABLE]
        results.append(fault_tasks.return_deep.enqueue(5000))
        for result in results:
            with self.subTest(result.args):
                finished = self.wait_finished(result)
                self.assertEqual((result.status, result.attempts), (TaskResultStatus.FAILED, 1))
                self.assertEqual((finished["status"], finished["stored_status"]), ("FAILED", "FAILED"))
                self.assertEqual(len(self.events(result.id, "finished")), 1)
                self.assertIsNone(TaskRow.objects.get(pk=int(result.id)).return_value)

    def test_arguments_jsonb_cannot_hold_are_refused_wherever_they_hide(self):
        deep: list[Any] = []
        for _ in range(5000):
            deep = [deep]
        for n, value in enumerate(
            [
                {"key with \x00": 1},
                {"\udfff": "lone surrogate as a key"},
                b"bytes with \x00",
                {float("nan"): "nan as a key"},
                [[{"deep": float("-inf")}]],
                deep,
            ]
        ):
            with self.subTest(n), self.assertRaises((TypeError, ValueError, RecursionError)):
                lease_tasks.echo.enqueue(value=value)
        self.assertEqual(TaskRow.objects.count(), 0)
        self.assertEqual(self.events(signal="enqueued"), [])


@SETTINGS
class ProcessBurstTestCase(ProcessWorkerTestCase):
    @override_settings(LEASING_TASKS=RETRYING)
    def test_a_burst_of_mixed_tasks_each_signalled_once_after_its_outcome_is_stored(self):
        results: list[TaskResult] = []
        for i in range(60):
            queue_name = ("default", "queue_1")[i % 2]
            kind = i % 5
            if kind == 0:
                task = lease_tasks.echo.using(queue_name=queue_name, priority=i % 7)
                results.append(task.enqueue(i))
            elif kind == 1:
                results.append(test_tasks.failing_task_value_error.using(queue_name=queue_name).enqueue())
            elif kind == 2:
                results.append(fault_tasks.async_report.using(queue_name=queue_name, priority=-1).enqueue())
            elif kind == 3:
                results.append(lease_tasks.fail_first_attempt.using(queue_name=queue_name).enqueue())
            else:
                results.append(fault_tasks.async_fail_first_attempt.using(queue_name=queue_name).enqueue())
        for result in results:
            self.wait_finished(result, timeout=60)
        for result in results:
            with self.subTest(result.id):
                started = self.events(result.id, "started")
                finished = self.events(result.id, "finished")
                self.assertEqual(len(started), result.attempts)  # one task_started per attempt
                self.assertEqual(len(finished), result.attempts)  # and one task_finished
                self.assertEqual(result.attempts, len(result.worker_ids))
                for n, (start, end) in enumerate(zip(started, finished, strict=True), 1):
                    self.assertEqual((start["attempts"], end["attempts"]), (n, n))
                    self.assertIsNotNone(start["started_at"])
                    self.assertIsNotNone(start["last_attempted_at"])
                    expected = {
                        "module_path": result.task.module_path,
                        "priority": result.task.priority,
                        "queue_name": result.task.queue_name,
                        "run_after": None,
                        "backend": "default",
                    }
                    self.assertEqual(start["task"], expected)
                    self.assertEqual(end["task"], expected)
                # Every attempt but the last was stored READY (retried); the last, final.
                self.assertEqual([e["status"] for e in finished[:-1]], ["READY"] * (len(finished) - 1))
                self.assertEqual(finished[-1]["status"], str(result.status))
                self.assertEqual(finished[-1]["stored_status"], str(result.status))
                if result.status == TaskResultStatus.SUCCESSFUL and isinstance(result.return_value, dict):
                    inside = result.return_value
                    self.assertEqual((inside["attempt"], inside["attempts"]), (result.attempts, result.attempts))
        statuses = Counter(str(r.status) for r in results)
        self.assertEqual(statuses, Counter({"SUCCESSFUL": 48, "FAILED": 12}))


def worker_process(workdir: Any, events_path: str, worker_id: str, *args: str) -> subprocess.Popen[bytes]:
    return start_manage(
        workdir / f"{worker_id}.log",
        "run_worker",
        "--queues",
        "default",
        "--concurrency",
        "1",
        "--no-recovery",
        "--no-scheduler",
        "--worker-id",
        worker_id,
        *args,
        DJANGO_SETTINGS_MODULE="tests.conformance.worker_settings",
        **{EVENTS_ENV: events_path},
    )


@SETTINGS
class KilledWorkerTestCase(BackendTestCase):
    def _stalled(self, result: TaskResult, worker_id: str) -> str:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pid, state, wait_event_type, wait_event, pg_blocking_pids(pid), xact_start,"
                " left(query, 200) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid()"
            )
            sessions = "\n".join(map(repr, cursor.fetchall()))
        row = TaskRow.objects.filter(pk=int(result.id)).values("status", "attempts", "worker_ids", "run_after").first()
        log = (self.workdir / f"{worker_id}.log").read_text()[-4000:]
        return f"task: {row}\nsessions:\n{sessions}\nworker log (tail):\n{log}"

    def _start_blocked(self, gate: str, worker_id: str, *args: str) -> tuple[TaskResult, subprocess.Popen[bytes]]:
        Gate.objects.create(key=gate)
        result = lease_tasks.block_first_attempt.using(priority=3).enqueue(gate)
        process = worker_process(self.workdir, self.events_path, worker_id, *args)
        try:
            wait_until(
                lambda: (
                    process.poll() is not None
                    or TaskRow.objects.filter(pk=int(result.id), attempt_started=True).exists()
                ),
                WAIT,
                what="attempt 1 to start in the worker process",
            )
        except AssertionError as timed_out:
            # Seen once in a full run: what the worker wrote, where the task stood and what every
            # other session of this database was doing say why (the worker is ended by conftest.py).
            raise AssertionError(f"{timed_out}\n{self._stalled(result, worker_id)}") from None
        self.assertIsNone(process.poll(), (self.workdir / f"{worker_id}.log").read_text())
        wait_until(lambda: self.events(result.id, "started"), WAIT, what="task_started of attempt 1")
        return result, process

    def _second_attempt(self, result: TaskResult, worker_id: str) -> dict[str, Any]:
        worker, thread = start_worker(worker_id)
        try:
            self.wait_finished(result)
        finally:
            worker.request_stop()
            thread.join(WAIT)
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        return result.return_value

    def test_a_worker_killed_mid_task_costs_one_attempt_and_the_next_knows_it(self):
        result, process = self._start_blocked("killed", "killed-1", "--ttl", "1", "--poll-interval", "0.05")
        try:
            os.kill(process.pid, signal.SIGKILL)
            self.assertEqual(process.wait(WAIT), -signal.SIGKILL)
            task_id = int(result.id)
            wait_until(lambda: TaskRow.objects.filter(pk=task_id).stuck().exists(), WAIT, what="the lease to lapse")
            self.assertEqual([r.id for r in TaskRow.objects.recover_expired()], [task_id])
            recovered = default_task_backend.get_result(result.id)
            self.assertEqual((recovered.status, recovered.attempts), (TaskResultStatus.READY, 1))
            self.assertEqual(worker_names(recovered.worker_ids), ["killed-1"])
            self.assertIs(recovered.errors[0].exception_class, TaskLeaseLost)
            self.assertEqual(recovered.task, result.task)

            inside = self._second_attempt(result, "killed-2")
        finally:
            Gate.objects.filter(key="killed").update(open=True)
            stop_process(process)
        self.assertEqual((inside["attempt"], inside["attempts"], result.attempts), (2, 2, 2))
        self.assertEqual(worker_names(result.worker_ids), ["killed-1", "killed-2"])
        self.assertEqual(inside["worker_ids"], result.worker_ids)
        self.assertEqual(inside["errors"], ["tasks.exceptions.TaskLeaseLost"])
        self.assertEqual(inside["task"]["priority"], 3)
        first_start, second_start = self.events(result.id, "started")
        self.assertNotEqual(first_start["pid"], os.getpid())
        self.assertEqual(when(first_start["started_at"]), result.started_at)  # the first attempt's start
        self.assertEqual(when(second_start["started_at"]), result.started_at)
        # The killed process sent nothing more; the second attempt, one task_finished.
        [finished] = self.events(result.id, "finished")
        self.assertEqual((finished["status"], finished["attempts"], finished["pid"]), ("SUCCESSFUL", 2, os.getpid()))

    def test_sigterm_mid_task_hands_back_once_signalled_and_exits_promptly(self):
        # A poll interval of an hour: a stop that waited for a poll would still be running at the
        # hang guard (how soon it exits is the machine's load, not a verdict).
        result, process = self._start_blocked(
            "terminated", "terminated-1", "--ttl", "5", "--poll-interval", "3600", "--shutdown-grace", "0"
        )
        try:
            os.kill(process.pid, signal.SIGTERM)
            code = process.wait(STOP_HANG_GUARD)
            log = (self.workdir / "terminated-1.log").read_text()
            self.assertEqual(code, 0, log)
            [handed] = self.events(result.id, "finished")
            self.assertNotEqual(handed["pid"], os.getpid())
            self.assertEqual((handed["status"], handed["stored_status"], handed["attempts"]), ("READY", "READY", 1))
            self.assertEqual([e[0] for e in handed["errors"]], ["tasks.exceptions.WorkerShutdown"])
            self.assertEqual(handed["task"]["priority"], 3)

            inside = self._second_attempt(result, "terminated-2")
        finally:
            Gate.objects.filter(key="terminated").update(open=True)
            stop_process(process)
        self.assertEqual((inside["attempt"], inside["attempts"], result.attempts), (2, 2, 2))
        self.assertEqual(worker_names(result.worker_ids), ["terminated-1", "terminated-2"])
        self.assertEqual(inside["errors"], ["tasks.exceptions.WorkerShutdown"])
        self.assertIs(result.errors[0].exception_class, WorkerShutdown)
        self.assertEqual([e["status"] for e in self.events(result.id, "finished")], ["READY", "SUCCESSFUL"])

    def test_an_idle_worker_thread_stops_without_waiting_for_a_poll(self):
        worker = Worker(
            queues=["default"],
            concurrency=2,
            ttl=5,
            poll_interval=3600,  # a stop that waited for a poll would outlast the hang guard
            recovery=False,
            install_signal_handlers=False,
            worker_id="prompt-stop",
        )
        running = threading.Event()

        def serve() -> None:
            try:
                running.set()
                worker.run()
            finally:
                connections.close_all()

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            self.assertTrue(running.wait(WAIT))
            result = lease_tasks.echo.enqueue("last task")
            wait_until(lambda: TaskRow.objects.filter(pk=int(result.id), status="SUCCESSFUL").exists(), WAIT)
            worker.request_stop()
            thread.join(STOP_HANG_GUARD)
        finally:
            worker.request_stop()
            thread.join(WAIT)
        self.assertFalse(thread.is_alive())
        self.assertEqual(len(self.events(result.id, "finished")), 1)
