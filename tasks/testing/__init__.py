"""Test helpers for projects that use the task queue (docs/howto/testing.md).

- :class:`EnqueueCapture`: what the code under test enqueued, read from the rows it inserted, with
  ``assert_enqueued`` / ``assert_not_enqueued``;
- :func:`run_until_empty`: the due tasks run on the test's own connection with the worker's
  statements and handler code, inside a ``TestCase``'s transaction; a :class:`Drained` summary;
- :func:`eager_tasks`: every enqueue runs its tasks at once;
- :class:`TaskTestMixin` for Django ``TestCase`` classes, and the pytest fixtures of
  :mod:`tasks.testing.plugin` (``enqueued_tasks``, ``run_tasks``, ``eager_tasks``).

The names are imported when first used: pytest imports the plugin module of this package before
Django is set up, and the models cannot be imported then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.testing.capture import EnqueueCapture, task_path
    from tasks.testing.eager import EagerRun, eager_tasks
    from tasks.testing.inline import Drained, RunLimitReached, run_until_empty
    from tasks.testing.mixins import TaskTestMixin

_HOMES = {
    "EnqueueCapture": "capture",
    "task_path": "capture",
    "EagerRun": "eager",
    "eager_tasks": "eager",
    "Drained": "inline",
    "RunLimitReached": "inline",
    "run_until_empty": "inline",
    "TaskTestMixin": "mixins",
}

__all__ = [
    "Drained",
    "EagerRun",
    "EnqueueCapture",
    "RunLimitReached",
    "TaskTestMixin",
    "eager_tasks",
    "run_until_empty",
    "task_path",
]


_MODULES = frozenset(("capture", "eager", "inline", "mixins", "plugin"))


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"tasks.testing.{name}")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tasks.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tasks.testing.{home}"), name)
