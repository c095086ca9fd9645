"""The executor threads: each takes a claimed attempt from the mailbox, runs its handler with no
transaction or lock held, and delivers the outcome. Whatever a handler does (raise any
``BaseException``, return what jsonb cannot hold, never return) ends as an outcome or, past its
timeout, as an abandoned attempt whose thread is replaced."""

from __future__ import annotations

import logging
import threading
import time

from django.db import close_old_connections, connections

from leasing import clock
from tasks import tracing
from tasks.models import RateRefused
from tasks.runtime import Execution, _set_current
from tasks.worker import handlers
from tasks.worker.handlers import HandlerCache
from tasks.worker.isolation import IsolationGate
from tasks.worker.ledger import Ledger, Outcome
from tasks.worker.logs import log_attempt
from tasks.worker.mailbox import Mailbox
from tasks.worker.session import Session, rate_limited, retrying, take_start
from tasks.worker.sizing import Pace
from tasks.worker.slots import KeptSlots

logger = logging.getLogger("tasks.worker")


class ThreadExecutors:
    def __init__(
        self,
        session: Session,
        mailbox: Mailbox,
        ledger: Ledger,
        *,
        concurrency: int,
        gate: IsolationGate,
        slots: KeptSlots,
        resolve: HandlerCache,
        pace: Pace,
    ) -> None:
        self.session = session
        self.mailbox = mailbox
        self.ledger = ledger
        self.concurrency = concurrency
        self.gate = gate
        self.slots = slots
        self.resolve = resolve
        self.pace = pace
        #: Abandoned attempts whose thread has not returned yet (each was replaced by a new thread).
        self.zombies = 0
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for _ in range(self.concurrency):
            self.spawn()

    def spawn(self) -> None:
        """One more executor thread (at start, and in place of one stuck past a timeout)."""
        thread = threading.Thread(target=self._serve, name=f"executor-{len(self.threads) + 1}", daemon=True)
        thread.start()
        self.threads.append(thread)

    def stop(self) -> None:
        """Each thread ends once it has nothing to run (stuck ones end if their handler returns)."""
        self.mailbox.end_executors(len(self.threads))

    def abandoned(self, execution: Execution) -> None:
        """The dispatcher gave up on the attempt past its timeout: its thread is a zombie until its
        handler returns, and a new thread takes its place (unless the worker is draining)."""
        self.zombies += 1
        self.session.stats["zombies"] = self.zombies
        if not self.session.draining.is_set():
            self.spawn()

    def _serve(self) -> None:
        try:
            while (execution := self.mailbox.next_work()) is not None:
                if self._run_one(execution):
                    return  # abandoned: a replacement thread already took this one's place
        finally:
            connections.close_all()

    def _run_one(self, execution: Execution) -> bool:
        """Run one attempt to an outcome. Returns True when this thread must retire."""
        isolated = execution.task.isolate
        if isolated:
            # Its workers vanished beside other attempts more than once: run it alone, so that if it
            # kills this process too, the crash is attributable. Waiting longer than its lease would
            # only hold it from workers that are free: hand it back instead.
            if not self.gate.enter_exclusive(execution, execution.deadline, clock.monotonic):
                log_attempt(
                    logger,
                    logging.INFO,
                    execution,
                    "task %d: no quiet moment to run it isolated; handed back",
                    execution.id,
                )
                return self.mailbox.give_back(execution)
        elif not self.gate.enter_shared(execution, self.session.draining):
            return self.mailbox.give_back(execution)
        try:
            if execution.lost or self.session.draining.is_set():
                return self.mailbox.give_back(execution)  # a lapsed or unwanted claim: not ours to run
            return self._run_admitted(execution, isolated)
        finally:
            self.gate.release(execution)

    def _run_admitted(self, execution: Execution, isolated: bool) -> bool:
        session = self.session
        rated = rate_limited(execution.task)
        if execution.task.suspect or rated:
            # An earlier worker vanished while holding this task: mark the start before the handler
            # runs, so a poison pill is charged for every try after the first. A rate-limited task
            # takes its key's start in the same statement (or is handed back by it: RATE_START_SQL).
            # Idempotent, so a start whose reply was lost is simply sent again. An abandoned thread
            # still running in this process means the attempt does not run alone after all.
            alone = isolated and self.zombies == 0
            started = retrying(
                "taking a rate-limited start" if rated else "recording a start",
                session,
                lambda: take_start(session, execution, rated=rated, isolated=alone),
            )
            if isinstance(started, RateRefused):
                return self.mailbox.refused(execution, started)
            if started is None:
                execution.mark_lost("the claim lapsed before it could start")
                return self.mailbox.give_back(execution)
            execution.begin(started)
            # Before the ledger counts it running: from then on the dispatcher may end its span (a timeout).
            tracing.start_attempt(execution, "isolated" if isolated else "thread")
            self.ledger.begin(execution)
        else:
            now = time.time()
            execution.begin_local(now)
            tracing.start_attempt(execution, "isolated" if isolated else "thread")
            # The marker goes in before the ledger counts the attempt running: a dispatcher that reads
            # the ledger after that finds the marker waiting (``Dispatcher._next_wait``), so it never
            # sleeps the whole poll interval past a marker it was not woken for.
            self.mailbox.started(execution)
            self.ledger.begin(execution)
        session.stats["started"] += 1
        try:
            outcome = self._execute(execution)
        except BaseException as exc:  # the worker's own code around the handler; never lose the attempt
            log_attempt(logger, logging.ERROR, execution, "task %d: executor error", execution.id, exc_info=True)
            outcome = Outcome(execution, failure=handlers.failure_from(execution, exc))
        finally:
            self.slots.handler_returned(execution)
        self.pace.observe(clock.monotonic() - (execution.started or clock.monotonic()))
        if not self.ledger.finish(execution):
            self.zombies -= 1
            session.stats["zombies"] = self.zombies
            session.stats["late_results_dropped"] += 1
            log_attempt(
                logger, logging.WARNING, execution, "task %d: late result of an abandoned attempt dropped", execution.id
            )
            return True
        self.mailbox.deliver(outcome)
        return False

    def _execute(self, execution: Execution) -> Outcome:
        task = execution.task
        _set_current(execution)
        traced = tracing.enter(execution) if execution.span is not None else None
        target = None
        try:
            target = self.resolve(task.task_path, api_origin=task.api_origin)
            value = handlers.call(target, execution)
        except BaseException as exc:
            return handlers.failure_outcome(execution, exc, target)
        finally:
            if traced is not None:
                tracing.leave(traced)
            _set_current(None)
            try:
                close_old_connections()
            except Exception:
                logger.debug("closing the handler's connections failed", exc_info=True)
        return handlers.value_outcome(execution, value)
