"""Writing attempts' outcomes so that no outcome can wedge the worker.

Two kinds of database error need opposite answers:

- **the connection failed** (reset, terminated backend, timeout): the statement may or may not have
  committed. Re-sending blindly would make the compare-and-set refuse rows that *did* land, and they
  would be miscounted as fencing rejections. So the writer asks the database where each attempt
  ended (:meth:`TaskQuerySet.attempt_fates`) and re-sends only what is still held. It keeps trying
  for at most one TTL, then gives up: those attempts are no longer heartbeated, their leases lapse,
  and recovery takes over.
- **the statement was refused** (a data error: something the database cannot store; a constraint):
  retrying will not fix it. The batch is split and each attempt written alone, so the others land;
  an attempt whose result is refused is recorded as failed (``UnstorableOutcome``) instead, and one
  whose failure record is refused is recorded with a minimal error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError

from tasks.lifecycle.storable import storable_text
from tasks.models import AttemptFate, FailOutcome, Failure
from tasks.worker.logs import log_attempt
from tasks.worker.session import CONNECTION_ERRORS, Session, is_connection_failure, is_lock_wait

if TYPE_CHECKING:
    from tasks.worker.ledger import Outcome

logger = logging.getLogger("tasks.worker")

Key = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of outcome: how to send a batch of them, and how to tell from where an attempt ended
    that its write landed (for reconciliation after a lost reply)."""

    what: str
    send: Callable[[Sequence[Outcome]], set[Key]]
    landed: Callable[[AttemptFate, Outcome], bool]


class OutcomeWriter:
    def __init__(self, session: Session) -> None:
        self.session = session
        #: What the last writes decided for failures: attempt -> READY (retried) or FAILED.
        self.fail_results: dict[Key, FailOutcome] = {}
        #: Outcomes whose row another session holds locked: the dispatcher retries them later.
        self.deferred: list[Outcome] = []
        self.completions = Kind("writing results", self.send_completions, self.completed)
        self.failures = Kind("writing failures", self.send_failures, self.failed)

    @property
    def _manager(self) -> Any:
        self.session.bind()  # a reconnected dispatcher connection gets its timeouts again
        return self.session.tasks()

    def connection_lost(self, what: str, exc: BaseException) -> None:
        logger.warning("worker %s: %s failed (connection): %s", self.session.id, what, exc)
        if is_connection_failure(exc):
            self.session.stats["connection_errors"] += 1
        self.session.close_connection()

    def _pause(self, seconds: float = 0.2) -> None:
        self.session.hurry.wait(seconds)

    # -- successes -----------------------------------------------------------------------------

    def send_completions(self, items: Sequence[Outcome]) -> set[Key]:
        results = [
            (o.execution.id, o.execution.token, o.value_json or "null", o.execution.started_epoch) for o in items
        ]
        accepted: set[Key] = self._manager.complete_many(self.session.id, results)
        return accepted

    def completed(self, fate: AttemptFate, outcome: Outcome) -> bool:
        return fate.completed_by(self.session.id, outcome.execution.token)

    def complete(self, successes: Sequence[Outcome]) -> tuple[set[Key], list[Outcome]]:
        """Write successes; returns (accepted, refused by the database as unstorable)."""
        if not successes:
            return set(), []
        return self.apply(self.completions, successes)

    # -- failures ------------------------------------------------------------------------------

    def send_failures(self, items: Sequence[Outcome]) -> set[Key]:
        # Each report carries when its handler was called: an attempt that ended before its start marker
        # was sent is marked by this statement, which records that start rather than its own clock.
        reports = [replace(o.failure, started=o.execution.started_epoch) for o in items if o.failure is not None]
        written = self._manager.fail_many(self.session.id, reports)
        self.fail_results.update(written)
        return set(written)

    def failed(self, fate: AttemptFate, outcome: Outcome) -> bool:
        kind = outcome.failure.kind if outcome.failure is not None else "fail"
        if fate.failed_by(self.session.id, outcome.execution.token, kind):
            self.fail_results[outcome.key] = FailOutcome(fate.id, fate.status, None)  # type: ignore[arg-type]
            return True
        return False

    def fail(self, failures: Sequence[Outcome]) -> set[Key]:
        """Write failures; a failure the database refuses is written again with a minimal error."""
        if not failures:
            return set()
        written, refused = self.apply(self.failures, failures)
        if refused:
            for outcome in refused:
                outcome.failure = minimal_failure(outcome, "the failure report itself could not be stored")
            again, still_refused = self.apply(self.failures, refused)
            written |= again
            for outcome in still_refused:
                log_attempt(
                    logger,
                    logging.ERROR,
                    outcome.execution,
                    "task %d: the database refused even a minimal failure record; its lease will lapse",
                    outcome.execution.id,
                )
        return written

    # -- the machinery -------------------------------------------------------------------------

    def apply(self, kind: Kind, items: Sequence[Outcome]) -> tuple[set[Key], list[Outcome]]:
        """Send ``items``; reconcile after a connection error, isolate after a refusal.

        Returns (keys written, items the database refused to store).
        """
        try:
            return kind.send(items), []
        except CONNECTION_ERRORS as exc:
            if is_lock_wait(exc):
                # Another session holds one of these rows locked (nothing committed, the connection
                # is fine): write the others now, and this one in a later round.
                if len(items) == 1:
                    log_attempt(
                        logger,
                        logging.WARNING,
                        items[0].execution,
                        "task %d: its outcome waits for a lock another session holds (its row, or its workflow's"
                        " settle while an operator's transaction requeues a member); writing later",
                        items[0].execution.id,
                    )
                    self.deferred.append(items[0])
                    return set(), []
                return self.isolate(kind, items, exc)
            self.connection_lost(kind.what, exc)
            return self.reconcile(kind, items)
        except DatabaseError as exc:
            return self.isolate(kind, items, exc)

    def isolate(self, kind: Kind, items: Sequence[Outcome], exc: Exception) -> tuple[set[Key], list[Outcome]]:
        if len(items) == 1 and not is_lock_wait(exc):
            log_attempt(
                logger,
                logging.ERROR,
                items[0].execution,
                "task %d: %s refused by the database: %s",
                items[0].execution.id,
                kind.what,
                exc,
            )
            items[0].extra["refused"] = storable_text(str(exc), 2000)
            return set(), list(items)
        logger.warning(
            "worker %s: %s refused (%s); writing the %d attempts one by one",
            self.session.id,
            kind.what,
            exc,
            len(items),
        )
        written: set[Key] = set()
        refused: list[Outcome] = []
        for item in items:
            ok, bad = self.apply(kind, [item])
            written |= ok
            refused += bad
        return written, refused

    def reconcile(self, kind: Kind, items: Sequence[Outcome]) -> tuple[set[Key], list[Outcome]]:
        """After a connection error: find out which writes landed, re-send the rest, for one TTL."""
        give_up_at = self.session.retry_deadline()
        written: set[Key] = set()
        pending = list(items)
        while pending:
            if self.session.out_of_retries(give_up_at):
                logger.error(
                    "worker %s: giving up %s for %d attempt(s) after connection errors; their leases will lapse",
                    self.session.id,
                    kind.what,
                    len(pending),
                )
                for outcome in pending:
                    outcome.execution.mark_lost("its outcome could not be written (connection errors)")
                break
            try:
                fates = self._manager.attempt_fates([o.execution.id for o in pending])
                resend: list[Outcome] = []
                for outcome in pending:
                    fate = fates.get(outcome.execution.id)
                    if fate is None:
                        continue
                    if kind.landed(fate, outcome):
                        written.add(outcome.key)
                        self.session.stats["reconciled"] += 1
                    elif fate.still_held_by(self.session.id, outcome.execution.token):
                        resend.append(outcome)
                pending = resend
                if pending:
                    written |= kind.send(pending)
                    pending = []
            except CONNECTION_ERRORS as exc:
                self.connection_lost(kind.what, exc)
                self._pause()
            except DatabaseError as exc:
                ok, refused = self.isolate(kind, pending, exc)
                return written | ok, refused
        return written, []

    def return_unknown_claims(self, is_known: Callable[[Key], bool]) -> int:
        """After a claim whose reply was lost: hand back (uncharged) what the database says we hold
        but the worker never heard of. Returns how many."""
        give_up_at = self.session.retry_deadline()
        while not self.session.out_of_retries(give_up_at):
            try:
                held = self._manager.held_by_worker(self.session.id)
                unknown = [key for key, started in held.items() if not started and not is_known(key)]
                if unknown:
                    returned = self._manager.hand_back(self.session.id, unknown)
                    self.session.stats["claims_returned"] += len(returned)
                    logger.warning(
                        "worker %s: %d claim(s) committed but never received (lost reply): handed back uncharged",
                        self.session.id,
                        len(returned),
                    )
                    return len(returned)
                return 0
            except CONNECTION_ERRORS as exc:
                self.connection_lost("reconciling claims", exc)
                self._pause()
        return 0


def minimal_failure(outcome: Outcome, why: str) -> Failure:
    execution = outcome.execution
    refused = outcome.extra.get("refused", "")
    return Failure(
        execution.id,
        execution.token,
        "tasks.exceptions.UnstorableOutcome",
        storable_text(f"{why}: {refused}", 2000),
        "",
        retry=False,
    )
