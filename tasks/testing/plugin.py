"""The pytest plugin (registered by the ``pytest11`` entry point of django-leasing, so a project's
pytest loads it once the package is installed): fixtures only, each asking pytest-django's ``db``.

- ``enqueued_tasks``: an :class:`~tasks.testing.capture.EnqueueCapture` begun when the test starts;
- ``run_tasks``: :func:`~tasks.testing.inline.run_until_empty`, on the test's connection;
- ``eager_tasks``: eager mode for the whole test (:func:`~tasks.testing.eager.eager_tasks`), yielding
  its :class:`~tasks.testing.eager.EagerRun`.

Importing this module imports neither Django nor the package's models (pytest loads it before
Django is set up, in projects that may not use either): each fixture imports what it needs when a
test asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tasks.testing.capture import EnqueueCapture
    from tasks.testing.eager import EagerRun
    from tasks.testing.inline import Drained


@pytest.fixture
def enqueued_tasks(db: None) -> EnqueueCapture:
    """What the test enqueues: ``enqueued_tasks.assert_enqueued(task, args=..., kwargs=...)``,
    ``.assert_not_enqueued(...)``, ``.tasks``."""
    from tasks.testing.capture import EnqueueCapture

    return EnqueueCapture()


@pytest.fixture
def run_tasks(db: None) -> Callable[..., Drained]:
    """``run_tasks(queues=None, *, with_scheduled=False, limit=1000, using="default")``: run the due
    tasks to none on the test's connection; returns how the attempts ended."""
    from tasks.testing.inline import run_until_empty

    def run(*args: Any, **kwargs: Any) -> Drained:
        return run_until_empty(*args, **kwargs)

    return run


@pytest.fixture
def eager_tasks(db: None) -> Iterator[EagerRun]:
    """Every enqueue of the test runs its tasks at once."""
    from tasks.testing.eager import eager_tasks as eager

    with eager() as run:
        yield run
