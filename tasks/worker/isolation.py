"""Isolated attempts: the in-process gate that lets one run alone (:class:`IsolationGate`), and the
reservation by which a busy worker makes itself idle for one waiting in its queues
(:class:`IsolationReservation`).

A task whose workers vanished beside other attempts ISOLATE_AFTER times runs alone in its process, so
that a next crash is attributable (tasks/lifecycle/recover.py, RECOVER_EXPIRED_SQL). Only a worker holding nothing
takes it; a busy worker's claims pass over it. Under a steady stream no worker is ever idle, so the
task (and, behind it, its concurrency key) would wait until the whole backlog drained.

So a busy worker looks for such a task in its queues, at most once per poll interval (one index probe
of a tiny partial index: ISOLATED_WAITING_SQL). If it finds one, it takes the queue's isolation lease
(``tasks:isolation:<queue>``, a lease of the leasing app, so one worker per queue reserves, not all of
them) and stops claiming until it holds nothing; its next claim, an idle one, may take the task. It
renews the lease at each look while the task waits and releases it once the task is in hand, taken by
another worker, or gone.

A reservation has a term (the worker's TTL, at least two looks): a worker whose attempts outlast it
(a long report without a timeout) hands the turn over and does not reserve again for a while (the
term, doubling with each turn it could not serve, up to 8 terms), so the next busy worker tries, and
no worker idles for long behind an attempt that will not end. A reserving worker that dies frees the
lease within its TTL. So the task waits for the first busy worker whose attempts end within a term;
if every worker runs an attempt that never ends, nothing can run it alone until one does (an attempt
is never preempted).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import DatabaseError, connections

from leasing import clock
from leasing.models import Lease
from tasks.lifecycle.statements import ISOLATED_WAITING_SQL
from tasks.runtime import Execution

logger = logging.getLogger("tasks.worker")

RESOURCE = "tasks:isolation:{queue}"
#: Cool-down after turns a worker could not serve: the term times 2**(misses - 1), at most this many terms.
MAX_COOLDOWN_TERMS = 8


class IsolationReservation:
    def __init__(
        self, *, using: str, worker_id: str, queues: list[str], isolate_after: int, ttl: float, interval: float
    ) -> None:
        self.using = using
        self.worker_id = worker_id
        self.queues = queues
        self.isolate_after = isolate_after
        self.ttl = ttl
        self.interval = interval
        self._next_look = 0.0
        self._held: tuple[str, int] | None = None  # (resource, token) of the lease while reserving
        self.term = max(ttl, 2 * interval)
        self._reserved_at = 0.0
        self._misses = 0  # turns in a row this worker could not serve
        self._not_before = 0.0  # no new reservation before this (after a turn it could not serve)

    @property
    def active(self) -> bool:
        """Reserving: claim nothing until the worker holds nothing."""
        return self._held is not None

    def tick(self, *, busy: bool, holds_isolated: bool, can_serve: bool, stopping: bool) -> None:
        """Called by the dispatcher each round; looks at most once per interval.

        ``busy``: attempts in hand (an idle worker's claim takes any task: nothing to do).
        ``holds_isolated``: an isolated attempt is in hand (the reservation has served).
        ``can_serve``: no abandoned handler is still running in the process (an isolated attempt needs
        the process to itself: a worker with one cannot take it and must not reserve).
        """
        if stopping or not can_serve:
            self.release()
            return
        if self.isolate_after < 1 or (not busy and self._held is None):
            return
        now = clock.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + self.interval
        try:
            waiting = self._waiting_queue()
            if self._held is not None:
                if waiting is None or holds_isolated:
                    self._misses = 0
                    self.release()
                elif now - self._reserved_at > self.term:
                    # Its attempts outlast the term: the turn goes to another busy worker.
                    self._misses += 1
                    self._not_before = now + self.term * min(2 ** (self._misses - 1), MAX_COOLDOWN_TERMS)
                    logger.info(
                        "worker %s: not idle within %gs for the isolated task; handing the turn over",
                        self.worker_id,
                        self.term,
                    )
                    self.release()
                else:
                    resource, token = self._held
                    if Lease.objects.db_manager(self.using).renew(resource, self.worker_id, token, self.ttl) is None:
                        self._held = None  # lapsed: another busy worker may reserve now
            elif waiting is not None and not holds_isolated and now >= self._not_before:
                resource = RESOURCE.format(queue=waiting)
                grant = Lease.objects.db_manager(self.using).acquire(resource, self.worker_id, self.ttl)
                if grant is not None:
                    self._held = (resource, grant.token)
                    self._reserved_at = now
                    logger.info(
                        "worker %s: a task in queue %s must run isolated; claiming nothing until idle",
                        self.worker_id,
                        waiting,
                    )
        except DatabaseError as exc:
            # The next look tries again; a lease we could not renew lapses by itself.
            logger.warning("worker %s: the look for isolated tasks failed: %s", self.worker_id, exc)

    def release(self) -> None:
        if self._held is None:
            return
        resource, token = self._held
        self._held = None
        try:
            Lease.objects.db_manager(self.using).release(resource, self.worker_id, token)
        except DatabaseError as exc:
            logger.warning("worker %s: releasing %s failed (it lapses by itself): %s", self.worker_id, resource, exc)

    def _waiting_queue(self) -> str | None:
        with connections[self.using].cursor() as cursor:
            cursor.execute(ISOLATED_WAITING_SQL, {"isolate_after": self.isolate_after, "queues": self.queues})
            row = cursor.fetchone()
        return None if row is None else str(row[0])


class IsolationGate:
    """Normal attempts share the process; an isolated attempt runs alone in it.

    A readers-writer gate with the writer preferred: once an isolated attempt waits, no new attempt
    starts until it has run, so it waits at most for the attempts already running. Each attempt
    holds its slot (``execution.gate_slot``) until :meth:`release`, which is idempotent: an attempt
    abandoned past its timeout gives its slot up at once (a stuck handler must not keep the process
    from running anything else), and its thread's later release is then a no-op. With no isolated
    attempt around (the normal case) entering and leaving cost one uncontended lock each.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())  # a plain lock: cheaper than the default RLock
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # isolated attempts waiting for the process to be theirs
        self._blocked = 0  # normal attempts waiting for an isolated one to be done

    def enter_shared(self, execution: Execution, stop: threading.Event) -> bool:
        with self._cond:
            if self._exclusive or self._waiting:
                self._blocked += 1
                try:
                    while self._exclusive or self._waiting:
                        if stop.is_set():
                            return False
                        self._cond.wait(0.1)
                finally:
                    self._blocked -= 1
            self._shared += 1
            execution.gate_slot = "shared"
            return True

    def try_enter_shared(self, execution: Execution) -> bool:
        """:meth:`enter_shared` without waiting (the event loop must not block): False while an
        isolated attempt runs or waits, and the coroutine then retries a little later."""
        with self._cond:
            if self._exclusive or self._waiting:
                return False
            self._shared += 1
            execution.gate_slot = "shared"
            return True

    def enter_exclusive(self, execution: Execution, deadline: float, now: Callable[[], float]) -> bool:
        """Wait until nothing else runs; False when ``deadline`` (on ``now``'s clock) passes first."""
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    remaining = deadline - now()
                    if remaining <= 0:
                        return False
                    self._cond.wait(min(remaining, 0.1))
                self._exclusive = True
                execution.gate_slot = "exclusive"
                return True
            finally:
                self._waiting -= 1
                if self._blocked:
                    self._cond.notify_all()

    def release(self, execution: Execution) -> None:
        with self._cond:
            if execution.gate_slot == "shared":
                self._shared -= 1
            elif execution.gate_slot == "exclusive":
                self._exclusive = False
            else:
                return
            execution.gate_slot = None
            if self._waiting or self._blocked:
                self._cond.notify_all()
