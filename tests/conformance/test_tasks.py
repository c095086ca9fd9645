"""Django 6.1.3 tests/tasks/test_tasks.py (TaskTestCase), against LeaseBackend.

Django runs these on its DummyBackend, which stores results and never runs anything; here the
"default" backend is LeaseBackend with no worker serving the queue, so results stay READY exactly
as the dummy's do. The changes, each marked "Ported:" below: the backend class checked, the dummy's
``results`` list read as the rows the backend stored, ``tests.conformance`` as the module path, and
the two TaskError tests also run on an error this backend's worker stored (test_lease_backend.py).
"""

# Django TestCase style, as in the source: unittest assertions, properties read for their exception.
# mypy: ignore-errors
# (the tests pass what the type stubs forbid on purpose: 3.1 as a priority, tuples for lists, ...)
# ruff: noqa: PT009, PT027, B018, SIM117

import dataclasses
import pickle
from datetime import datetime

from django.test import override_settings
from django.utils import timezone
from django.utils.module_loading import import_string

from tasks.backends.backend import LeaseBackend
from tasks.compat import (
    DEFAULT_TASK_QUEUE_NAME,
    IMMEDIATE_BACKEND,
    LOGGER_NAME,
    TASK_MAX_PRIORITY,
    TASK_MIN_PRIORITY,
    ImmediateBackend,
    InvalidTask,
    InvalidTaskBackend,
    Task,
    TaskResultDoesNotExist,
    TaskResultMismatch,
    TaskResultStatus,
    default_task_backend,
    task,
    task_backends,
)
from tasks.models import Task as TaskRow
from tests.conformance import tasks as test_tasks
from tests.conformance.harness import CONFORMANCE_LEASING_TASKS, BackendTestCase

#: Django 6.1's Task pickles (by module path); the django-tasks backport's does not.
TASKS_PICKLE = hasattr(Task, "_reconstruct")


def stored_results():
    """Ported: what DummyBackend.results holds, for LeaseBackend: every result it stored."""
    return [
        default_task_backend.get_result(str(pk)) for pk in TaskRow.objects.order_by("pk").values_list("pk", flat=True)
    ]


@override_settings(
    TASKS={
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "QUEUES": ["default", "queue_1"],
        },
        "immediate": {
            "BACKEND": IMMEDIATE_BACKEND,
            "QUEUES": [],
        },
        "missing": {"BACKEND": "does.not.exist"},
    },
    USE_TZ=True,
    LEASING_TASKS=CONFORMANCE_LEASING_TASKS,
)
class TaskTestCase(BackendTestCase):
    def test_using_correct_backend(self):
        self.assertEqual(default_task_backend, task_backends["default"])
        self.assertIsInstance(task_backends["default"], LeaseBackend)  # Ported: DummyBackend

    def test_task_decorator(self):
        self.assertIsInstance(test_tasks.noop_task, Task)
        self.assertIsInstance(test_tasks.noop_task_async, Task)
        self.assertIsInstance(test_tasks.noop_task_from_bare_decorator, Task)

    def test_enqueue_task(self):
        result = test_tasks.noop_task.enqueue()

        self.assertEqual(result.status, TaskResultStatus.READY)
        self.assertEqual(result.task, test_tasks.noop_task)
        self.assertEqual(result.args, [])
        self.assertEqual(result.kwargs, {})

        self.assertEqual(stored_results(), [result])

    async def test_enqueue_task_async(self):
        from asgiref.sync import sync_to_async

        result = await test_tasks.noop_task.aenqueue()

        self.assertEqual(result.status, TaskResultStatus.READY)
        self.assertEqual(result.task, test_tasks.noop_task)
        self.assertEqual(result.args, [])
        self.assertEqual(result.kwargs, {})

        self.assertEqual(await sync_to_async(stored_results)(), [result])

    def test_enqueue_with_invalid_argument(self):
        with self.assertRaisesMessage(TypeError, "Unsupported type"):
            test_tasks.noop_task.enqueue(datetime.now())

    async def test_aenqueue_with_invalid_argument(self):
        with self.assertRaisesMessage(TypeError, "Unsupported type"):
            await test_tasks.noop_task.aenqueue(datetime.now())

    def test_using_priority(self):
        self.assertEqual(test_tasks.noop_task.priority, 0)
        self.assertEqual(test_tasks.noop_task.using(priority=1).priority, 1)
        self.assertEqual(test_tasks.noop_task.priority, 0)

    def test_using_queue_name(self):
        self.assertEqual(test_tasks.noop_task.queue_name, DEFAULT_TASK_QUEUE_NAME)
        self.assertEqual(test_tasks.noop_task.using(queue_name="queue_1").queue_name, "queue_1")
        self.assertEqual(test_tasks.noop_task.queue_name, DEFAULT_TASK_QUEUE_NAME)

    def test_using_run_after(self):
        now = timezone.now()

        self.assertIsNone(test_tasks.noop_task.run_after)
        self.assertEqual(test_tasks.noop_task.using(run_after=now).run_after, now)
        self.assertIsNone(test_tasks.noop_task.run_after)

    def test_using_unknown_backend(self):
        self.assertEqual(test_tasks.noop_task.backend, "default")

        with self.assertRaisesMessage(InvalidTaskBackend, "The connection 'unknown' doesn't exist."):
            test_tasks.noop_task.using(backend="unknown")

    def test_using_missing_backend(self):
        self.assertEqual(test_tasks.noop_task.backend, "default")

        with self.assertRaisesMessage(
            InvalidTaskBackend,
            "Could not find backend 'does.not.exist': No module named 'does'",
        ):
            test_tasks.noop_task.using(backend="missing")

    def test_using_creates_new_instance(self):
        new_task = test_tasks.noop_task.using()

        self.assertEqual(new_task, test_tasks.noop_task)
        self.assertIsNot(new_task, test_tasks.noop_task)

    def test_chained_using(self):
        now = timezone.now()

        run_after_task = test_tasks.noop_task.using(run_after=now)
        self.assertEqual(run_after_task.run_after, now)

        priority_task = run_after_task.using(priority=10)
        self.assertEqual(priority_task.priority, 10)
        self.assertEqual(priority_task.run_after, now)

        self.assertEqual(run_after_task.priority, 0)

    async def test_refresh_result(self):
        from asgiref.sync import sync_to_async

        result = await test_tasks.noop_task.aenqueue()

        original_result = dataclasses.asdict(result)

        # Ported: a blocking refresh() from async code goes through sync_to_async (Django refuses
        # database calls in the event loop; the dummy backend has no database).
        await sync_to_async(result.refresh)()

        self.assertEqual(dataclasses.asdict(result), original_result)

        await result.arefresh()

        self.assertEqual(dataclasses.asdict(result), original_result)

    def test_naive_datetime(self):
        with self.assertRaisesMessage(InvalidTask, "run_after must be an aware datetime."):
            test_tasks.noop_task.using(run_after=datetime.now())

    def test_invalid_priority(self):
        with self.assertRaisesMessage(
            InvalidTask,
            f"priority must be a whole number between {TASK_MIN_PRIORITY} and {TASK_MAX_PRIORITY}.",
        ):
            test_tasks.noop_task.using(priority=-101)

        with self.assertRaisesMessage(
            InvalidTask,
            f"priority must be a whole number between {TASK_MIN_PRIORITY} and {TASK_MAX_PRIORITY}.",
        ):
            test_tasks.noop_task.using(priority=101)

        with self.assertRaisesMessage(
            InvalidTask,
            f"priority must be a whole number between {TASK_MIN_PRIORITY} and {TASK_MAX_PRIORITY}.",
        ):
            test_tasks.noop_task.using(priority=3.1)

        test_tasks.noop_task.using(priority=100)
        test_tasks.noop_task.using(priority=-100)
        test_tasks.noop_task.using(priority=0)

    def test_unknown_queue_name(self):
        with self.assertRaisesMessage(InvalidTask, "Queue 'queue-2' is not valid for backend."):
            test_tasks.noop_task.using(queue_name="queue-2")
        # Validation is bypassed when the backend QUEUES is an empty list.
        self.assertEqual(
            test_tasks.noop_task.using(queue_name="queue-2", backend="immediate").queue_name,
            "queue-2",
        )

    def test_call_task(self):
        self.assertEqual(test_tasks.calculate_meaning_of_life.call(), 42)

    async def test_call_task_async(self):
        self.assertEqual(await test_tasks.calculate_meaning_of_life.acall(), 42)

    async def test_call_async_task(self):
        self.assertIsNone(await test_tasks.noop_task_async.acall())

    def test_call_async_task_sync(self):
        self.assertIsNone(test_tasks.noop_task_async.call())

    def test_get_result(self):
        result = default_task_backend.enqueue(test_tasks.noop_task, (), {})

        new_result = test_tasks.noop_task.get_result(result.id)

        self.assertEqual(result, new_result)

    async def test_get_result_async(self):
        result = await default_task_backend.aenqueue(test_tasks.noop_task, (), {})

        new_result = await test_tasks.noop_task.aget_result(result.id)

        self.assertEqual(result, new_result)

    async def test_get_missing_result(self):
        from asgiref.sync import sync_to_async

        with self.assertRaises(TaskResultDoesNotExist):
            # Ported: through sync_to_async, as in test_refresh_result.
            await sync_to_async(test_tasks.noop_task.get_result)("123")

        with self.assertRaises(TaskResultDoesNotExist):
            await test_tasks.noop_task.aget_result("123")

    def test_get_incorrect_result(self):
        result = default_task_backend.enqueue(test_tasks.noop_task_async, (), {})
        with self.assertRaisesMessage(TaskResultMismatch, "Task does not match"):
            test_tasks.noop_task.get_result(result.id)

    async def test_get_incorrect_result_async(self):
        result = await default_task_backend.aenqueue(test_tasks.noop_task_async, (), {})
        with self.assertRaisesMessage(TaskResultMismatch, "Task does not match"):
            await test_tasks.noop_task.aget_result(result.id)

    def test_invalid_function(self):
        for invalid_function in [any, self.test_invalid_function]:
            with self.subTest(invalid_function):
                with self.assertRaisesMessage(
                    InvalidTask,
                    "Task function must be defined at a module level.",
                ):
                    task()(invalid_function)

    def test_get_backend(self):
        self.assertEqual(test_tasks.noop_task.backend, "default")
        self.assertIsInstance(test_tasks.noop_task.get_backend(), LeaseBackend)  # Ported: DummyBackend

        immediate_task = test_tasks.noop_task.using(backend="immediate")
        self.assertEqual(immediate_task.backend, "immediate")
        self.assertIsInstance(immediate_task.get_backend(), ImmediateBackend)

    def test_name(self):
        self.assertEqual(test_tasks.noop_task.name, "noop_task")
        self.assertEqual(test_tasks.noop_task_async.name, "noop_task_async")

    def test_module_path(self):
        # Ported: the tasks module is tests.conformance.tasks here (tasks.tasks in Django's suite).
        self.assertEqual(test_tasks.noop_task.module_path, "tests.conformance.tasks.noop_task")
        self.assertEqual(test_tasks.noop_task_async.module_path, "tests.conformance.tasks.noop_task_async")

        self.assertIs(import_string(test_tasks.noop_task.module_path), test_tasks.noop_task)
        self.assertIs(
            import_string(test_tasks.noop_task_async.module_path),
            test_tasks.noop_task_async,
        )

    # Ported, for both frameworks: Django 6.1's Task pickles by its module path (Task._reconstruct);
    # the django-tasks backport of Django 5.2 has no such support, and pickling a Task (or a result,
    # which holds its Task) is refused there. Each test asserts what the framework in use does.

    def test_pickle_task(self):
        if not TASKS_PICKLE:
            with self.assertRaises(pickle.PicklingError):
                pickle.dumps(test_tasks.noop_task)
            return
        pickled_task = pickle.dumps(test_tasks.noop_task)
        unpickled_task = pickle.loads(pickled_task)

        self.assertEqual(unpickled_task, test_tasks.noop_task)

    def test_unpickle_arbitrary_string(self):
        if not TASKS_PICKLE:
            with self.assertRaises(pickle.PicklingError):
                pickle.dumps(test_tasks.noop_task_async)
            return
        kwargs = {"func": "does.not.exist.fake_task"}
        msg = "Expected 'does.not.exist.fake_task' to point to a Task instance."
        with self.assertRaisesMessage(ValueError, msg):
            Task._reconstruct(kwargs)

    def test_unpickle_non_task_object(self):
        if not TASKS_PICKLE:
            with self.assertRaises(pickle.PicklingError):
                pickle.dumps(test_tasks.calculate_meaning_of_life)
            return
        kwargs = {"func": "builtins.any"}
        msg = "Expected 'builtins.any' to point to a Task instance."
        with self.assertRaisesMessage(ValueError, msg):
            Task._reconstruct(kwargs)

    def test_pickle_task_result(self):
        result = test_tasks.noop_task.enqueue()
        if not TASKS_PICKLE:
            with self.assertRaises(pickle.PicklingError):
                pickle.dumps(result)
            return
        pickled_result = pickle.dumps(result)
        unpickled_result = pickle.loads(pickled_result)

        self.assertEqual(unpickled_result, result)

    @override_settings(TASKS={})
    def test_no_backends(self):
        with self.assertRaises(InvalidTaskBackend):
            test_tasks.noop_task.enqueue()

    def test_task_error_invalid_exception(self):
        with self.assertLogs(LOGGER_NAME):
            immediate_task = test_tasks.failing_task_value_error.using(backend="immediate").enqueue()

        self.assertEqual(len(immediate_task.errors), 1)

        object.__setattr__(immediate_task.errors[0], "exception_class_path", "subprocess.run")

        with self.assertRaisesMessage(ValueError, "'subprocess.run' does not reference a valid exception."):
            immediate_task.errors[0].exception_class

    def test_task_error_unknown_module(self):
        with self.assertLogs(LOGGER_NAME):
            immediate_task = test_tasks.failing_task_value_error.using(backend="immediate").enqueue()

        self.assertEqual(len(immediate_task.errors), 1)

        object.__setattr__(immediate_task.errors[0], "exception_class_path", "does.not.exist")

        with self.assertRaises(ImportError):
            immediate_task.errors[0].exception_class

    def test_takes_context_without_taking_context(self):
        with self.assertRaisesMessage(
            InvalidTask,
            "Task takes context but does not have a first argument of 'context'.",
        ):
            task(takes_context=True)(test_tasks.calculate_meaning_of_life.func)

    def test_run_after_in_decorator(self):
        # Ported: Django 6.1 words it "run_after cannot be defined statically with the @task
        # decorator."; the backport refuses the same call as "got multiple values for keyword
        # argument 'run_after'". Both are the TypeError naming run_after.
        with self.assertRaisesRegex(TypeError, "run_after"):
            task(run_after=timezone.now())(test_tasks.calculate_meaning_of_life.func)
