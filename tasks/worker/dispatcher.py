"""The dispatcher: the one thread that writes. Each round it counts what the worker holds, abandons
attempts past their timeout, gives back kept key slots and unusable claims, then sends one statement
that records the outcomes that arrived, marks the attempts that began, claims the next batch and
names on the worker's row what it hands to the executors (:mod:`tasks.lifecycle.statements`,
FINISH_START_CLAIM_SQL; :mod:`tasks.worker.handoff`), and routes the handed attempts to the threads or
the event loop. Between rounds it sleeps until the mailbox wakes it or a deadline is due.

At a stop it drains: claims nothing more, hands back what has not started, and waits for the running
attempts up to the grace period (:meth:`Dispatcher.drain`); :meth:`Dispatcher.close` then writes the
last outcomes and hands back everything still held.

Why ~700 lines in one module: everything here runs on the dispatcher's one thread, and the
invariant that only it writes is checked by reading this file; its parts that run elsewhere or hold
no state of the round are apart (handoff.py, handbacks.py, handlers.py, writer.py, heartbeat.py)."""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError

from leasing import clock
from tasks import tracing
from tasks.exceptions import Discard, TaskTimeout
from tasks.lifecycle.storable import storable_text
from tasks.lifecycle.values import ClaimPosition, FairPositions, fair_after_claim
from tasks.models import ClaimedTask, SharedFairCursor
from tasks.runtime import Execution
from tasks.worker.handbacks import HandBacks
from tasks.worker.handlers import HandlerCache, failure_from, with_policy
from tasks.worker.handoff import HandOff, Plan
from tasks.worker.heartbeat import Heartbeat
from tasks.worker.isolation import IsolationGate, IsolationReservation
from tasks.worker.ledger import Census, Ledger, Outcome
from tasks.worker.logs import log_attempt
from tasks.worker.mailbox import Mailbox
from tasks.worker.session import CONNECTION_ERRORS, Session, is_lock_wait, retrying
from tasks.worker.signals import FinishedSignals
from tasks.worker.sizing import Capacity, Pace, fit, prefetch, room, starving
from tasks.worker.slots import KeptSlots
from tasks.worker.threads import ThreadExecutors
from tasks.worker.writer import OutcomeWriter, minimal_failure

if TYPE_CHECKING:
    from tasks.worker.aio import AsyncExecutor

logger = logging.getLogger("tasks.worker")

#: What the fail statement stored, by how the dispatcher counts the attempt's end (the signals' status).
_STORED = {"retried": "READY", "snoozed": "READY", "failed": "FAILED", "discarded": "FAILED", "cancelled": "CANCELLED"}
_LOGGED = {"retried": "failed", "discarded": "discarded (FAILED for good)", "cancelled": "CANCELLED"}

Key = tuple[int, int]

#: A start marker that met a locked row (its start is re-sent later, not lost).
LOCKED: Any = object()
#: A start marker waits this long for the attempt's own outcome, which then carries it (a short task
#: costs one row update, not two); longer attempts are marked by the next round after that.
MARKER_DELAY = 0.02
# Seconds between claims that scan each level from its front (the rest resume where the last claims
# stopped): how long a READY row behind those positions (a hand-back keeping its place) may wait, and
# how often a claim pays for the dead entries an old snapshot keeps (one pass over them per interval).
RESCAN_INTERVAL = 1.0
# Positions in a fair queue's keys a worker keeps, per row of its batch size (a claim visits at most
# its limit of keys, so four claims' worth: a few hundred, each claim sending them all).
FAIR_POSITIONS_PER_BATCH = 4


#: The lock wait of a retried write that met a lock (ms): short, so that the retry keeps its rows
#: locked, away from the heartbeat, no longer than that while the other session holds on.
DEFERRED_LOCK_WAIT_MS = 50


@dataclass
class _Written:
    """What a round's writes came to: the outcomes accepted, the start markers' answers, the claim
    (None: it failed), the results the database refused, and whether the round's statement committed."""

    accepted: set[Key]
    marked: dict[Key, Any]
    claimed: list[ClaimedTask] | None
    refused: list[Outcome] = field(default_factory=list)
    committed: bool = True


@dataclass(frozen=True)
class DispatcherSettings:
    """What the worker's options fix for its rounds."""

    queues: list[str]
    batch_size: int
    prefetch_window: float
    isolate_after: int
    max_tasks: int | None = None


@dataclass(frozen=True)
class DispatcherParts:
    """The worker's parts the dispatcher drives, each built by the Worker from its one Session."""

    threads: ThreadExecutors
    aio: AsyncExecutor | None
    gate: IsolationGate
    reservation: IsolationReservation
    slots: KeptSlots
    heartbeat: Heartbeat
    writer: OutcomeWriter
    signals: FinishedSignals
    resolve: HandlerCache
    pace: Pace
    request_stop: Callable[[], None]
    # A fair queue's turns start where the database's claimers left them (tasks/models/fair_cursor.py).
    fair_cursor: SharedFairCursor | None = None


class Dispatcher:
    def __init__(
        self, session: Session, mailbox: Mailbox, ledger: Ledger, settings: DispatcherSettings, parts: DispatcherParts
    ) -> None:
        self.session = session
        self.mailbox = mailbox
        self.ledger = ledger
        self.queues = settings.queues
        self.batch_size = settings.batch_size
        self.prefetch_window = settings.prefetch_window
        self.isolate_after = settings.isolate_after
        self.max_tasks = settings.max_tasks
        self.threads = parts.threads
        self.aio = parts.aio
        self.gate = parts.gate
        self.reservation = parts.reservation
        self.slots = parts.slots
        self.heartbeat = parts.heartbeat
        self.writer = parts.writer
        self.signals = signals = parts.signals
        self.resolve = parts.resolve
        self.pace = parts.pace
        self.request_stop = parts.request_stop
        self.handbacks = HandBacks(session, mailbox, ledger, signals)
        self.handoff = HandOff(ledger, queues=self.queues)
        self._pending_starts: dict[Key, tuple[Execution, float, float]] = {}
        self._deferred: list[tuple[float, Outcome]] = []  # outcomes whose row was locked: (retry at, outcome)
        # Where the last claims stopped, per priority level: the next claims resume there instead of
        # stepping over every row claimed since an old snapshot began (docs/explanation/claims.md,
        # "Resuming where the last claims stopped"). Until the next scan from the start is due.
        # Only while claims come back full (a backlog is being drained): after a short one the next
        # scans from the start. Rows become READY behind the positions all the time where a queue
        # keeps up (a keyed task admitted when a slot frees keeps its place): resumed claims would
        # pass them over until the next scan from the start (a keyed drain fell from 2,100 to 150
        # tasks/s).
        self._positions: dict[tuple[str, int], ClaimPosition] = {}
        # The same for a fair queue's keys: where its last claims stopped in each key (and level) they
        # took rows from, so that a key's next turn resumes there (tasks/lifecycle/claim.py,
        # ``mine``), kept and dropped with the positions above; the most recent few only (FairPositions).
        self._fair_positions = FairPositions(FAIR_POSITIONS_PER_BATCH * self.batch_size)
        self._scan_from_start_at = 0.0
        self._resume = False  # the last claim came back full
        self._resumed_short = False  # the last claim resumed and came back short: look again at once
        # When (local clock) claims their rate key refused come due again, a heap (tasks/lifecycle/ratelimits.py).
        self._rate_wakes: list[float] = []
        # A fair queue's claims take turns between its keys: the next turn starts after the last key
        # this worker served (tasks/lifecycle/claim.py, PICK_FAIR), so that each worker goes round
        # them all rather than starting from the first key every time; its first claim starts where
        # the database's claimers left the turns (the shared cursor, written back at most once a
        # second and at a clean stop: tasks/models/fair_cursor.py). None for any other claim.
        self.fair_cursor = parts.fair_cursor

    # -- sizing -------------------------------------------------------------------------------------

    def capacity(self) -> Capacity:
        aio = self.aio
        window, batch, backlog = self.prefetch_window, self.batch_size, self._resume
        return Capacity(
            slots=self.threads.concurrency,
            prefetch=prefetch(
                self.threads.concurrency, batch_size=batch, window=window, duration=self.pace.duration, backlog=backlog
            ),
            async_slots=0 if aio is None else aio.capacity,
            async_prefetch=0
            if aio is None
            else prefetch(
                aio.capacity, batch_size=batch, window=window, duration=self.pace.async_duration, backlog=backlog
            ),
        )

    def zombies(self) -> int:
        """Abandoned attempts still running in the process (threads, and coroutines of the loop)."""
        return self.threads.zombies + (0 if self.aio is None else int(self.aio.zombies))

    def _wanted(self, census: Census, capacity: Capacity) -> tuple[int, bool]:
        """How many to claim this round, and whether it is a probe for the kind not seen lately."""
        session = self.session
        if session.draining.is_set() or census.isolated:
            return 0, False  # an isolated attempt runs alone: claim nothing beside it
        if self.reservation.active and census.in_hand:
            return 0, False  # becoming idle for a task that must run isolated (tasks/worker/isolation.py)
        last_beat = self.heartbeat.last_beat
        if last_beat is not None and clock.monotonic() - last_beat > session.ttl / 2:
            return 0, False  # heartbeats are not getting through: claims would only lapse (invariant 6)
        now = clock.monotonic()
        sized = room(census, capacity, share=self.pace.async_share, probe_due=now >= self.pace.next_probe)
        if sized.probe:
            self.pace.next_probe = now + session.poll_interval
        wanted = min(self.batch_size, sized.claim)
        if self.max_tasks is not None:
            wanted = min(wanted, self.max_tasks - session.kept())
        return max(0, wanted), sized.probe

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> None:
        """Rounds until the worker has drained (or ``max_tasks`` attempts ended)."""
        session = self.session
        session.drain_deadline = None  # set when this run's drain begins (a Worker may run again)
        may_have_work = True  # false after a short claim, until a NOTIFY or the poll timeout
        while True:
            if self.mailbox.clear():
                may_have_work = True
            census = self.ledger.census(clock.monotonic())
            session.bind()
            self.reservation.tick(
                busy=census.in_hand > 0,
                holds_isolated=census.isolated > 0,
                can_serve=self.zombies() == 0,
                stopping=session.draining.is_set(),
            )
            self._abandon(census.overdue)
            self.slots.release_returned()
            # Given back unstarted by an executor (a lapsed claim, no free slot of its kind, the drain
            # begun): a fair queue's turns go back to where their claim began, drain or not. Rewound at
            # the drain only, a claim an executor returned mid-stream (its keys' turns already dealt)
            # was passed over: the next claims went on past its keys, for a lap.
            self._rewind_fair_cursor(self.handbacks.take_returns())
            for due in self.handbacks.take_refused():
                heapq.heappush(self._rate_wakes, due)
            while self._rate_wakes and self._rate_wakes[0] <= clock.monotonic():
                heapq.heappop(self._rate_wakes)
                may_have_work = True  # a claim its rate key refused comes due now
            self.handbacks.take_handbacks()
            deferred = self._due_deferred()
            if deferred:
                self._write_deferred(deferred)
            outcomes = self.mailbox.take_outcomes()
            starts = self._due_starts(outcomes)
            capacity = self.capacity()
            wanted, probing = self._wanted(census, capacity)
            hungry = probing or starving(census, capacity, share=self.pace.async_share)
            claim = wanted if may_have_work and wanted > 0 and (wanted >= self.batch_size or hungry) else 0
            to_hand = self.handoff.room(
                census, capacity, duration=self.pace.duration, async_duration=self.pace.async_duration
            )
            if outcomes or starts or claim or self.handoff.can_release(to_hand):
                claimed = self.round(outcomes, starts, claim, idle=census.in_hand == 0, to_hand=to_hand)
                if self.fair_cursor is not None:
                    self.fair_cursor.sync()  # where the turns went, once the claimed tasks are in hand
                if claim:
                    if claimed is not None and len(claimed) == claim:
                        continue  # there may be more; go round without waiting
                    # A failed claim is retried; a short one waits, unless it resumed: what lies
                    # behind its positions is looked for at once, from the start.
                    may_have_work = claimed is None or self._resumed_short
            if self.fair_cursor is not None:
                self.fair_cursor.sync()  # a move the last sync left (a write under a second before)
            if session.draining.is_set():
                if self.drain():
                    return
                continue
            if self.max_tasks is not None and session.kept() >= self.max_tasks:
                if not self.ledger.census(clock.monotonic()).in_hand:
                    return
                self.mailbox.wait(0.1)
                continue
            # Counted again: the round may have claimed attempts (unstarted, each with its timeout
            # to come); the counts read before it would sleep the whole poll past their deadlines.
            if not self.mailbox.wait(self._next_wait(self.ledger.census(clock.monotonic()))):
                may_have_work = True  # the fallback poll

    def drain(self) -> bool:
        """One step of the drain; True once nothing runs, the grace period is over, or the second
        stop signal came."""
        session = self.session
        if session.drain_deadline is None:
            session.drain_deadline = clock.monotonic() + session.shutdown_grace
            logger.info(
                "worker %s draining: %d attempt(s) held", session.id, len(self.ledger), extra={"worker_id": session.id}
            )
            self._rewind_fair_cursor(self.handbacks.unstarted(self.handoff.take_waiting()))
        running = self.ledger.census(clock.monotonic()).running
        if not running or session.hurry.is_set() or clock.monotonic() >= session.drain_deadline:
            return True
        self.mailbox.wait(min(0.1, max(0.0, session.drain_deadline - clock.monotonic())))
        return False

    def _due_starts(self, outcomes: list[Outcome]) -> list[tuple[Execution, float]]:
        """Start markers to send now: those older than MARKER_DELAY whose attempt has not ended
        (an ended attempt is marked by the statement that records its end)."""
        for execution, at in self.mailbox.take_starts():
            self._pending_starts[execution.key] = (execution, at, clock.monotonic() + MARKER_DELAY)
        for outcome in outcomes:
            self._pending_starts.pop(outcome.key, None)
        now = clock.monotonic()
        due = [key for key, (_e, _at, when) in self._pending_starts.items() if when <= now]
        return [self._pending_starts.pop(key)[:2] for key in due]

    def _write_deferred(self, deferred: list[Outcome]) -> None:
        """Outcomes whose write met a lock go in a round of their own (the round that claims never
        waits on them), with a short lock wait: while the lock is still held, the retry holds its own
        rows locked only that long, so the heartbeat, which renews those rows, is seldom kept from
        them (and never while it renews: ``Session.write_gate``), and the attempts keep their leases
        (``write_waits``)."""
        session = self.session
        with session.write_gate:  # the heartbeat waits for it rather than finding these rows busy
            usual = session.lock_timeout_ms
            session.lock_timeout_ms = DEFERRED_LOCK_WAIT_MS
            try:
                session.bind()
                self.round(deferred, [], 0)
            finally:
                session.lock_timeout_ms = usual
                session.bind()

    def _due_deferred(self) -> list[Outcome]:
        if not self._deferred:
            return []
        now = clock.monotonic()
        due = [o for at, o in self._deferred if at <= now]
        self._deferred = [(at, o) for at, o in self._deferred if at > now]
        return due

    def _next_wait(self, census: Census) -> float:
        if census.overdue:
            return 0.0  # an attempt ran past its timeout: abandoned by the next round, now
        wait = self.session.poll_interval
        now = clock.monotonic()
        for at, _o in self._deferred:
            wait = min(wait, max(0.0, at - now) + 0.001)
        if census.next_deadline is not None:
            wait = min(wait, max(0.0, census.next_deadline - now) + 0.001)
        for _e, _at, when in self._pending_starts.values():
            wait = min(wait, max(0.0, when - now) + 0.001)
        if self._rate_wakes:
            wait = min(wait, max(0.0, self._rate_wakes[0] - now) + 0.001)
        if census.unstarted or self.mailbox.has_starts():
            # An executor may start one at any moment, or has started one since this round took the
            # markers: its marker is put in before the ledger counts it running (Mailbox.started).
            wait = min(wait, MARKER_DELAY)
        return wait

    # -- one round ----------------------------------------------------------------------------------

    def round(
        self,
        outcomes: list[Outcome],
        starts: list[tuple[Execution, float]],
        claim: int,
        idle: bool = False,
        to_hand: dict[bool, int] | None = None,
    ) -> list[ClaimedTask] | None:
        """Write outcomes and start markers, claim ``claim`` more, hand the executors as many attempts
        as ``to_hand`` allows per kind (none at the end): one statement in the steady state. A pipeline:
        the failures written (``writer.fail``), the round's statement (:meth:`_write`, or
        :meth:`_reconcile` when it did not commit), the markers' answers, the outcomes whose row was
        locked put off, the results the database refused failed instead, every outcome settled, and
        the claimed attempts routed to the executors."""
        failures = [o for o in outcomes if not o.ok]
        successes = [o for o in outcomes if o.ok]
        ended = {o.key for o in outcomes}
        # An attempt that already ended is marked by the statement that records its end.
        starts = [(e, at) for e, at in starts if e.key not in ended]
        failed = self.writer.fail(failures) if failures else set()
        plan = Plan()
        if to_hand is not None:
            plan = self.handoff.plan(
                to_hand, claim=claim, async_share=self.pace.async_share, has_loop=self.aio is not None
            )
        sent = clock.monotonic()
        try:
            written = self._write(successes, starts, claim, plan, sent, idle=idle)
        except (*CONNECTION_ERRORS, DatabaseError) as exc:
            written = self._reconcile(exc, successes, starts, claim)
            self.handoff.not_sent(plan)
        self._mark_started(starts, written.marked)
        successes, failures = self._put_off_locked(successes, failures)
        if written.refused:
            for outcome in written.refused:
                outcome.failure = minimal_failure(outcome, "the database refused the result")
                outcome.value_json = None
            failed |= self.writer.fail(written.refused)
            failures += written.refused
            successes = [o for o in successes if o.ok]
        self._settle(successes, written.accepted, failures, failed)
        if written.committed and (written.claimed or plan.releasing):
            session = self.session
            tasks = written.claimed or []
            self._route(plan, tasks, [Execution(task, session.id, session.ttl, sent, session.using) for task in tasks])
        return written.claimed

    def _write(
        self, successes: list[Outcome], starts: list[tuple[Execution, float]], claim: int, plan: Plan, sent: float, *,
        idle: bool,
    ) -> _Written:  # fmt: skip
        """The round's one statement (FINISH_START_CLAIM_SQL): the results, the start markers, the
        claim and the names the hand-off puts on the worker's row; only results, the lighter finish."""
        session = self.session
        manager = session.tasks()
        results = [
            (o.execution.id, o.execution.token, o.value_json or "null", o.execution.started_epoch) for o in successes
        ]
        markers = [(e.id, e.token, at) for e, at in starts]
        session.bind()
        if not (markers or claim or plan.names is not None):
            return _Written(manager.complete_many(session.id, results) if results else set(), {}, [])
        resume = bool(claim) and self._resume and sent < self._scan_from_start_at
        # (a worker that goes round more keys than it keeps positions in would send them for nothing)
        send_keys = resume and self.fair_cursor is not None and self._fair_positions.revisits
        fair_after = self.fair_cursor.current() if claim and self.fair_cursor is not None else None
        accepted, marked, claimed = manager.finish_start_claim(
            session.id,
            results,
            markers,
            limit=claim,
            queues=self.queues,
            ttl=session.ttl,
            isolate_after=self.isolate_after,
            # a task to run isolated goes only to a worker holding nothing else
            take_isolated=idle and self.zombies() == 0,
            after=list(self._positions.values()) if resume else [],
            fair_after=fair_after,
            fair_positions=self._fair_positions if send_keys else (),
            handed=plan.names,
            release=plan.release,
            rated_queues=sorted(plan.rated_queues),
        )
        self.handoff.timed(clock.monotonic() - sent)
        if claim:
            if self.fair_cursor is not None:
                self.fair_cursor.advance(
                    fair_after_claim(claimed, fair_after),
                    claim=sent,
                    turns=[t.fair_key for t in claimed if t.fair_turn and t.fair_key is not None],
                )
            self._remember(claimed, sent, resumed=resume)
            self._resume = len(claimed) == claim
            self._resumed_short = resume and len(claimed) < claim
        return _Written(accepted, marked, claimed)

    def _reconcile(
        self, exc: Exception, successes: list[Outcome], starts: list[tuple[Execution, float]], claim: int
    ) -> _Written:
        """The one path of a round whose statement did not commit (nothing of it did): its results
        written again one by one, or, its connection lost, found out from the database (a commit may
        have landed before the reply was lost); its markers sent again; its claim, if any landed,
        given back. Nothing is claimed."""
        session = self.session
        writer = self.writer
        if isinstance(exc, CONNECTION_ERRORS) and not is_lock_wait(exc):
            writer.connection_lost("finish-start-claim", exc)
            accepted, refused = writer.reconcile(writer.completions, successes)
            marked = self._resend_markers(starts)
            if claim:
                writer.return_unknown_claims(lambda key: key in self.ledger)
            self.mailbox.wait(min(session.poll_interval, 0.5))
            return _Written(accepted, marked, None, refused, committed=False)
        if isinstance(exc, CONNECTION_ERRORS):
            # A row of ours is locked by another session: the connection is fine. The locked one
            # waits for a later round (the writer puts it off).
            logger.warning(
                "worker %s: what it is finishing waits for a lock another session holds (a row, or a workflow's"
                " settle while an operator's transaction requeues a member): %s",
                session.id,
                exc,
            )
        else:  # refused, not lost: something in it cannot be stored; written one by one, it is isolated
            logger.warning("worker %s: round refused by the database (%s); isolating", session.id, exc)
        accepted, refused = writer.complete(successes)
        return _Written(accepted, self._resend_markers(starts), None, refused, committed=False)

    def _mark_started(self, starts: list[tuple[Execution, float]], marked: dict[Key, Any]) -> None:
        """The start markers' answers: recorded (the attempt's number from its row), met a locked row
        (sent again a little later), or refused (the claim is no longer ours: the attempt is lost)."""
        for execution, at in starts:
            started = marked.get(execution.key)
            if started is None:
                self.handoff.refused([execution.key])
                if not execution.lost:
                    execution.mark_lost("its start could not be recorded: the claim is no longer ours")
            elif started is LOCKED:
                self._pending_starts[execution.key] = (execution, at, clock.monotonic() + 0.5)
            else:
                execution.attempt = started.attempt
                self.handoff.on_row([execution.key])

    def _put_off_locked(self, successes: list[Outcome], failures: list[Outcome]) -> tuple[list[Outcome], list[Outcome]]:
        """Outcomes whose write met a locked row wait for a round of their own (_write_deferred); the
        heartbeat keeps their leases until the write goes through (``write_waits``). Returns the rest."""
        deferred = self.writer.deferred
        if not deferred:
            return successes, failures
        self.writer.deferred = []
        keys = {o.key for o in deferred}
        retry_at = clock.monotonic() + 0.5
        for outcome in deferred:
            outcome.execution.write_waits = True
            self._deferred.append((retry_at, outcome))
        return [o for o in successes if o.key not in keys], [o for o in failures if o.key not in keys]

    def _remember(self, claimed: list[ClaimedTask], sent: float, *, resumed: bool) -> None:
        """Where this claim stopped in each level it took rows from. A scan from the start replaces
        every position (a level it found empty has none now) and sets when the next one is due."""
        if not resumed:
            self._positions = {}
            self._fair_positions.clear()
            self._scan_from_start_at = sent + RESCAN_INTERVAL
        self._positions.update(ClaimPosition.last_per_level(claimed))
        if self.fair_cursor is not None:
            self._fair_positions.remember(claimed)

    def _route(self, plan: Plan, claimed: list[ClaimedTask], executions: list[Execution]) -> None:
        """Claimed attempts to the threads or the event loop, once the round that names them
        committed (:mod:`tasks.worker.handoff`; the rest wait there, with what the last rounds could
        not hand over yet); what no slot of its kind will start within the prefetch window goes back
        at once, uncharged."""
        aio = self.aio
        for execution in executions:
            # Isolated attempts run on a thread, alone in the process.
            execution.is_async = aio is not None and not execution.task.isolate and self.resolve.is_async(execution)
        excess: list[Execution] = []
        if aio is not None:
            kinds = [e.is_async for e in executions]
            self.pace.observe_claim(kinds)
            keep = fit(kinds, self.ledger.census(clock.monotonic()), self.capacity())
            excess = [e for e, k in zip(executions, keep, strict=True) if not k]
            executions = [e for e, k in zip(executions, keep, strict=True) if k]
        self.ledger.add(executions + excess)  # before any executor can see them
        self.session.stats["claimed"] += len(executions) + len(excess)
        for execution in self.handoff.hand(plan, claimed, executions):
            if execution.is_async:
                assert aio is not None
                aio.submit(execution)
            else:
                self.mailbox.run(execution)
        for execution in excess:
            execution.mark_lost("handed back: no free slot of its kind (the mix of sync and async tasks changed)")
            self.mailbox.give_back(execution)

    def _resend_markers(self, starts: list[tuple[Execution, float]]) -> dict[Key, Any]:
        marked: dict[Key, Any] = {}
        session = self.session
        manager = session.tasks()
        for execution, _at in starts:
            # Idempotent: a marker that did land matches again and changes nothing.
            def mark(e: Execution = execution) -> Any:
                try:
                    return manager.start(e.id, session.id, e.token)
                except CONNECTION_ERRORS as exc:
                    if is_lock_wait(exc):
                        return LOCKED
                    raise

            started = retrying("recording a start", session, mark)
            if started is not None:
                marked[execution.key] = started
        return marked

    def _settle(self, successes: list[Outcome], accepted: set[Key], failures: list[Outcome], failed: set[Any]) -> None:
        ended = [o.key for o in successes] + [o.key for o in failures]
        refused = [key for key in ended if key not in accepted and key not in failed]
        if refused:  # its row may still wait for recovery, which must see its name
            self.handoff.refused(refused)
        self.handoff.on_row(ended)
        for outcome in successes:
            state = "succeeded" if outcome.key in accepted else None
            self._finish_log(outcome, state)
            self.signals.ended(outcome.execution, "SUCCESSFUL" if state else None, outcome)
            if outcome.execution.span is not None:
                ok = state is not None
                tracing.end_attempt(
                    outcome.execution, "success" if ok else "rejected", outcome, "SUCCESSFUL" if ok else None
                )
        for outcome in failures:
            result = self.writer.fail_results.pop(outcome.key, None)
            kind = outcome.failure.kind if outcome.failure is not None else "fail"
            if outcome.key not in failed:
                state = None
            elif kind == "snooze":
                state = "snoozed"
            elif kind == "cancel":
                state = "cancelled"
            elif result is not None and result.retried:
                state = "retried"
            else:
                state = "discarded" if isinstance(outcome.error, Discard) else "failed"
            self._finish_log(outcome, state, None if result is None else result.retry_in)
            stored = None if state is None else _STORED[state]
            self.signals.ended(outcome.execution, stored, outcome)
            if outcome.execution.span is not None:
                traced = "rejected" if state is None else tracing.OUTCOMES[state]
                tracing.end_attempt(outcome.execution, traced, outcome, None if result is None else result.status)
        self.ledger.remove(o.key for o in successes + failures)

    def _finish_log(self, outcome: Outcome, state: str | None, retry_in: float | None = None) -> None:
        execution = outcome.execution
        elapsed = clock.monotonic() - (execution.started or execution.claimed_at)
        task = execution.task
        stats = self.session.stats
        # Each record ends the attempt: it carries the attempt's fields and its outcome (tasks/worker/logs.py).
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
            failure = outcome.failure
            # The attempt's run time, then the retry's delay: until the run_after the fail statement set,
            # on the database clock (unknown when the outcome was found by reconciliation).
            retry = "" if state != "retried" else ", will retry" + ("" if retry_in is None else f" in {retry_in:.3f}s")
            log_attempt(
                logger,
                logging.WARNING,
                execution,
                "task %d %s %s in %.3fs (attempt %d)%s: %s: %s",
                task.id,
                task.task_path,
                _LOGGED.get(state, "FAILED for good"),
                elapsed,
                execution.attempt,
                retry,
                failure.exception_class_path if failure else "?",
                storable_text(failure.message, 500) if failure else "",
                outcome=state,
            )

    # -- timeouts -----------------------------------------------------------------------------------

    def _handler(self, execution: Execution) -> Any:
        """The attempt's handler (resolved before, so cached), or None."""
        try:
            return self.resolve(execution.task.task_path, api_origin=execution.task.api_origin)
        except Exception:
            return None

    def _abandon(self, overdue: list[Execution]) -> None:
        """Attempts past their timeout: stop heartbeating them, record the timeout now (so the late
        result is refused by the database), and give the executor slot to a new thread. A keyed
        attempt keeps its key's slot until its handler has returned (tasks/lifecycle/concurrency.py)."""
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
        session = self.session
        for execution in abandoned:
            self.gate.release(execution)  # a stuck handler must not keep anything else from running
            reason = reasons[execution.key]
            session.stats["timed_out"] += 1
            log_attempt(
                logger, logging.WARNING, execution, "task %d %s %s", execution.id, execution.task.task_path, reason
            )
            timed_out = TaskTimeout(f"task {execution.id} {reason}")
            # The retry policy applies (retry_on, max_attempts), but not a backoff function: user
            # code does not run on the dispatcher (the default backoff is used).
            failure = with_policy(
                failure_from(execution, timed_out), execution, timed_out, self._handler(execution), backoff=False
            )
            outcome = Outcome(execution, failure=failure, error=timed_out)
            self.mailbox.deliver(outcome, wake=False)
            if execution.is_async:
                # A coroutine is cancelled, not replaced: the loop goes on running the others. One
                # that ignores the cancellation is a zombie until it ends; one blocking the loop is
                # the watchdog's (tasks/worker/aio.py).
                assert self.aio is not None
                self.aio.zombies += 1
                self.aio.cancel(execution, "timeout", f"cancelled: {reason}")
                continue
            self.threads.abandoned(execution)  # the stuck thread retires when (if) its handler returns
            if self.threads.zombies > 2 * self.threads.concurrency and not session.draining.is_set():
                logger.error(
                    "worker %s: %d handlers stuck past their timeouts; stopping so that a supervisor"
                    " restarts a clean process",
                    session.id,
                    self.threads.zombies,
                )
                self.request_stop()

    # -- the end ------------------------------------------------------------------------------------

    def _rewind_fair_cursor(self, handed_back: list[Execution]) -> None:
        """Claims handed back without having started (at a stop, or returned by an executor at any
        time): a fair queue's turns go back to where the earliest of their claims began
        (SharedFairCursor.rewind), so the next claim (this worker's or the next worker's) serves
        those keys instead of passing over them."""
        if self.fair_cursor is not None:
            # A fill row (not its key's turn: the key had its turn in the same claim) loses no turn.
            self.fair_cursor.rewind(
                (e.claimed_at, e.task.fair_key)
                for e in handed_back
                if e.started is None and e.task.fair_turn and e.task.fair_key is not None
            )

    def close(self) -> None:
        """After the drain: write what has ended, and hand back everything still held."""
        self.reservation.release()
        self._abandon(self.ledger.census(clock.monotonic()).overdue)
        self.slots.release_returned()  # handlers still running keep theirs: recovery frees them once we stop
        self._rewind_fair_cursor(self.handbacks.take_returns())
        self.handbacks.take_refused()
        self.handbacks.take_handbacks()
        # Outcomes may still arrive while the last rounds are in flight: write until none is left.
        pending = [o for _at, o in self._deferred]  # rows that were locked get one more try
        self._deferred = []
        for _ in range(10):
            outcomes = self.mailbox.take_outcomes() + pending
            pending = []
            for execution, at in self.mailbox.take_starts():
                self._pending_starts[execution.key] = (execution, at, 0.0)
            ended = {o.key for o in outcomes}
            starts = [(e, at) for key, (e, at, _when) in self._pending_starts.items() if key not in ended]
            self._pending_starts.clear()
            if not outcomes and not starts:
                break
            self.round(outcomes, starts, 0)
        self._rewind_fair_cursor(self.handbacks.everything())
        if self.fair_cursor is not None:
            self.fair_cursor.flush()  # the next worker's turns go on from this one's last
