"""Django's task framework, wherever it comes from: ``django.tasks`` (Django 6.0 and later) or, on
Django 5.2 LTS, the ``django-tasks`` backport (module ``django_tasks``, the same API under a few other
names). Everything else in the package, its tests and its benchmarks imports the framework from here
and nowhere else (tests/unit/test_compat.py holds the tree to that), so the one choice is made once.

On Django 5.2 without the backport nothing of the queue can load; the error says what to install.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING

import django
from django.core.exceptions import ImproperlyConfigured

#: The oldest backport release whose API is Django 6.0's (TaskContext, ``takes_context``, the
#: ``errors`` list of a result, the enqueued/started/finished signals, ``run_after`` as a datetime).
BACKPORT_MINIMUM = (0, 12)
BACKPORT_REQUIREMENT = "django-tasks>=0.12"
INSTALL_HINT = (
    'on Django 5.2 install the django-tasks backport with it: pip install "django-leasing[django52]" '
    f'(or "{BACKPORT_REQUIREMENT}"), and add "django_tasks" to INSTALLED_APPS'
)


def _framework() -> str:
    if django.VERSION >= (6, 0):
        return "django.tasks"
    if importlib.util.find_spec("django_tasks") is None:
        raise ImproperlyConfigured(f"django-leasing needs Django's task framework (Django 6.0+); {INSTALL_HINT}")
    return "django_tasks"


#: ``django.tasks`` or ``django_tasks``: the module path of the framework in use.
FRAMEWORK = _framework()
#: What the framework logs under (its signal receivers log each task's enqueue, start and finish).
LOGGER_NAME = FRAMEWORK
#: Dotted paths of the framework's own backends, for TASKS settings.
IMMEDIATE_BACKEND = f"{FRAMEWORK}.backends.immediate.ImmediateBackend"
DUMMY_BACKEND = f"{FRAMEWORK}.backends.dummy.DummyBackend"


def backport_version() -> tuple[int, ...] | None:
    """The installed backport's version (None: not installed, or Django's own framework in use)."""
    if FRAMEWORK != "django_tasks":
        return None
    try:
        text = importlib.metadata.version("django-tasks")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


if TYPE_CHECKING or FRAMEWORK == "django.tasks":
    from django.tasks import (
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_QUEUE_NAME,
        Task,
        TaskContext,
        TaskResult,
        TaskResultStatus,
        default_task_backend,
        task,
        task_backends,
    )
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.backends.dummy import DummyBackend
    from django.tasks.backends.immediate import ImmediateBackend
    from django.tasks.base import TASK_MAX_PRIORITY, TASK_MIN_PRIORITY, TaskError
    from django.tasks.exceptions import (
        InvalidTask,
        InvalidTaskBackend,
        TaskException,
        TaskResultDoesNotExist,
        TaskResultMismatch,
    )
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json
else:
    from django_tasks import (
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_QUEUE_NAME,
        TaskContext,
        TaskResult,
        TaskResultStatus,
        default_task_backend,
        task,
        task_backends,
    )
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.backends.dummy import DummyBackend
    from django_tasks.backends.immediate import ImmediateBackend
    from django_tasks.base import TASK_MAX_PRIORITY, TASK_MIN_PRIORITY, Task, TaskError
    from django_tasks.exceptions import InvalidTaskBackendError as InvalidTaskBackend
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskException, TaskResultDoesNotExist, TaskResultMismatch
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json

__all__ = [
    "DEFAULT_TASK_BACKEND_ALIAS",
    "DEFAULT_TASK_QUEUE_NAME",
    "DUMMY_BACKEND",
    "FRAMEWORK",
    "IMMEDIATE_BACKEND",
    "LOGGER_NAME",
    "TASK_MAX_PRIORITY",
    "TASK_MIN_PRIORITY",
    "BaseTaskBackend",
    "DummyBackend",
    "ImmediateBackend",
    "InvalidTask",
    "InvalidTaskBackend",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskException",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultMismatch",
    "TaskResultStatus",
    "default_task_backend",
    "normalize_json",
    "task",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
