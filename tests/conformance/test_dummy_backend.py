"""Django 6.1.3 tests/tasks/test_dummy_backend.py: what its DummyBackend tests check of any backend
(enqueue, results, validation, logs), against LeaseBackend with no worker serving the queue (the
dummy never runs a task either). Changes are marked "Ported:"; test_refresh_result(_async) needs
the stored result to change, so it runs with a real worker in test_immediate_backend.py's classes.
"""

# Django TestCase style, as in the source: unittest assertions, properties read for their exception.
# mypy: ignore-errors
# (the tests pass what the type stubs forbid on purpose: 3.1 as a priority, tuples for lists, ...)
# ruff: noqa: PT009, PT027, B018, SIM117

from typing import cast
from unittest import skip

from django.db import transaction
from django.test import override_settings

from tasks.backends.backend import LeaseBackend
from tasks.compat import (
    LOGGER_NAME,
    InvalidTask,
    Task,
    TaskResultDoesNotExist,
    TaskResultStatus,
    default_task_backend,
    task_backends,
)
from tasks.models import Task as TaskRow
from tests.conformance import tasks as test_tasks
from tests.conformance.harness import CONFORMANCE_LEASING_TASKS, BackendTestCase


def stored_results():
    """Ported: what DummyBackend.results holds, for LeaseBackend: every result it stored."""
    return [
        default_task_backend.get_result(str(pk)) for pk in TaskRow.objects.order_by("pk").values_list("pk", flat=True)
    ]


@override_settings(
    TASKS={
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "QUEUES": [],
        }
    },
    LEASING_TASKS=CONFORMANCE_LEASING_TASKS,
)
class DummyBackendTestCase(BackendTestCase):
    def test_using_correct_backend(self):
        self.assertEqual(default_task_backend, task_backends["default"])
        self.assertIsInstance(task_backends["default"], LeaseBackend)  # Ported: DummyBackend
        self.assertEqual(default_task_backend.alias, "default")
        self.assertEqual(default_task_backend.options, {})

    def test_enqueue_task(self):
        for task in [test_tasks.noop_task, test_tasks.noop_task_async]:
            with self.subTest(task):
                result = cast(Task, task).enqueue(1, two=3)

                self.assertEqual(result.status, TaskResultStatus.READY)
                self.assertIs(result.is_finished, False)
                self.assertIsNone(result.started_at)
                self.assertIsNone(result.last_attempted_at)
                self.assertIsNone(result.finished_at)
                with self.assertRaisesMessage(ValueError, "Task has not finished yet"):
                    result.return_value
                self.assertEqual(result.task, task)
                self.assertEqual(result.args, [1])
                self.assertEqual(result.kwargs, {"two": 3})
                self.assertEqual(result.attempts, 0)

                self.assertIn(result, stored_results())

    async def test_enqueue_task_async(self):
        from asgiref.sync import sync_to_async

        for task in [test_tasks.noop_task, test_tasks.noop_task_async]:
            with self.subTest(task):
                result = await cast(Task, task).aenqueue()

                self.assertEqual(result.status, TaskResultStatus.READY)
                self.assertIs(result.is_finished, False)
                self.assertIsNone(result.started_at)
                self.assertIsNone(result.last_attempted_at)
                self.assertIsNone(result.finished_at)
                with self.assertRaisesMessage(ValueError, "Task has not finished yet"):
                    result.return_value
                self.assertEqual(result.task, task)
                self.assertEqual(result.args, [])
                self.assertEqual(result.kwargs, {})
                self.assertEqual(result.attempts, 0)

                self.assertIn(result, await sync_to_async(stored_results)())

    def test_get_result(self):
        result = default_task_backend.enqueue(test_tasks.noop_task, (), {})

        new_result = default_task_backend.get_result(result.id)

        self.assertEqual(result, new_result)

    async def test_get_result_async(self):
        result = await default_task_backend.aenqueue(test_tasks.noop_task, (), {})

        new_result = await default_task_backend.aget_result(result.id)

        self.assertEqual(result, new_result)

    async def test_get_missing_result(self):
        from asgiref.sync import sync_to_async

        with self.assertRaises(TaskResultDoesNotExist):
            # Ported: a blocking database call from async code goes through sync_to_async.
            await sync_to_async(default_task_backend.get_result)("123")

        with self.assertRaises(TaskResultDoesNotExist):
            await default_task_backend.aget_result("123")

    def test_enqueue_logs(self):
        with self.assertLogs(LOGGER_NAME, level="DEBUG") as captured_logs:
            result = test_tasks.noop_task.enqueue()

        self.assertEqual(len(captured_logs.output), 1)
        self.assertIn("enqueued", captured_logs.output[0])
        self.assertIn(result.id, captured_logs.output[0])

    def test_errors(self):
        result = test_tasks.noop_task.enqueue()
        self.assertEqual(result.errors, [])

    def test_validate_disallowed_async_task(self):
        # Ported: the source patches the flag with mock.patch.multiple; an instance attribute does
        # the same without a mock.
        default_task_backend.supports_async_task = False
        try:
            # Ported: "async Tasks." in Django 6.1, "async tasks." in the backport of Django 5.2.
            with self.assertRaisesRegex(InvalidTask, r"(?i)^Backend does not support async tasks\.$"):
                default_task_backend.validate_task(test_tasks.noop_task_async)
        finally:
            del default_task_backend.supports_async_task

    def test_check(self):
        errors = list(default_task_backend.check())
        self.assertEqual(len(errors), 0, errors)

    def test_takes_context(self):
        result = test_tasks.get_task_id.enqueue()
        self.assertEqual(result.status, TaskResultStatus.READY)

    @skip("DummyBackend.clear() is the dummy's own API, not BaseTaskBackend's; LeaseBackend has none")
    def test_clear(self):
        pass

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


class DummyBackendTransactionTestCase(BackendTestCase):
    @override_settings(
        TASKS={
            "default": {
                "BACKEND": "tasks.backends.LeaseBackend",
            }
        }
    )
    def test_doesnt_wait_until_transaction_commit_by_default(self):
        with transaction.atomic():
            result = test_tasks.noop_task.enqueue()

            self.assertIsNotNone(result.enqueued_at)

            self.assertEqual(len(stored_results()), 1)

        self.assertEqual(len(stored_results()), 1)
