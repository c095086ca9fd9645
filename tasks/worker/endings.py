"""How an attempt's end is told, once the round that wrote it is known: the state it came to
(succeeded, retried, snoozed, cancelled, discarded, failed, or None: the fence refused it), the
worker's counter of that state, the log record that ends the attempt (tasks/worker/logs.py), the
finished signal (tasks/worker/signals.py) and the attempt's span (tasks/tracing.py). Nothing here
writes to the database: the dispatcher (tasks/worker/dispatcher.py) has, before it calls these."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from leasing import clock
from tasks import tracing
from tasks.exceptions import Discard
from tasks.lifecycle.storable import storable_text
from tasks.worker.logs import log_attempt

if TYPE_CHECKING:
    from tasks.worker.ledger import Outcome
    from tasks.worker.signals import FinishedSignals

logger = logging.getLogger("tasks.worker")

#: What the fail statement stored, by the state the attempt came to (the signals' status).
STORED = {"retried": "READY", "snoozed": "READY", "failed": "FAILED", "discarded": "FAILED", "cancelled": "CANCELLED"}
_LOGGED = {"retried": "failed", "discarded": "discarded (FAILED for good)", "cancelled": "CANCELLED"}


def failure_state(outcome: Outcome, written: bool, retried: bool) -> str | None:
    """The state a failed attempt came to: None when the fail statement did not take it (the fence
    refused it), else as the handler's outcome and the retry decision say."""
    kind = outcome.failure.kind if outcome.failure is not None else "fail"
    if not written:
        return None
    if kind == "snooze":
        return "snoozed"
    if kind == "cancel":
        return "cancelled"
    if retried:
        return "retried"
    return "discarded" if isinstance(outcome.error, Discard) else "failed"


def tell_success(outcome: Outcome, accepted: bool, stats: dict[str, int], signals: FinishedSignals) -> None:
    """A success's end: SUCCESSFUL where the finish was accepted, REJECTED (fencing) where not."""
    state = "succeeded" if accepted else None
    log_end(outcome, state, stats)
    signals.ended(outcome.execution, "SUCCESSFUL" if accepted else None, outcome)
    if outcome.execution.span is not None:
        status = "SUCCESSFUL" if accepted else None
        tracing.end_attempt(outcome.execution, "success" if accepted else "rejected", outcome, status)


def tell_failure(
    outcome: Outcome, state: str | None, result: Any, stats: dict[str, int], signals: FinishedSignals
) -> None:
    """A failure's end, with the fail statement's ``result`` (its retry delay and stored status) when
    it took the failure."""
    log_end(outcome, state, stats, None if result is None else result.retry_in)
    signals.ended(outcome.execution, None if state is None else STORED[state], outcome)
    if outcome.execution.span is not None:
        traced = "rejected" if state is None else tracing.OUTCOMES[state]
        tracing.end_attempt(outcome.execution, traced, outcome, None if result is None else result.status)


def log_end(outcome: Outcome, state: str | None, stats: dict[str, int], retry_in: float | None = None) -> None:
    """The record that ends the attempt: it carries the attempt's fields and its outcome."""
    execution = outcome.execution
    elapsed = clock.monotonic() - (execution.started or execution.claimed_at)
    task = execution.task
    if state is None:
        stats["rejected"] += 1
        log_attempt(
            logger,
            logging.WARNING,
            execution,
            "task %d %s: outcome REJECTED (fencing): this worker no longer held it (%s)",
            task.id,
            task.task_path,
            execution.lost_reason or "lease expired or taken over",
            outcome="rejected",
        )
        return
    stats[state] += 1
    if state == "succeeded":
        log_attempt(
            logger,
            logging.INFO,
            execution,
            "task %d %s succeeded in %.3fs (attempt %d)",
            task.id,
            task.task_path,
            elapsed,
            execution.attempt,
            outcome=state,
        )
    elif state == "snoozed":
        delay = outcome.failure.delay if outcome.failure else None
        log_attempt(
            logger,
            logging.INFO,
            execution,
            "task %d %s snoozed for %gs after %.3fs",
            task.id,
            task.task_path,
            delay or 0.0,
            elapsed,
            outcome=state,
        )
    elif logger.isEnabledFor(logging.WARNING):
        _log_failure(outcome, state, elapsed, retry_in)


def _log_failure(outcome: Outcome, state: str, elapsed: float, retry_in: float | None) -> None:
    execution = outcome.execution
    failure = outcome.failure
    # The attempt's run time, then the retry's delay: until the run_after the fail statement set,
    # on the database clock (unknown when the outcome was found by reconciliation).
    retry = "" if state != "retried" else ", will retry" + ("" if retry_in is None else f" in {retry_in:.3f}s")
    log_attempt(
        logger,
        logging.WARNING,
        execution,
        "task %d %s %s in %.3fs (attempt %d)%s: %s: %s",
        execution.task.id,
        execution.task.task_path,
        _LOGGED.get(state, "FAILED for good"),
        elapsed,
        execution.attempt,
        retry,
        failure.exception_class_path if failure else "?",
        storable_text(failure.message, 500) if failure else "",
        outcome=state,
    )
