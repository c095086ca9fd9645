"""What a worker gives back to the queue, uncharged: claims it could not begin, started attempts the
dispatcher hands back with a reason (a coroutine cancelled on a lost lease, the neighbours of one
that blocked the event loop), what has not started when it drains, and everything still held when
it stops. One statement per batch (``HAND_BACK_SQL``), retried while it is safe to (it is idempotent:
the compare-and-set refuses what is no longer ours)."""

from __future__ import annotations

import logging
from typing import Any

from tasks import tracing
from tasks.runtime import Execution
from tasks.worker.ledger import Ledger
from tasks.worker.logs import log_attempt
from tasks.worker.mailbox import Mailbox
from tasks.worker.session import Session, retrying
from tasks.worker.signals import FinishedSignals

logger = logging.getLogger("tasks.worker")

Key = tuple[int, int]


class HandBacks:
    def __init__(self, session: Session, mailbox: Mailbox, ledger: Ledger, signals: FinishedSignals) -> None:
        self.session = session
        self.mailbox = mailbox
        self.ledger = ledger
        self.signals = signals

    def _send(self, what: str, keys: list[Key], **reason: str) -> Any:
        session = self.session
        return retrying(what, session, lambda: session.tasks().hand_back(session.id, keys, **reason))

    def take_handbacks(self) -> None:
        by_reason: dict[str, list[Execution]] = {}
        for execution, reason in self.mailbox.take_handbacks():
            by_reason.setdefault(reason, []).append(execution)
        for reason, executions in by_reason.items():
            handed = self._send("handing back cancelled attempts", [x.key for x in executions], reason=reason)
            for execution in executions:
                log_attempt(
                    logger,
                    logging.WARNING,
                    execution,
                    "task %d %s: %s%s",
                    execution.id,
                    execution.task.task_path,
                    reason,
                    "" if handed and execution.key in handed else " (the row was no longer ours)",
                )
                if execution.started is not None:
                    self.signals.ended(execution)
                if execution.span is not None:
                    tracing.end_attempt(execution, "handed_back")
            self.ledger.remove(e.key for e in executions)

    def take_refused(self) -> list[float]:
        """Claims their rate key refused: the refusing statement handed them back already. Returns
        when (local clock) each comes due again: deferred rows are not NOTIFYed, so the dispatcher
        looks for work then rather than at its next poll (a poll interval longer than the key's
        period would otherwise cut the key's rate)."""
        refused = self.mailbox.take_refused()
        for execution, _due, refusal in refused:
            execution.mark_lost(f"its rate key refused the start; runs again at {refusal.run_after.isoformat()}")
        self.session.handed_back += len(refused)
        self.session.stats["rate_refused"] += len(refused)
        self.ledger.remove(e.key for e, _, _ in refused)
        return [due for _, due, _ in refused]

    def take_returns(self) -> list[Execution]:
        """Claims the executors could not begin go back to the queue, uncharged; returns them."""
        returns = self.mailbox.take_returns()
        if not returns:
            return []
        # Lapsed ones too: "lost" is this worker's own (early) verdict; if the row is still ours, it
        # goes back now rather than after its lease (the compare-and-set refuses the rest).
        self._send(
            "handing back claims", [e.key for e in returns], reason="handed back by its worker before it could run"
        )
        self.session.handed_back += len(returns)
        self.ledger.remove(e.key for e in returns)
        return returns

    def unstarted(self, waiting: list[Execution] | None = None) -> list[Execution]:
        """On drain, claims not yet begun go back to the queue at once, uncharged: those the executors
        have not taken, and ``waiting``, those never handed to them (tasks/worker/handoff.py);
        returns them."""
        unstarted = (waiting or []) + self.mailbox.take_unstarted()
        if not unstarted:
            return []
        for execution in unstarted:
            execution.mark_lost("handed back unstarted at shutdown")
        self._send("handing back unstarted claims", [e.key for e in unstarted])
        self.ledger.remove(e.key for e in unstarted)
        return unstarted

    def everything(self) -> list[Execution]:
        """At the end: everything still held goes back (unstarted and running attempts, and finished
        ones whose outcome could not be written: their compare-and-set protects the rows they no
        longer own); returns them."""
        session = self.session
        unfinished = [e for e in self.ledger.snapshot() if not e.abandoned]
        for execution in unfinished:
            execution.mark_lost("handed back at shutdown")
        if not unfinished:
            return []
        handed = self._send("handing back at shutdown", [e.key for e in unfinished])
        for execution in unfinished:
            if execution.started is not None:
                self.signals.ended(execution)  # handed back (or lapsing): the row says where it stands
            if execution.span is not None:
                tracing.end_attempt(execution, "handed_back")
        if handed is None:
            logger.warning("worker %s: hand-back failed (tasks return after their TTL)", session.id)
        else:
            logger.info(
                "worker %s handed back %d unfinished task(s): %s",
                session.id,
                len(handed),
                sorted(k[0] for k in handed),
                extra={"worker_id": session.id},
            )
        return unfinished
