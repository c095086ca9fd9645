"""The paths users write in settings, imports and stored rows keep working whatever moves inside the
package: this list is the public API. A name removed from it is a breaking change."""

from __future__ import annotations

import importlib

import pytest
from django.utils.module_loading import import_string

PUBLIC = [
    # settings and URLconfs
    "tasks.backends.LeaseBackend",
    "tasks.urls.urlpatterns",
    "tasks.api_urls.urlpatterns",
    "tasks.site_urls.urlpatterns",
    "leasing.urls.urlpatterns",
    "leasing.metrics.metrics_view",
    # imports in user code
    "tasks.models.Task",
    "tasks.models.TaskStatus",
    "tasks.models.Worker",
    "tasks.models.QueueControl",
    "tasks.models.Schedule",
    "tasks.models.ScheduleRun",
    "tasks.runtime.current_task",
    "tasks.worker.Worker",
    "tasks.celery.recover_expired",
    "tasks.celery.prune_retained",
    "leasing.lease",
    "leasing.LeaseLost",
    "leasing.LeaseAcquisitionError",
    "leasing.election.LeaderElection",
    "leasing.models.Lease",
    "leasing.embedded.database_url",
    # test helpers in users' tests (docs/howto/testing.md), and the pytest11 entry point's module
    "tasks.testing.TaskTestMixin",
    "tasks.testing.EnqueueCapture",
    "tasks.testing.run_until_empty",
    "tasks.testing.eager_tasks",
    "tasks.testing.Drained",
    "tasks.testing.RunLimitReached",
    "tasks.testing.plugin",
    # the fields of the log records about a task (docs/howto/production.md, "Structured logs")
    "tasks.runtime.LOG_FIELDS",
    # stored in rows: exception paths of recorded errors, the demo's handler
    "tasks.exceptions.TaskTimeout",
    "tasks.exceptions.TaskLeaseLost",
    "tasks.exceptions.WorkerShutdown",
    "tasks.exceptions.UnstorableResult",
    "tasks.exceptions.UnstorableOutcome",
    "tasks.exceptions.EventLoopBlocked",
    "tasks.exceptions.TaskPathRefused",
    "tasks.exceptions.NotATask",
    "tasks.demo.sleep",
]


@pytest.mark.parametrize("path", PUBLIC)
def test_the_public_path_imports(path: str) -> None:
    assert import_string(path) is not None


@pytest.mark.parametrize("path", [p for p in PUBLIC if p.startswith("tasks.exceptions.")])
def test_an_exception_is_defined_where_its_stored_path_says(path: str) -> None:
    # An error entry stores the class's own module and name: moving it would orphan stored rows.
    kind = import_string(path)
    assert f"{kind.__module__}.{kind.__qualname__}" == path


def test_the_backend_and_the_demo_handler_are_named_by_their_public_paths() -> None:
    backend = import_string("tasks.backends.LeaseBackend")
    assert f"{backend.__module__}.{backend.__qualname__}" == "tasks.backends.LeaseBackend"
    assert importlib.import_module("tasks.demo").sleep.__module__ == "tasks.demo"
