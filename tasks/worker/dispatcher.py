"""The dispatcher: the one thread that writes. Each round it counts what the worker holds, abandons
attempts past their timeout, gives back kept key slots and unusable claims, then sends one statement
that records the outcomes that arrived, marks the attempts that began, claims the next batch and
names on the worker's row what it hands to the executors (:mod:`tasks.lifecycle.statements`,
FINISH_START_CLAIM_SQL; :mod:`tasks.worker.handoff`), and routes the handed attempts to the threads or
the event loop. Between rounds it sleeps until the mailbox wakes it or a deadline is due.

At a stop it drains: claims nothing more, hands back what has not started, and waits for the running
attempts up to the grace period (:meth:`Dispatcher.drain`); :meth:`Dispatcher.close` then writes the
last outcomes and hands back everything still held.

One module: all of it runs on the dispatcher's one thread (the invariant that only it writes is read
here); what runs elsewhere or holds no round's state is apart (handoff, handbacks, writer, heartbeat)."""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError

from leasing import clock
from tasks.lifecycle.values import fair_after_claim
from tasks.models import ClaimedTask, SharedFairCursor
from tasks.runtime import Execution
from tasks.worker.endings import failure_state, tell_failure, tell_success
from tasks.worker.handbacks import HandBacks
from tasks.worker.handlers import HandlerCache
from tasks.worker.handoff import HandOff, Plan
from tasks.worker.heartbeat import Heartbeat
from tasks.worker.isolation import IsolationGate, IsolationReservation
from tasks.worker.ledger import Census, Ledger, Outcome
from tasks.worker.mailbox import Mailbox
from tasks.worker.positions import ClaimPositions
from tasks.worker.session import CONNECTION_ERRORS, Session, is_lock_wait, retrying
from tasks.worker.signals import FinishedSignals
from tasks.worker.sizing import Capacity, Pace, claim_cap, fit, prefetch, room, starving
from tasks.worker.slots import KeptSlots
from tasks.worker.threads import ThreadExecutors
from tasks.worker.timeouts import Timeouts
from tasks.worker.writer import OutcomeWriter, minimal_failure

if TYPE_CHECKING:
    from tasks.worker.aio import AsyncExecutor

logger = logging.getLogger("tasks.worker")

Key = tuple[int, int]

#: A start marker that met a locked row (its start is re-sent later, not lost).
LOCKED: Any = object()
#: A start marker waits this long for the attempt's own outcome, which then carries it (a short task
#: costs one row update, not two); longer attempts are marked by the next round after that.
MARKER_DELAY = 0.02
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
    async_batch_size: int | None = None  # the event loop's kind (sizing.claim_cap); None: ``batch_size``


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
        self.async_batch_size = settings.async_batch_size or settings.batch_size
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
        self.timeouts = Timeouts(
            session, mailbox, ledger, slots=parts.slots, gate=parts.gate, threads=parts.threads, aio=parts.aio,
            resolve=parts.resolve, request_stop=parts.request_stop,
        )  # fmt: skip
        self._pending_starts: dict[Key, tuple[Execution, float, float]] = {}
        self._deferred: list[tuple[float, Outcome]] = []  # outcomes whose row was locked: (retry at, outcome)
        # Where the next claim resumes (tasks/worker/positions.py).
        self.positions = ClaimPositions(self.batch_size)  # a fair claim's positions: the threads' batch
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
        window, batch, async_batch = self.prefetch_window, self.batch_size, self.async_batch_size
        backlog = self.positions.full
        return Capacity(
            slots=self.threads.concurrency,
            prefetch=prefetch(
                self.threads.concurrency, batch_size=batch, window=window, duration=self.pace.duration, backlog=backlog
            ),
            async_slots=0 if aio is None else aio.capacity,
            async_prefetch=0
            if aio is None
            else prefetch(
                aio.capacity, batch_size=async_batch, window=window, duration=self.pace.async_duration, backlog=backlog
            ),
        )

    def zombies(self) -> int:
        """Abandoned attempts still running in the process (threads, and coroutines of the loop)."""
        return self.threads.zombies + (0 if self.aio is None else int(self.aio.zombies))

    def _wanted(self, census: Census, capacity: Capacity, cap: int) -> tuple[int, bool]:
        """How many to claim this round (at most ``cap``), and whether it is a probe for the kind not seen lately."""
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
        wanted = min(cap, sized.claim)
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
            self.timeouts.abandon(census.overdue)
            self.slots.release_returned()
            if self._take_handbacks():
                may_have_work = True
            deferred = self._due_deferred()
            if deferred:
                self._write_deferred(deferred)
            outcomes = self.mailbox.take_outcomes()
            starts = self._due_starts(outcomes)
            capacity = self.capacity()
            cap = claim_cap(self.batch_size, self.async_batch_size, self.pace.async_share if self.aio else 0.0)
            wanted, probing = self._wanted(census, capacity, cap)
            hungry = probing or starving(census, capacity, share=self.pace.async_share)
            claim = wanted if may_have_work and wanted > 0 and (wanted >= cap or hungry) else 0
            to_hand = self.handoff.room(
                census, capacity, duration=self.pace.duration, async_duration=self.pace.async_duration
            )
            if outcomes or starts or claim or self.handoff.can_release(to_hand):
                claimed = self.round(
                    outcomes, starts, claim, idle=not census.in_hand, to_hand=to_hand, sized_by=capacity
                )
                if self.fair_cursor is not None:
                    self.fair_cursor.sync()  # where the turns went, once the claimed tasks are in hand
                if claim:
                    if claimed is not None and len(claimed) == claim:
                        continue  # there may be more; go round without waiting
                    # A failed claim is retried; a short one waits, unless it resumed: what lies
                    # behind its positions is looked for at once, from the start.
                    may_have_work = claimed is None or self.positions.resumed_short
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

    def _take_handbacks(self) -> bool:
        """What came back since the last round; True when a claim its rate key refused comes due now."""
        # Given back unstarted by an executor (a lapsed claim, no free slot of its kind, the drain
        # begun): a fair queue's turns go back to where their claim began, drain or not. Rewound at
        # the drain only, a claim an executor returned mid-stream (its keys' turns already dealt)
        # was passed over: the next claims went on past its keys, for a lap.
        self._rewind_fair_cursor(self.handbacks.take_returns())
        for due in self.handbacks.take_refused():
            heapq.heappush(self._rate_wakes, due)
        due_now = False
        while self._rate_wakes and self._rate_wakes[0] <= clock.monotonic():
            heapq.heappop(self._rate_wakes)
            due_now = True
        self.handbacks.take_handbacks()
        return due_now

    def drain(self) -> bool:
        """One step of the drain; True once nothing runs, the grace period is over, or the second
        stop signal came."""
        session = self.session
        if session.drain_deadline is None:
            session.drain_deadline = session.grace_deadline()
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
        sized_by: Capacity | None = None,
    ) -> list[ClaimedTask] | None:
        """Write outcomes and start markers, claim ``claim`` more, hand the executors as many attempts
        as ``to_hand`` allows per kind (none at the end): one statement in the steady state. A pipeline:
        the failures written (``writer.fail``), the round's statement (:meth:`_write`, or
        :meth:`_reconcile` when it did not commit), the markers' answers, the outcomes whose row was
        locked put off, the results the database refused failed instead, every outcome settled, and
        the claimed attempts routed to the executors (kept as far as ``sized_by``, the claim's, allows)."""
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
            executions = [Execution(task, session.id, session.ttl, sent, session.using) for task in tasks]
            self._route(plan, tasks, executions, sized_by or self.capacity())
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
        positions = self.positions
        resume = bool(claim) and positions.resumes(sent)
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
            after=positions.after(resume),
            fair_after=fair_after,
            fair_positions=positions.fair_after(resume, fair=self.fair_cursor is not None),
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
            positions.claimed(claimed, claim, sent, resumed=resume, fair=self.fair_cursor is not None)
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

    def _route(self, plan: Plan, claimed: list[ClaimedTask], executions: list[Execution], capacity: Capacity) -> None:
        """Claimed attempts to the threads or the event loop, once the round that names them
        committed (:mod:`tasks.worker.handoff`; the rest wait there, with what the last rounds could
        not hand over yet); what no slot of its kind will start within the prefetch window goes back
        at once, uncharged. By ``capacity``, the claim's: a short claim ends the backlog's second batch
        of prefetch, so measured anew here part of it went back, to be claimed again (benchmarks.md)."""
        aio = self.aio
        for execution in executions:
            # Isolated attempts run on a thread, alone in the process.
            execution.is_async = aio is not None and not execution.task.isolate and self.resolve.is_async(execution)
        excess: list[Execution] = []
        if aio is not None:
            kinds = [e.is_async for e in executions]
            self.pace.observe_claim(kinds)
            keep = fit(kinds, self.ledger.census(clock.monotonic()), capacity)
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
        stats, signals = self.session.stats, self.signals
        for outcome in successes:
            tell_success(outcome, outcome.key in accepted, stats, signals)
        for outcome in failures:
            result = self.writer.fail_results.pop(outcome.key, None)
            retried = result is not None and result.retried
            tell_failure(outcome, failure_state(outcome, outcome.key in failed, retried), result, stats, signals)
        self.ledger.remove(o.key for o in successes + failures)

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
        self.timeouts.abandon(self.ledger.census(clock.monotonic()).overdue)
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
