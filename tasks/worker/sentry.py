"""Handler failures in Sentry, with the task they belong to (the ``sentry`` extra).

    import sentry_sdk
    from tasks.worker.sentry import LeasingIntegration

    sentry_sdk.init(dsn=..., integrations=[LeasingIntegration()])

Every attempt whose handler raises is sent as an event of its exception, tagged with the task
(``leasing.task.id``, ``leasing.task.path``, ``leasing.queue``, ``leasing.attempt``,
``leasing.worker``, and ``leasing.retryable``: whether its retry policy retries that exception; the
attempts left decide the rest) and with a "leasing task" context (max attempts, the backend alias,
the token of the attempt). What a handler decides is not an error and is not sent: a snooze, a
cancel, a discard. Nothing is sent unless the integration is in the active client.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from tasks.exceptions import Discard

if TYPE_CHECKING:
    from tasks.lifecycle.values import Failure
    from tasks.runtime import Execution

#: Whether sentry_sdk can be imported at all (the extra is installed): checked once.
AVAILABLE = importlib.util.find_spec("sentry_sdk") is not None

if TYPE_CHECKING or AVAILABLE:
    from sentry_sdk.integrations import Integration
else:  # without the extra, a name that can be subclassed and is never registered

    class Integration:
        identifier = ""


class LeasingIntegration(Integration):
    """Sends handler failures to Sentry with their task (the module doc)."""

    identifier = "django_leasing"

    @staticmethod
    def setup_once() -> None:
        """Nothing to patch: the worker calls :func:`report` where an attempt fails."""


def report(execution: Execution, exc: BaseException, failure: Failure) -> None:
    """Send ``exc``, the failure of ``execution``'s handler, to the active Sentry client if it has
    :class:`LeasingIntegration`; otherwise nothing."""
    if not AVAILABLE or isinstance(exc, Discard):
        return
    import sentry_sdk

    client = sentry_sdk.get_client()
    if not client.is_active() or client.get_integration(LeasingIntegration) is None:
        return
    task = execution.task
    tags: dict[str, Any] = {
        "leasing.task.id": task.id,
        "leasing.task.path": task.task_path,
        "leasing.queue": task.queue,
        "leasing.attempt": execution.attempt,
        "leasing.worker": execution.worker_id,
        "leasing.retryable": failure.retry,
    }
    with sentry_sdk.new_scope() as scope:
        for name, value in tags.items():
            scope.set_tag(name, str(value))  # Sentry indexes tags as text
        scope.set_context(
            "leasing task",
            {
                "id": task.id,
                "path": task.task_path,
                "queue": task.queue,
                "attempt": execution.attempt,
                "max_attempts": task.max_attempts,
                "token": task.token,
                "backend": task.backend_alias,
                "database": execution.using,
            },
        )
        sentry_sdk.capture_exception(exc)
