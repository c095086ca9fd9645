"""LeaseBackend where Django's own tests are silent or where a worker-run backend differs from the
immediate one: not ported, this project's own tests (see README.md in this folder).

- the Task as enqueued (``.using()`` values, backend alias) in results, signals and the context;
- complete results in ``task_started`` / the context / ``task_finished``, and ``task_finished``
  sent after the outcome is stored, with the stored status (READY for an attempt to be retried,
  FAILED for a task cancelled under a running attempt);
- Django's normalisation of arguments and return values, and what jsonb cannot hold refused cleanly;
- rows enqueued through the backend run only Task objects;
- the enqueue is part of the caller's transaction; KeyboardInterrupt fails the attempt;
- a hand-back at shutdown: attempts, worker_ids and context.attempt agree;
- ``run_worker --backend`` / ``--database`` serve a backend's own database and queues.
"""

# Django TestCase style, as in the ported tests: unittest assertions.
# ruff: noqa: PT009, PT027

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.test import override_settings
from django.utils import timezone

from tasks.backends.backend import LeaseBackend
from tasks.compat import (
    IMMEDIATE_BACKEND,
    InvalidTask,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    default_task_backend,
    task_backends,
)
from tasks.exceptions import NotATask, TaskTimeout, UnstorableResult, WorkerShutdown
from tasks.models import Task as TaskRow
from tasks.worker.process import Worker
from tests.conformance import lease_tasks
from tests.conformance import tasks as test_tasks
from tests.conformance.harness import (
    CONFORMANCE_LEASING_TASKS,
    WAIT,
    BackendTestCase,
    ProcessWorkerTestCase,
    ThreadWorkerTestCase,
)
from tests.conformance.recorder import EVENTS_ENV
from tests.helpers import iso_time, start_manage, stop_process, wait_until, worker_names
from tests.testapp.models import Gate

LEASE_BACKENDS = {
    "default": {"BACKEND": "tasks.backends.LeaseBackend", "QUEUES": []},
    # Another alias on the same database: results must say which one enqueued them.
    "other": {"BACKEND": "tasks.backends.LeaseBackend", "QUEUES": ["default", "queue_1"]},
    "immediate": {"BACKEND": IMMEDIATE_BACKEND, "QUEUES": []},
    "timed": {"BACKEND": "tasks.backends.LeaseBackend", "QUEUES": [], "OPTIONS": {"timeout": 0.3}},
}
SETTINGS = override_settings(TASKS=LEASE_BACKENDS, LEASING_TASKS=CONFORMANCE_LEASING_TASKS)
RETRYING = {**CONFORMANCE_LEASING_TASKS, "MAX_ATTEMPTS": 3}


def when(value: str | None) -> dt.datetime | None:
    return None if value is None else iso_time(value)


def close_in_time(a: dt.datetime | None, b: dt.datetime | None) -> bool:
    """The same instant, as far as a start time sent as epoch seconds (a float) can be."""
    return a is not None and b is not None and abs(a - b) <= dt.timedelta(milliseconds=1)


# The tests are written once and run by two test cases (bottom); type-checked as one of them.
if TYPE_CHECKING:
    _Tests = BackendTestCase
else:
    _Tests = object


class LeaseBackendTests(_Tests):
    """Run by a class with the worker in a thread and one with the worker process (bottom)."""

    # -- the task as enqueued ------------------------------------------------------------------

    def test_results_signals_and_context_carry_the_task_as_enqueued(self):
        run_after = timezone.now() + dt.timedelta(milliseconds=300)
        used = lease_tasks.report.using(priority=10, queue_name="queue_1", run_after=run_after)
        result = used.enqueue()
        self.assertEqual(result.task, used)
        self.assertEqual(default_task_backend.get_result(result.id).task, used)
        expected = {
            "module_path": used.module_path,
            "priority": 10,
            "queue_name": "queue_1",
            "run_after": run_after.isoformat(),
            "backend": "default",
        }
        [enqueued] = self.events(result.id, "enqueued")
        self.assertEqual(enqueued["task"], expected)

        finished = self.wait_finished(result)
        [started] = self.events(result.id, "started")
        self.assertEqual(started["task"], expected)
        self.assertEqual(finished["task"], expected)
        self.assertEqual(result.task, used)
        self.assertEqual(default_task_backend.get_result(result.id).task, used)
        self.assertEqual(
            result.return_value["task"],
            {"priority": 10, "queue_name": "queue_1", "run_after": run_after.isoformat(), "backend": "default"},
        )
        assert result.started_at is not None
        self.assertGreaterEqual(result.started_at, run_after)  # deferred, and run when due

    def test_results_keep_the_backend_alias_that_enqueued_them(self):
        used = lease_tasks.report.using(backend="other")
        result = used.enqueue()
        self.assertEqual(result.backend, "other")
        self.assertEqual(TaskRow.objects.get(pk=int(result.id)).backend_alias, "other")

        finished = self.wait_finished(result)  # refresh() asks task.get_backend(): "other"
        self.assertEqual((result.backend, result.task), ("other", used))
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual(task_backends["other"].get_result(result.id), result)
        # Read through another alias of the same database, the result still names its own.
        through_default = task_backends["default"].get_result(result.id)
        self.assertEqual((through_default.backend, through_default.task.backend), ("other", "other"))
        self.assertEqual((finished["backend"], finished["task"]["backend"]), ("other", "other"))
        self.assertEqual(result.return_value["task"]["backend"], "other")

    # -- complete results in the signals and the context ---------------------------------------

    def test_started_and_finished_signals_and_the_context_carry_complete_results(self):
        result = lease_tasks.report.enqueue()
        finished = self.wait_finished(result)
        [started] = self.events(result.id, "started")
        seen_inside = result.return_value
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual(len(result.worker_ids), 1)

        for view in (started, seen_inside):
            self.assertEqual(view["status"], "RUNNING")
            self.assertTrue(close_in_time(when(view["started_at"]), result.started_at), view)
            self.assertEqual(view["last_attempted_at"], view["started_at"])
            self.assertIsNone(view["finished_at"])
            self.assertEqual(view["worker_ids"], result.worker_ids)
            self.assertEqual(view["errors"], [])
        self.assertEqual((started["attempts"], seen_inside["attempt"], seen_inside["attempts"]), (1, 1, 1))
        self.assertEqual(started["sender"], "tasks.backends.LeaseBackend")

        # task_finished: the stored result, sent once the outcome was written.
        self.assertEqual((finished["status"], finished["stored_status"]), ("SUCCESSFUL", "SUCCESSFUL"))
        self.assertEqual(when(finished["finished_at"]), result.finished_at)
        self.assertEqual(when(finished["started_at"]), result.started_at)
        self.assertEqual(when(finished["last_attempted_at"]), result.last_attempted_at)
        self.assertEqual(finished["return_value"], result.return_value)
        self.assertEqual((finished["attempts"], finished["worker_ids"]), (1, result.worker_ids))
        self.assertEqual(finished["sender"], "tasks.backends.LeaseBackend")
        self.assertEqual(len(self.events(result.id, "finished")), 1)

    def test_a_failed_attempt_finishes_with_its_error_and_traceback(self):
        result = test_tasks.failing_task_value_error.enqueue()
        finished = self.wait_finished(result)
        self.assertEqual((finished["status"], finished["stored_status"]), ("FAILED", "FAILED"))
        self.assertEqual(when(finished["finished_at"]), result.finished_at)
        [(path, traceback)] = finished["errors"]
        self.assertEqual(path, "builtins.ValueError")
        self.assertTrue(traceback.endswith("ValueError: This Task failed due to ValueError\n"), traceback)
        self.assertIn("failing_task_value_error", traceback)
        self.assertEqual([(e.exception_class_path, e.traceback) for e in result.errors], [(path, traceback)])

    @override_settings(LEASING_TASKS=RETRYING)
    def test_an_attempt_that_will_be_retried_finishes_ready_and_the_retry_sees_it(self):
        result = lease_tasks.fail_first_attempt.enqueue()
        self.wait_finished(result)
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual((result.attempts, len(result.errors)), (2, 1))

        first, last = self.events(result.id, "finished")
        self.assertEqual(first["status"], "READY")  # what was stored: the task goes back to the queue
        self.assertIsNone(first["finished_at"])
        self.assertEqual(first["attempts"], 1)
        self.assertEqual([e[0] for e in first["errors"]], ["builtins.ValueError"])
        self.assertIn("attempt 1 fails on purpose", first["errors"][0][1])
        self.assertEqual((last["status"], last["stored_status"], last["attempts"]), ("SUCCESSFUL", "SUCCESSFUL", 2))

        start_1, start_2 = self.events(result.id, "started")
        self.assertEqual((start_1["attempts"], start_2["attempts"]), (1, 2))
        # started_at is the first attempt's; last_attempted_at this one's; the earlier error is known.
        self.assertEqual(when(start_2["started_at"]), result.started_at)
        self.assertTrue(close_in_time(when(start_2["last_attempted_at"]), result.last_attempted_at))
        first_started, this_attempt = when(start_2["started_at"]), when(start_2["last_attempted_at"])
        assert first_started is not None and this_attempt is not None
        self.assertGreater(this_attempt, first_started)
        self.assertEqual([e[0] for e in start_2["errors"]], ["builtins.ValueError"])
        inside = result.return_value
        self.assertEqual((inside["attempt"], inside["attempts"]), (2, 2))
        self.assertEqual(inside["errors"], ["builtins.ValueError"])
        self.assertEqual(inside["worker_ids"], result.worker_ids)

    def test_a_task_cancelled_while_running_finishes_failed_when_its_attempt_ends(self):
        gate = f"cancel-{self.mode}"
        Gate.objects.create(key=gate)
        result = lease_tasks.wait_for_gate.enqueue(gate)
        wait_until(lambda: self.events(result.id, "started"), WAIT, what="the task to start")
        self.assertEqual(TaskRow.objects.filter(pk=int(result.id)).cancel(), 1)
        Gate.objects.filter(key=gate).update(open=True)  # the attempt returns; the lease is no longer its
        finished = self.wait_finished(result)
        self.assertEqual((finished["status"], finished["stored_status"]), ("FAILED", "CANCELLED"))
        self.assertEqual(result.status, TaskResultStatus.FAILED)
        self.assertEqual(when(finished["finished_at"]), result.finished_at)
        self.assertEqual(TaskRow.objects.get(pk=int(result.id)).return_value, None)  # the late result refused

    def test_an_attempt_past_its_timeout_finishes_when_it_is_abandoned_and_only_then(self):
        dropped = cast(ThreadWorkerTestCase, self).worker.stats["late_results_dropped"] if self.mode == "thread" else 0
        result = test_tasks.sleep_for.using(backend="timed").enqueue(1.5)
        finished = self.wait_finished(result)
        self.assertEqual((finished["status"], finished["stored_status"]), ("FAILED", "FAILED"))
        self.assertEqual([e[0] for e in finished["errors"]], ["tasks.exceptions.TaskTimeout"])
        self.assertIs(result.errors[0].exception_class, TaskTimeout)
        assert result.finished_at is not None and result.started_at is not None
        self.assertLess(result.finished_at - result.started_at, dt.timedelta(seconds=1.5))  # not waited for
        if self.mode == "thread":  # the handler returns later: its result is dropped, and not signalled
            worker = cast(ThreadWorkerTestCase, self).worker
            wait_until(lambda: worker.stats["late_results_dropped"] > dropped, WAIT, what="the late return")
            self.assertEqual(len(self.events(result.id, "finished")), 1)

    # -- what runs -------------------------------------------------------------------------------

    @override_settings(LEASING_TASKS=RETRYING)
    def test_rows_enqueued_through_the_backend_run_only_tasks(self):
        path = "tests.conformance.lease_tasks.not_a_task"
        refused = TaskRow.objects.enqueue(path, backend_alias="default").id
        missing = TaskRow.objects.enqueue("tests.conformance.lease_tasks.missing", backend_alias="default").id
        plain = TaskRow.objects.enqueue(path).id  # Task.objects.enqueue: any callable
        wait_until(
            lambda: TaskRow.objects.filter(pk__in=[refused, missing, plain]).finished().count() == 3,
            WAIT,
            what="the three tasks to end",
        )
        rows = {row.pk: row for row in TaskRow.objects.filter(pk__in=[refused, missing, plain])}
        self.assertEqual(
            (rows[refused].status, rows[refused].attempts, rows[refused].errors[0]["exception_class_path"]),
            ("FAILED", 1, "tasks.exceptions.NotATask"),  # not retried: it will not become a Task
        )
        self.assertIn("is not a django.tasks Task", rows[refused].errors[0]["message"])
        self.assertEqual(
            (rows[missing].status, rows[missing].attempts, rows[missing].errors[0]["exception_class_path"]),
            ("FAILED", 1, "builtins.ImportError"),
        )
        self.assertEqual((rows[plain].status, rows[plain].return_value), ("SUCCESSFUL", "ran"))
        self.assertTrue(issubclass(NotATask, InvalidTask))  # Django's "not a valid task", recorded as ours
        # Unable to start: no task_started; task_finished and the result say FAILED, with the error, for
        # a task named as it was enqueued (its code is not a Task any more).
        for task_id, path, error in [
            (refused, "tests.conformance.lease_tasks.not_a_task", NotATask),
            (missing, "tests.conformance.lease_tasks.missing", ImportError),
        ]:
            with self.subTest(path):
                result = default_task_backend.get_result(str(task_id))
                finished = self.wait_signalled(result)
                self.assertEqual(self.events(result.id, "started"), [])
                self.assertEqual((finished["status"], finished["stored_status"]), ("FAILED", "FAILED"))
                self.assertEqual(finished["task"]["module_path"], path)
                self.assertEqual(when(finished["finished_at"]), result.finished_at)
                self.assertEqual((result.status, result.task.module_path), (TaskResultStatus.FAILED, path))
                self.assertIs(result.errors[0].exception_class, error)
                with self.assertRaisesMessage(ImportError, "does not name a django.tasks Task"):
                    result.task.call()
        with self.assertRaises(TaskResultDoesNotExist):  # Task.objects.enqueue's row: no django.tasks result
            default_task_backend.get_result(str(plain))

    # -- normalisation ----------------------------------------------------------------------------

    def test_arguments_and_return_values_are_normalised_as_django_does(self):
        result = lease_tasks.echo.enqueue({"raw": b"text", "pair": (1, 2)})
        self.assertEqual(result.args, [{"raw": "text", "pair": [1, 2]}])
        returned = lease_tasks.return_bytes.enqueue()
        self.wait_finished(result)
        self.wait_finished(returned)
        self.assertEqual(result.return_value, {"raw": "text", "pair": [1, 2]})
        self.assertEqual(returned.return_value, "bytes are normalised to text")

    def test_arguments_django_or_jsonb_refuse_are_refused_before_anything_is_written(self):
        for value, exception, message in [
            (dt.datetime.now(), TypeError, "Unsupported type"),
            (b"\xff\xfe", ValueError, "Unsupported value"),
            (float("nan"), ValueError, "not JSON-serialisable"),
            (float("inf"), ValueError, "not JSON-serialisable"),
            ("before\x00after", ValueError, "NUL character"),
            ("lone \ud800 surrogate", ValueError, "lone surrogate"),
        ]:
            with self.subTest(value=value), self.assertRaisesMessage(exception, message):
                lease_tasks.echo.enqueue(value)
        self.assertEqual(TaskRow.objects.count(), 0)
        self.assertEqual(self.events(signal="enqueued"), [])

    @override_settings(LEASING_TASKS=RETRYING)
    def test_a_return_value_that_cannot_be_stored_fails_the_attempt_without_retrying(self):
        cases = [
            (test_tasks.complex_return_value, TypeError, "Unsupported type"),
            (lease_tasks.return_undecodable_bytes, ValueError, "Unsupported value"),
            (lease_tasks.return_nan, UnstorableResult, "the return value cannot be stored"),
        ]
        results = [(task.enqueue(), exception, message) for task, exception, message in cases]
        for result, exception, message in results:
            with self.subTest(result.task.name):
                self.wait_finished(result)
                self.assertEqual((result.status, result.attempts), (TaskResultStatus.FAILED, 1))
                self.assertEqual(result.errors[0].exception_class, exception)
                self.assertIn(message, result.errors[0].traceback)

    # -- exceptions ------------------------------------------------------------------------------

    def test_keyboard_interrupt_and_exit_fail_the_attempt_and_the_worker_goes_on(self):
        for task, exception, text in [
            (
                test_tasks.failing_task_keyboard_interrupt,
                KeyboardInterrupt,
                "This Task failed due to KeyboardInterrupt",
            ),
            (test_tasks.exit_task, SystemExit, "SystemExit: 1"),
        ]:
            with self.subTest(task.name):
                result = task.enqueue()
                self.wait_finished(result)
                self.assertEqual(result.status, TaskResultStatus.FAILED)
                self.assertEqual(result.errors[0].exception_class, exception)
                self.assertIn(text, result.errors[0].traceback)
        after = test_tasks.calculate_meaning_of_life.enqueue()
        self.wait_finished(after)
        self.assertEqual(after.return_value, 42)

    # -- transactions ----------------------------------------------------------------------------

    def test_the_enqueue_is_part_of_the_callers_transaction(self):
        outside: list[Any] = []

        def enqueue_elsewhere() -> None:  # another thread: another connection, committed at once
            try:
                outside.append(lease_tasks.echo.enqueue("outside"))
            finally:
                connections.close_all()

        with transaction.atomic():
            # The highest priority: a worker that could see it would take it before anything else.
            inside = lease_tasks.echo.using(priority=100).enqueue("inside")
            thread = threading.Thread(target=enqueue_elsewhere)
            thread.start()
            thread.join(WAIT)
            self.wait_signalled(outside[0])
            self.assertEqual(self.events(inside.id, "started"), [])
        self.wait_finished(inside)
        self.assertEqual([e["signal"] for e in self.events(inside.id)], ["enqueued", "started", "finished"])
        self.assertEqual(inside.return_value, "inside")

    def test_a_rolled_back_enqueue_leaves_nothing(self):
        class Rollback(Exception):
            pass

        with self.assertRaises(Rollback), transaction.atomic():
            result = lease_tasks.echo.enqueue("rolled back")
            raise Rollback
        with self.assertRaises(TaskResultDoesNotExist):
            default_task_backend.get_result(result.id)
        # Signalled when enqueue() wrote it (before any worker could see it); it never runs.
        self.assertEqual([e["signal"] for e in self.events(result.id)], ["enqueued"])
        after = lease_tasks.echo.enqueue("after")
        self.wait_finished(after)
        self.assertEqual([e["signal"] for e in self.events(result.id)], ["enqueued"])


@SETTINGS
class LeaseBackendThreadTestCase(LeaseBackendTests, ThreadWorkerTestCase):
    pass


@SETTINGS
class LeaseBackendProcessTestCase(LeaseBackendTests, ProcessWorkerTestCase):
    pass


# -- leases in a result -------------------------------------------------------------------------


@SETTINGS
class LeasesInResultsTestCase(BackendTestCase):
    def test_a_claim_returned_before_it_began_is_no_attempt_and_a_crash_is_one(self):
        result = lease_tasks.echo.enqueue("leased")
        task_id = int(result.id)

        def expire_and_recover() -> None:
            wait_until(lambda: TaskRow.objects.filter(pk=task_id).stuck().exists(), WAIT, what="the lease to expire")
            self.assertEqual([r.id for r in TaskRow.objects.recover_expired()], [task_id])

        TaskRow.objects.claim("vanished-before-start", ttl=0.05)  # a worker that died before it began
        expire_and_recover()
        returned = default_task_backend.get_result(result.id)
        self.assertEqual((returned.status, returned.attempts, returned.errors), (TaskResultStatus.READY, 0, []))

        [claimed] = TaskRow.objects.claim("died-while-running", ttl=0.05)
        self.assertIsNotNone(TaskRow.objects.start(claimed.id, "died-while-running", claimed.token))
        expire_and_recover()
        crashed = default_task_backend.get_result(result.id)
        self.assertEqual(crashed.status, TaskResultStatus.READY)  # to be run again
        self.assertEqual((crashed.attempts, crashed.worker_ids), (1, ["died-while-running"]))
        self.assertEqual([e.exception_class_path for e in crashed.errors], ["tasks.exceptions.TaskLeaseLost"])
        self.assertIsNotNone(crashed.errors[0].exception_class)


# -- a hand-back at shutdown ---------------------------------------------------------------------


def start_worker(worker_id: str, **options: Any) -> tuple[Worker, threading.Thread]:
    worker = Worker(
        queues=["default"],
        concurrency=1,
        ttl=5,
        poll_interval=0.05,
        recovery=False,
        install_signal_handlers=False,
        worker_id=worker_id,
        **options,
    )

    def serve() -> None:
        try:
            worker.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=serve)
    thread.start()
    return worker, thread


@SETTINGS
class HandBackTestCase(BackendTestCase):
    def test_a_handed_back_attempt_counts_once_and_the_next_attempt_knows_it(self):
        Gate.objects.create(key="hand-back")
        first, first_thread = start_worker("hand-back-1", shutdown_grace=0)
        try:
            result = lease_tasks.block_first_attempt.enqueue("hand-back")
            wait_until(
                lambda: TaskRow.objects.filter(pk=int(result.id), attempt_started=True).exists(),
                WAIT,
                what="attempt 1 to start",
            )
            first.request_stop()  # no grace: the running attempt is handed back
            first_thread.join(WAIT)
            self.assertFalse(first_thread.is_alive())

            handed = default_task_backend.get_result(result.id)
            self.assertEqual(handed.status, TaskResultStatus.READY)
            self.assertEqual((handed.attempts, worker_names(handed.worker_ids)), (1, ["hand-back-1"]))
            self.assertIs(handed.errors[0].exception_class, WorkerShutdown)
            [ended] = self.events(result.id, "finished")
            self.assertEqual((ended["status"], ended["stored_status"]), ("READY", "READY"))
            self.assertEqual([e[0] for e in ended["errors"]], ["tasks.exceptions.WorkerShutdown"])

            second, second_thread = start_worker("hand-back-2")
            try:
                self.wait_finished(result)
            finally:
                second.request_stop()
                second_thread.join(WAIT)
            inside = result.return_value
            self.assertEqual((inside["attempt"], inside["attempts"]), (2, 2))
            self.assertEqual(worker_names(inside["worker_ids"]), ["hand-back-1", "hand-back-2"])
            self.assertEqual(inside["errors"], ["tasks.exceptions.WorkerShutdown"])
            self.assertEqual((result.attempts, worker_names(result.worker_ids)), (2, ["hand-back-1", "hand-back-2"]))
        finally:
            Gate.objects.filter(key="hand-back").update(open=True)  # attempt 1's thread returns, too late
            wait_until(
                lambda: not any(t.is_alive() for t in first.threads.threads),
                WAIT,
                what="attempt 1's thread to end",
            )


# -- run_worker --backend / --database -----------------------------------------------------------


@contextmanager
def other_database(test: type[BackendTestCase], alias: str, name: str) -> Iterator[None]:
    """A second database alias in this process, on database ``name`` of the same server, that
    ``test`` may use while this lasts (Django's test case refuses aliases it was not told about)."""
    connections.settings[alias] = {**connections.settings["default"], "NAME": name}
    allowed = test.databases
    test.databases = {*allowed, alias}
    try:
        yield
    finally:
        test.databases = allowed
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


@override_settings(TASKS=LEASE_BACKENDS, LEASING_TASKS=CONFORMANCE_LEASING_TASKS)
class RunWorkerTargetTestCase(BackendTestCase):
    def test_bad_targets_are_refused_with_a_clear_error(self):
        for args, message in [
            (["--backend", "nowhere"], "The connection 'nowhere' doesn't exist."),
            (["--backend", "immediate"], "ImmediateBackend is not a LeaseBackend"),
            (["--backend", "default"], "its QUEUES allows any name; say which with --queues"),
            (["--backend", "other", "--queues", "mail"], "not among its QUEUES: mail"),
            (["--database", "nowhere"], "no database 'nowhere' in DATABASES"),
            (["--backend", "other", "--database", "default"], "not allowed with argument"),
        ]:
            with self.subTest(args=args), self.assertRaisesMessage(CommandError, message):
                call_command("run_worker", *args)

    def test_the_system_check_refuses_unknown_options_and_databases(self):
        backend = LeaseBackend("misconfigured", {"OPTIONS": {"database": "nowhere", "retries": 3}})
        errors = backend.check()
        self.assertEqual([e.id for e in errors], ["tasks.E010", "tasks.E011"])
        self.assertIn("retries", errors[0].msg)
        self.assertIn("'nowhere'", errors[1].msg)
        self.assertEqual(task_backends["default"].check(), [])

    def test_a_backend_with_its_own_database_is_served_by_backend_or_database_alias(self):
        name = f"{connection.settings_dict['NAME']}_other"
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            cursor.execute(f'CREATE DATABASE "{name}"')
        env = {"DJANGO_SETTINGS_MODULE": "tests.conformance.worker_settings", "CONFORMANCE_OTHER_DATABASE": name}
        try:
            migrate = start_manage(self.workdir / "migrate.log", "migrate", "--database", "other", "-v", "0", **env)
            self.assertEqual(migrate.wait(120), 0, (self.workdir / "migrate.log").read_text())
            elsewhere = {
                "BACKEND": "tasks.backends.LeaseBackend",
                "QUEUES": ["elsewhere"],
                "OPTIONS": {"database": "other"},
            }
            with (
                other_database(type(self), "other", name),
                override_settings(TASKS={**LEASE_BACKENDS, "elsewhere": elsewhere}),
            ):
                backend = task_backends["elsewhere"]
                # The same queue name in the default database: not this worker's to run.
                kept = lease_tasks.echo.using(queue_name="elsewhere", priority=100).enqueue("default database")
                for target in (["--backend", "elsewhere"], ["--database", "other", "--queues", "elsewhere"]):
                    with self.subTest(target=target):
                        served = lease_tasks.echo.using(backend="elsewhere", queue_name="elsewhere").enqueue(target[1])
                        self.assertTrue(TaskRow.objects.using("other").filter(pk=int(served.id)).exists())
                        worker_id = f"other-{target[0]}"
                        process = start_manage(
                            self.workdir / "other-worker.log",
                            "run_worker",
                            *target,
                            "--no-recovery",
                            "--poll-interval",
                            "0.05",
                            "--worker-id",
                            worker_id,
                            **env,
                            **{EVENTS_ENV: self.events_path},
                        )

                        def finished(result: TaskResult = served) -> bool:
                            return bool(backend.get_result(result.id).is_finished)

                        try:
                            wait_until(finished, WAIT, what="the task in the other database")
                        finally:
                            self.assertEqual(stop_process(process), 0, (self.workdir / "other-worker.log").read_text())
                        served.refresh()
                        self.assertEqual((served.status, served.return_value), ("SUCCESSFUL", target[1]))
                        self.assertEqual((served.backend, worker_names(served.worker_ids)), ("elsewhere", [worker_id]))
                        self.assertEqual(default_task_backend.get_result(kept.id).status, TaskResultStatus.READY)
        finally:
            with connection.cursor() as cursor:
                cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
