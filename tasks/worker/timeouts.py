"""Attempts past their timeout, on the dispatcher's thread (tasks/worker/dispatcher.py): abandoned,
their timeout recorded at once (so that a late result is refused by the database), their executor
slot given to a new thread or their coroutine cancelled; a keyed attempt keeps its key's slot until
its handler has returned (tasks/lifecycle/concurrency.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tasks.exceptions import TaskTimeout
from tasks.runtime import Execution
from tasks.worker.handlers import HandlerCache, failure_from, with_policy
from tasks.worker.isolation import IsolationGate
from tasks.worker.ledger import Ledger, Outcome
from tasks.worker.logs import log_attempt
from tasks.worker.mailbox import Mailbox
from tasks.worker.session import Session
from tasks.worker.slots import KeptSlots
from tasks.worker.threads import ThreadExecutors

if TYPE_CHECKING:
    from tasks.worker.aio import AsyncExecutor

logger = logging.getLogger("tasks.worker")


class Timeouts:
    def __init__(
        self, session: Session, mailbox: Mailbox, ledger: Ledger, *, slots: KeptSlots, gate: IsolationGate,
        threads: ThreadExecutors, aio: AsyncExecutor | None, resolve: HandlerCache, request_stop: Callable[[], None],
    ) -> None:  # fmt: skip
        self.session = session
        self.mailbox = mailbox
        self.ledger = ledger
        self.slots = slots
        self.gate = gate
        self.threads = threads
        self.aio = aio
        self.resolve = resolve
        self.request_stop = request_stop

    def _handler(self, execution: Execution) -> Any:
        """The attempt's handler (resolved before, so cached), or None."""
        try:
            return self.resolve(execution.task.task_path, api_origin=execution.task.api_origin)
        except Exception:
            return None

    def abandon(self, overdue: list[Execution]) -> None:
        """Attempts past their timeout: stop heartbeating them, record the timeout now, and give the
        executor slot to a new thread."""
        abandoned = [execution for execution in overdue if self.ledger.abandon(execution)]  # not finished
        reasons = {}
        for execution in abandoned:
            self.slots.outlives(execution)
            timeout = execution.task.timeout or 0.0
            reasons[execution.key] = f"ran past its timeout of {timeout:g}s: abandoned, its late result will be refused"
            # Lost before its slot is kept: a handler that returns meanwhile asks for the slot back,
            # and this thread sends that after the keep.
            execution.mark_lost(reasons[execution.key])
        self.slots.keep(abandoned, reason="timeout")
        for execution in abandoned:
            self.gate.release(execution)  # a stuck handler must not keep anything else from running
            self._record(execution, reasons[execution.key])
            if execution.is_async:
                # A coroutine is cancelled, not replaced: the loop goes on running the others. One
                # that ignores the cancellation is a zombie until it ends; one blocking the loop is
                # the watchdog's (tasks/worker/aio.py).
                assert self.aio is not None
                self.aio.zombies += 1
                self.aio.cancel(execution, "timeout", f"cancelled: {reasons[execution.key]}")
                continue
            self.threads.abandoned(execution)  # the stuck thread retires when (if) its handler returns
            self._stop_if_too_many_stuck()

    def _record(self, execution: Execution, reason: str) -> None:
        """The timeout as the attempt's outcome, for the next round to write."""
        self.session.stats["timed_out"] += 1
        log_attempt(logger, logging.WARNING, execution, "task %d %s %s", execution.id, execution.task.task_path, reason)
        timed_out = TaskTimeout(f"task {execution.id} {reason}")
        # The retry policy applies (retry_on, max_attempts), but not a backoff function: user
        # code does not run on the dispatcher (the default backoff is used).
        failure = with_policy(
            failure_from(execution, timed_out), execution, timed_out, self._handler(execution), backoff=False
        )
        self.mailbox.deliver(Outcome(execution, failure=failure, error=timed_out), wake=False)

    def _stop_if_too_many_stuck(self) -> None:
        session = self.session
        if self.threads.zombies > 2 * self.threads.concurrency and not session.draining.is_set():
            logger.error(
                "worker %s: %d handlers stuck past their timeouts; stopping so that a supervisor"
                " restarts a clean process",
                session.id,
                self.threads.zombies,
            )
            self.request_stop()
