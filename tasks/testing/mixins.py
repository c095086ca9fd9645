"""Django ``TestCase`` mixins: the capture's assertions, the inline run and eager mode as methods.

::

    class SignupTests(TaskTestMixin, TestCase):
        def test_signup_sends_the_welcome_mail(self):
            self.client.post("/signup/", {"email": "a@example.com"})
            self.assertEnqueued(send_welcome, args=["a@example.com"])
            self.assertEqual(self.run_until_empty().succeeded, 1)

Set ``eager_tasks = True`` on the class for eager mode in every test. A ``setUp`` of your own must
call ``super().setUp()`` (the capture begins there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS

from tasks.models import Task
from tasks.testing.capture import EnqueueCapture, TaskRef
from tasks.testing.eager import EagerRun, eager_tasks
from tasks.testing.inline import DEFAULT_LIMIT, Drained, run_until_empty

if TYPE_CHECKING:
    from unittest import TestCase as _Base
else:
    _Base = object


class TaskTestMixin(_Base):
    """For ``django.test.TestCase`` (or ``TransactionTestCase``): every test captures what it
    enqueues (:class:`~tasks.testing.capture.EnqueueCapture`)."""

    #: Run every enqueue of the tests eagerly (:func:`~tasks.testing.eager.eager_tasks`).
    eager_tasks: bool = False
    #: The databases to capture (None: every database that holds tasks).
    task_databases: Sequence[str] | None = None

    _task_capture: EnqueueCapture | None = None
    eager_run: EagerRun | None = None

    def setUp(self) -> None:
        super().setUp()
        self._task_capture = EnqueueCapture(self.task_databases)
        if self.eager_tasks:
            # What TestCase.enterContext (Python 3.11+) does: enter now, exit among the cleanups.
            eager = eager_tasks()
            self.eager_run = eager.__enter__()
            self.addCleanup(eager.__exit__, None, None, None)

    @property
    def task_capture(self) -> EnqueueCapture:
        if self._task_capture is None:
            raise RuntimeError(f"{type(self).__name__}.setUp() must call super().setUp(): the capture begins there")
        return self._task_capture

    def enqueued_tasks(self) -> list[Task]:
        """The tasks enqueued since the test began, oldest first."""
        return self.task_capture.tasks

    def assertEnqueued(  # unittest's spelling
        self,
        task: TaskRef,
        *,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        count: int | None = None,
    ) -> list[Task]:
        """:meth:`EnqueueCapture.assert_enqueued <tasks.testing.capture.EnqueueCapture.assert_enqueued>`."""
        return self.task_capture.assert_enqueued(
            task, args=args, kwargs=kwargs, queue=queue, priority=priority, count=count
        )

    def assertNotEnqueued(
        self,
        task: TaskRef | None = None,
        *,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
    ) -> None:
        self.task_capture.assert_not_enqueued(task, args=args, kwargs=kwargs, queue=queue, priority=priority)

    def run_until_empty(
        self,
        queues: Sequence[str] | None = None,
        *,
        using: str = DEFAULT_DB_ALIAS,
        with_scheduled: bool = False,
        limit: int = DEFAULT_LIMIT,
    ) -> Drained:
        """:func:`tasks.testing.inline.run_until_empty` on the test's connection."""
        return run_until_empty(queues, using=using, with_scheduled=with_scheduled, limit=limit)


__all__ = ["TaskTestMixin"]
