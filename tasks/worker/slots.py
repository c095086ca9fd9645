"""Which handlers still run in this process, for the concurrency keys' kept slots.

An attempt that timed out or lost its lease while its handler (or a thread it handed work to) still
runs keeps its key's slot until that code has returned: giving the slot back earlier would let a
second task of the key run beside it (tasks/lifecycle/concurrency.py). This part tracks the
handlers, tells the heartbeat which attempts are live, and gives the slots back once they return.

The common path costs nothing here: an attempt still ours is never tracked."""

from __future__ import annotations

import logging
import threading

from django.db import DatabaseError

from tasks.lifecycle import concurrency
from tasks.runtime import Execution
from tasks.worker.ledger import Ledger
from tasks.worker.mailbox import Mailbox
from tasks.worker.session import Session

logger = logging.getLogger("tasks.worker")

Key = tuple[int, int]


class KeptSlots:
    def __init__(self, session: Session, mailbox: Mailbox, ledger: Ledger) -> None:
        self.session = session
        self.mailbox = mailbox
        self.ledger = ledger
        # Abandoned attempts whose handler (or a thread of it) still runs.
        self._outliving: set[Key] = set()
        self._lock = threading.Lock()
        self._unreleased: list[Key] = []

    # -- from the threads that run handlers ---------------------------------------------------------

    def handler_returned(self, execution: Execution) -> None:
        """The attempt's handler function or coroutine has returned (its thread or the loop's)."""
        execution.handler_done = True
        self._release_if_ended(execution)

    def thread_started(self, execution: Execution) -> None:
        """A coroutine of the attempt handed work to a thread (tasks/worker/aio.py, AttemptThreads)."""
        with self._lock:
            execution.threads += 1

    def thread_returned(self, execution: Execution) -> None:
        with self._lock:
            execution.threads -= 1
        self._release_if_ended(execution)

    def _release_if_ended(self, execution: Execution) -> None:
        """An attempt that was abandoned or lost may have had its key slot kept, by this worker or by
        recovery: once its handler and its threads have all returned, the dispatcher gives it back
        (and the heartbeat gives back any kept for an attempt whose handler is not running)."""
        if not execution.lost:
            return  # the common path: nothing can be kept for an attempt still ours
        with self._lock:
            if not execution.handler_done or execution.threads:
                return
            self._outliving.discard(execution.key)
        self.mailbox.release_slot(execution.key)

    # -- from the dispatcher ------------------------------------------------------------------------

    def outlives(self, execution: Execution) -> None:
        """An abandoned attempt: live for the heartbeat until its handler and threads return."""
        with self._lock:
            if not execution.handler_done or execution.threads:
                self._outliving.add(execution.key)

    def keep(self, executions: list[Execution], reason: str) -> None:
        """Keep the key slots of attempts given up while their handlers run (one statement)."""
        if not executions:
            return
        try:
            concurrency.keep_slots(
                self.session.id, [e.key for e in executions], reason=reason, using=self.session.using
            )
        except DatabaseError as exc:
            # Recorded all the same: a timeout must not wait on the database. The slot is then free
            # from the timeout on, as before this rule existed; said in the log.
            logger.warning("worker %s: could not keep the key slots of timed-out attempts: %s", self.session.id, exc)

    def release_returned(self) -> None:
        """Give back the kept slots of attempts whose handlers have returned (again next round on error)."""
        self._unreleased += self.mailbox.take_released()
        if not self._unreleased:
            return
        try:
            concurrency.release_kept(self.session.id, self._unreleased, using=self.session.using)
        except DatabaseError as exc:
            logger.warning("worker %s: giving back kept key slots failed (again next round): %s", self.session.id, exc)
            return
        self._unreleased = []

    # -- for the heartbeat --------------------------------------------------------------------------

    def live_attempts(self) -> list[Key]:
        """The attempts with a handler (or a thread of one) running in the process now: those in hand
        that began and have not returned, and abandoned ones still running."""
        running = [e.key for e in self.ledger.snapshot() if e.started is not None and not e.handler_done]
        with self._lock:
            return running + list(self._outliving)
