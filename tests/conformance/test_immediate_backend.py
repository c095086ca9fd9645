"""Django 6.1.3 tests/tasks/test_immediate_backend.py: what its ImmediateBackend tests check of a
backend that runs tasks (results, errors with tracebacks, return values, context, logs written by
the task signals, validation), against LeaseBackend with a real worker, in a thread of the test
process and as a ``manage.py run_worker`` process.

The immediate backend runs the task inside ``enqueue()``; here the test waits for the worker
(``self.wait_finished(result)``, marked "Ported:") and then makes Django's assertions unchanged.
Logs are read where they are written: the worker process's records come from its log file. The
tests of what only a synchronous backend does, or of capabilities the immediate backend lacks, are
skipped with the reason; this backend's own behaviour there is tested in test_lease_backend.py.
The dummy backend's test_refresh_result(_async) run here too: they need the stored result to change.
"""

# Django TestCase style, as in the source: unittest assertions, properties read for their exception.
# mypy: ignore-errors
# (the tests pass what the type stubs forbid on purpose: 3.1 as a priority, tuples for lists, ...)
# ruff: noqa: PT009, B018, SIM117

from unittest import skip

from django.test import override_settings

from tasks.backends.backend import LeaseBackend
from tasks.compat import InvalidTask, TaskResultStatus, default_task_backend, task_backends
from tests.conformance import tasks as test_tasks
from tests.conformance.harness import CONFORMANCE_LEASING_TASKS, ProcessWorkerTestCase, ThreadWorkerTestCase

LEASE_BACKEND = override_settings(
    TASKS={
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "QUEUES": [],
        }
    },
    LEASING_TASKS=CONFORMANCE_LEASING_TASKS,
)

SYNCHRONOUS = "ImmediateBackend runs the task inside enqueue(), in the caller; LeaseBackend's worker runs it elsewhere"
CAPABILITY = "ImmediateBackend lacks this capability; LeaseBackend has it (tested in test_lease_backend.py)"


class ImmediateBackendTests:
    """The tests; run by the two classes at the bottom (worker in a thread, worker process)."""

    def test_using_correct_backend(self):
        self.assertEqual(default_task_backend, task_backends["default"])
        self.assertIsInstance(task_backends["default"], LeaseBackend)  # Ported: ImmediateBackend
        self.assertEqual(default_task_backend.alias, "default")
        self.assertEqual(default_task_backend.options, {})

    def test_enqueue_task(self):
        for task in [test_tasks.noop_task, test_tasks.noop_task_async]:
            with self.subTest(task):
                result = task.enqueue(1, two=3)
                self.wait_finished(result)  # Ported

                self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
                self.assertIs(result.is_finished, True)
                self.assertIsNotNone(result.started_at)
                self.assertIsNotNone(result.last_attempted_at)
                self.assertIsNotNone(result.finished_at)
                self.assertGreaterEqual(result.started_at, result.enqueued_at)
                self.assertGreaterEqual(result.finished_at, result.started_at)
                self.assertIsNone(result.return_value)
                self.assertEqual(result.task, task)
                self.assertEqual(result.args, [1])
                self.assertEqual(result.kwargs, {"two": 3})
                self.assertEqual(result.attempts, 1)

    async def test_enqueue_task_async(self):
        for task in [test_tasks.noop_task, test_tasks.noop_task_async]:
            with self.subTest(task):
                result = await task.aenqueue()
                await self.await_finished(result)  # Ported

                self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
                self.assertIs(result.is_finished, True)
                self.assertIsNotNone(result.started_at)
                self.assertIsNotNone(result.last_attempted_at)
                self.assertIsNotNone(result.finished_at)
                self.assertGreaterEqual(result.started_at, result.enqueued_at)
                self.assertGreaterEqual(result.finished_at, result.started_at)
                self.assertIsNone(result.return_value)
                self.assertEqual(result.task, task)
                self.assertEqual(result.args, [])
                self.assertEqual(result.kwargs, {})
                self.assertEqual(result.attempts, 1)

    def test_catches_exception(self):
        test_data = [
            (
                test_tasks.failing_task_value_error,  # Task function.
                ValueError,  # Expected exception.
                "This Task failed due to ValueError",  # Expected message.
            ),
            (
                test_tasks.failing_task_system_exit,
                SystemExit,
                "This Task failed due to SystemExit",
            ),
        ]
        for task, exception, message in test_data:
            with (
                self.subTest(task),
                self.task_logs(level="ERROR") as captured_logs,  # Ported: assertLogs("django.tasks", ...)
            ):
                result = task.enqueue()
                self.wait_finished(result)  # Ported

                self.assertEqual(len(captured_logs.output), 1)
                self.assertIn(message, captured_logs.output[0])

                self.assertEqual(result.status, TaskResultStatus.FAILED)
                with self.assertRaisesMessage(ValueError, "Task failed"):
                    result.return_value
                self.assertIs(result.is_finished, True)
                self.assertIsNotNone(result.started_at)
                self.assertIsNotNone(result.last_attempted_at)
                self.assertIsNotNone(result.finished_at)
                self.assertGreaterEqual(result.started_at, result.enqueued_at)
                self.assertGreaterEqual(result.finished_at, result.started_at)
                self.assertEqual(result.errors[0].exception_class, exception)
                traceback = result.errors[0].traceback
                self.assertIs(
                    traceback and traceback.endswith(f"{exception.__name__}: {message}\n"),
                    True,
                    traceback,
                )
                self.assertEqual(result.task, task)
                self.assertEqual(result.args, [])
                self.assertEqual(result.kwargs, {})

    @skip(SYNCHRONOUS + ": a KeyboardInterrupt cannot reach the enqueuing caller; it fails the attempt")
    def test_throws_keyboard_interrupt(self):
        pass

    def test_complex_exception(self):
        with self.task_logs(level="ERROR"):  # Ported: assertLogs("django.tasks", ...)
            result = test_tasks.complex_exception.enqueue()
            self.wait_finished(result)  # Ported

        self.assertEqual(result.status, TaskResultStatus.FAILED)
        with self.assertRaisesMessage(ValueError, "Task failed"):
            result.return_value
        self.assertIsNotNone(result.started_at)
        self.assertIsNotNone(result.last_attempted_at)
        self.assertIsNotNone(result.finished_at)
        self.assertGreaterEqual(result.started_at, result.enqueued_at)
        self.assertGreaterEqual(result.finished_at, result.started_at)

        self.assertIsNone(result._return_value)
        self.assertEqual(result.errors[0].exception_class, ValueError)
        self.assertIn('ValueError(ValueError("This task failed"))', result.errors[0].traceback)

        self.assertEqual(result.task, test_tasks.complex_exception)
        self.assertEqual(result.args, [])
        self.assertEqual(result.kwargs, {})

    def test_complex_return_value(self):
        with self.task_logs(level="ERROR"):  # Ported: assertLogs("django.tasks", ...)
            result = test_tasks.complex_return_value.enqueue()
            self.wait_finished(result)  # Ported

        self.assertEqual(result.status, TaskResultStatus.FAILED)
        self.assertIsNotNone(result.started_at)
        self.assertIsNotNone(result.last_attempted_at)
        self.assertIsNotNone(result.finished_at)
        self.assertGreaterEqual(result.started_at, result.enqueued_at)
        self.assertGreaterEqual(result.finished_at, result.started_at)
        self.assertIsNone(result._return_value)
        self.assertEqual(result.errors[0].exception_class, TypeError)
        self.assertIn("Unsupported type", result.errors[0].traceback)

    def test_result(self):
        result = default_task_backend.enqueue(test_tasks.calculate_meaning_of_life, [], {})
        self.wait_finished(result)  # Ported

        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual(result.return_value, 42)

    async def test_result_async(self):
        result = await default_task_backend.aenqueue(test_tasks.calculate_meaning_of_life, [], {})
        await self.await_finished(result)  # Ported

        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual(result.return_value, 42)

    @skip(CAPABILITY + ": get_result")
    async def test_cannot_get_result(self):
        pass

    @skip(CAPABILITY + ": refresh")
    async def test_cannot_refresh_result(self):
        pass

    @skip(CAPABILITY + ": run_after")
    def test_cannot_pass_run_after(self):
        pass

    def test_enqueue_logs(self):
        with self.task_logs(level="DEBUG") as captured_logs:  # Ported: assertLogs("django.tasks", ...)
            result = test_tasks.noop_task.enqueue()
            self.wait_finished(result)  # Ported

        self.assertEqual(len(captured_logs.output), 3)

        self.assertIn("enqueued", captured_logs.output[0])
        self.assertIn(result.id, captured_logs.output[0])

        self.assertIn("state=RUNNING", captured_logs.output[1])
        self.assertIn(result.id, captured_logs.output[1])

        self.assertIn("state=SUCCESSFUL", captured_logs.output[2])
        self.assertIn(result.id, captured_logs.output[2])

    def test_failed_logs(self):
        with self.task_logs(level="DEBUG") as captured_logs:  # Ported: assertLogs("django.tasks", ...)
            result = test_tasks.failing_task_value_error.enqueue()
            self.wait_finished(result)  # Ported

        self.assertEqual(len(captured_logs.output), 3)
        self.assertIn("state=RUNNING", captured_logs.output[1])
        self.assertIn(result.id, captured_logs.output[1])

        self.assertIn("state=FAILED", captured_logs.output[2])
        self.assertIn(result.id, captured_logs.output[2])

    def test_successful_task_no_none_in_logs(self):
        with self.task_logs(level="DEBUG") as captured_logs:  # Ported: assertLogs("django.tasks", ...)
            result = test_tasks.noop_task.enqueue()
            self.wait_finished(result)  # Ported

        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)

        for log_output in captured_logs.output:
            self.assertNotIn("None", log_output)

    def test_takes_context(self):
        result = test_tasks.get_task_id.enqueue()
        self.wait_finished(result)  # Ported

        self.assertEqual(result.return_value, result.id)

    def test_context(self):
        result = test_tasks.test_context.enqueue(1)
        self.wait_finished(result)  # Ported
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)

    def test_validate_on_enqueue(self):
        task_with_custom_queue_name = test_tasks.noop_task.using(queue_name="unknown_queue")

        with override_settings(
            TASKS={
                "default": {
                    "BACKEND": "tasks.backends.LeaseBackend",
                    "QUEUES": ["queue-1"],
                }
            }
        ):
            with self.assertRaisesMessage(InvalidTask, "Queue 'unknown_queue' is not valid for backend"):
                task_with_custom_queue_name.enqueue()

    async def test_validate_on_aenqueue(self):
        task_with_custom_queue_name = test_tasks.noop_task.using(queue_name="unknown_queue")

        with override_settings(
            TASKS={
                "default": {
                    "BACKEND": "tasks.backends.LeaseBackend",
                    "QUEUES": ["queue-1"],
                }
            }
        ):
            with self.assertRaisesMessage(InvalidTask, "Queue 'unknown_queue' is not valid for backend"):
                await task_with_custom_queue_name.aenqueue()

    @skip(SYNCHRONOUS + ": the enqueue is part of the caller's transaction (test_lease_backend.py)")
    def test_doesnt_wait_until_transaction_commit_by_default(self):
        """ImmediateBackendTransactionTestCase's one test."""

    # -- test_dummy_backend.py: the stored result changes, a refresh sees it ----------------------

    def test_refresh_result(self):
        result = default_task_backend.enqueue(test_tasks.calculate_meaning_of_life, (), {})

        # Ported: the dummy test sets its stored result to SUCCESSFUL by hand; here the worker runs it.
        self.wait_signalled(result)

        self.assertEqual(result.status, TaskResultStatus.READY)
        result.refresh()
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)

    async def test_refresh_result_async(self):
        result = await default_task_backend.aenqueue(test_tasks.calculate_meaning_of_life, (), {})

        # Ported: as in test_refresh_result.
        await self.await_signalled(result)

        self.assertEqual(result.status, TaskResultStatus.READY)
        await result.arefresh()
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)


@LEASE_BACKEND
class ImmediateBackendThreadTestCase(ImmediateBackendTests, ThreadWorkerTestCase):
    pass


@LEASE_BACKEND
class ImmediateBackendProcessTestCase(ImmediateBackendTests, ProcessWorkerTestCase):
    pass
