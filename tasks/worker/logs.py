"""What the worker's log records say about a task: each carries the attempt's ``task_id``, ``queue``,
``attempt`` and ``worker_id`` (and ``outcome`` on the record that ends the attempt) as ``extra``
fields (:data:`tasks.runtime.LOG_FIELDS`), for a JSON formatter to put beside the message
(docs/howto/production.md, "Structured logs").

The fields are built only for a record that will be emitted: several of these records lie on the
per-task path (one per finished attempt at INFO), and a level that filters them out must cost no
dictionary either."""

from __future__ import annotations

import logging
from typing import Any

from tasks.runtime import Execution


def log_attempt(
    logger: logging.Logger,
    level: int,
    execution: Execution,
    message: str,
    *args: Any,
    outcome: str | None = None,
    exc_info: bool = False,
) -> None:
    """``logger.log(level, message, *args)`` with the attempt's fields, if the level is enabled."""
    if logger.isEnabledFor(level):
        # stacklevel: the record names the caller's function and line, not this helper's.
        logger.log(level, message, *args, extra=execution.log_fields(outcome), exc_info=exc_info, stacklevel=2)
