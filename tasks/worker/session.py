"""What every part of one worker shares: who it is, which database it writes, its counters, its stop
flags, and how its own statements are bounded and retried.

A part is built from a :class:`Session`, a :class:`~tasks.worker.mailbox.Mailbox` and the
:class:`~tasks.worker.ledger.Ledger`, never from the :class:`~tasks.worker.process.Worker`: the
session is the one place that knows the worker's id and database."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django.db import DatabaseError, InterfaceError, OperationalError, connections
from psycopg import errors as psycopg_errors

from leasing import clock
from leasing.bounds import bound
from tasks.lifecycle.ratelimits import queue_rate
from tasks.models import ClaimedTask, RateRefused, Started, Task

logger = logging.getLogger("tasks.worker")
T = TypeVar("T")

CONNECTION_ERRORS = (OperationalError, InterfaceError)

#: The worker's counters, in the order its row and /metrics show them.
STAT_NAMES = (
    "claimed",
    "started",
    "succeeded",
    "retried",
    "failed",
    "snoozed",
    "discarded",
    "cancelled",
    "rejected",
    "lost",
    "timed_out",
    "late_results_dropped",
    "claims_returned",
    "rate_refused",
    "reconciled",
    "connection_errors",
    "heartbeats",
    "heartbeat_failures",
    "heartbeat_busy",
    "zombies",
)


def bound_connection(using: str, *, lock_ms: int, statement_ms: int) -> None:
    """Bound the statements of this thread's connection for the worker's own work: per transaction,
    never as session state a connection pooler would hand to someone else (leasing/bounds.py)."""
    bound(connections[using], statement_ms=statement_ms, lock_ms=lock_ms)


@dataclass(eq=False)
class Session:
    id: str
    name: str
    using: str
    ttl: float
    shutdown_grace: float
    poll_interval: float
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAT_NAMES, 0))
    #: First stop signal: claim nothing more, let running attempts finish within the grace period.
    draining: threading.Event = field(default_factory=threading.Event)
    #: Second stop signal: wait for nothing (running attempts, retries).
    hurry: threading.Event = field(default_factory=threading.Event)
    #: Held by the heartbeat while it renews, and by the dispatcher while it retries writes that met a
    #: lock: a retry holds its rows locked while it waits, and a beat then would find them busy and
    #: leave those attempts unrenewed (their leases lapsing while the write waits). The heartbeat
    #: waits for it at most TTL/6, then beats anyway.
    write_gate: threading.Lock = field(default_factory=threading.Lock)
    #: Local clock time the drain gives up waiting for running attempts (set when it begins).
    drain_deadline: float | None = None
    #: Local clock time of the first stop request: the grace counts from it, wherever the dispatcher
    #: is then (a retry loop of its own included: the drain begins only after it).
    stop_requested_at: float | None = None
    #: Threads whose statements are the worker's own (dispatcher, heartbeat): bounded by :meth:`bind`.
    own_threads: set[int] = field(default_factory=set)
    #: Claims handed back before they ran (refused by their rate key, returned by an executor): not
    #: counted against ``--max-tasks``. A count of its own, so that ``stats["claimed"]`` (a counter
    #: on /metrics) only ever grows.
    handed_back: int = 0

    def __post_init__(self) -> None:
        # The worker's own statements never wait long on a row lock or a slow server: another session
        # locking a task row (or a hung statement) must not wedge the dispatcher or the heartbeat.
        # Handler code runs on other connections and is not bounded.
        self.lock_timeout_ms = int(max(100, min(2000, self.ttl * 1000 / 6)))
        self.statement_timeout_ms = int(max(1000, self.ttl * 1000 / 3))

    def kept(self) -> int:
        """Claims this worker kept (claimed and not handed back): what ``--max-tasks`` counts."""
        return self.stats["claimed"] - self.handed_back

    def own_thread(self) -> None:
        """The calling thread sends the worker's own statements from now on."""
        self.own_threads.add(threading.get_ident())

    def bind(self) -> None:
        """Bound the statement and lock waits of the worker's own threads (dispatcher, heartbeat);
        never an executor's connection, which task code uses."""
        if threading.get_ident() in self.own_threads:
            bound_connection(self.using, lock_ms=self.lock_timeout_ms, statement_ms=self.statement_timeout_ms)

    def tasks(self) -> Any:
        """The task operations on the worker's database (tasks.models.task.TaskQuerySet)."""
        return Task.objects.db_manager(self.using)

    def request_drain(self) -> None:
        """The first stop request: claim nothing more, and let what runs finish within the grace
        period, counted from now."""
        if self.stop_requested_at is None:
            self.stop_requested_at = clock.monotonic()
        self.draining.set()

    def grace_deadline(self) -> float:
        """When the drain stops waiting for running attempts: the grace period after the stop request."""
        since = clock.monotonic() if self.stop_requested_at is None else self.stop_requested_at
        return since + self.shutdown_grace

    def retry_deadline(self) -> float:
        """How long a retry loop may go on: one TTL, and once a stop was requested never past the
        grace period, whether the drain has begun or not (the dispatcher's own retries come before it)."""
        deadline = clock.monotonic() + self.ttl
        if self.draining.is_set():
            deadline = min(deadline, self.grace_deadline() + 1.0)
        return deadline

    def out_of_retries(self, give_up_at: float) -> bool:
        """A retry loop that began at :meth:`retry_deadline` ends: a second stop, its own bound, or a
        stop requested while it ran (its bound was one TTL then: a loop that kept it would outlive
        the drain, and the process its leases)."""
        return self.hurry.is_set() or clock.monotonic() > min(give_up_at, self.retry_deadline())

    def close_connection(self) -> None:
        try:
            connections[self.using].close()
        except Exception:
            logger.debug("closing the broken connection failed", exc_info=True)


def is_lock_wait(exc: BaseException) -> bool:
    """A lock_timeout or statement_timeout cut the statement short: nothing committed, the
    connection is usable, and retrying the same rows right away would wait again."""
    cause = exc.__cause__
    return isinstance(cause, (psycopg_errors.LockNotAvailable, psycopg_errors.QueryCanceled))


def is_connection_failure(exc: BaseException) -> bool:
    """The connection failed (reset, terminated, timed out): what ``connection_errors`` counts. A
    deadlock's victim or a serialization failure is an OperationalError too, but its transaction was
    rolled back on a working connection (worth retrying, not a connection error); so is a lock wait."""
    rolled_back = (getattr(exc.__cause__, "sqlstate", None) or "").startswith("40")  # class 40: transaction rollback
    return isinstance(exc, CONNECTION_ERRORS) and not is_lock_wait(exc) and not rolled_back


def retrying(what: str, session: Session, statement: Callable[[], T]) -> T | None:
    """Run a statement that is safe to repeat until it succeeds, for at most one TTL (less when the
    worker is shutting down: a stop request must not wait out a database outage)."""
    give_up_at = session.retry_deadline()
    while True:
        try:
            session.bind()
            return statement()
        except DatabaseError as exc:
            logger.warning("worker %s: %s failed: %s", session.id, what, exc)
            if is_connection_failure(exc):
                session.stats["connection_errors"] += 1  # every path that meets a cut counts it
            session.close_connection()
            if (
                session.out_of_retries(give_up_at)
                or not isinstance(exc, CONNECTION_ERRORS)
                or is_lock_wait(exc)  # the row stays locked for now: retrying at once would only wait again
            ):
                return None
            session.hurry.wait(0.2)


def rate_limited(task: ClaimedTask) -> bool:
    """The attempt starts only once its rate key grants it: a key of its own, or its queue's
    (LEASING_TASKS["RATE_LIMITS"]; tasks/lifecycle/ratelimits.py)."""
    return task.rate_key is not None or queue_rate(task.queue) is not None


def take_start(session: Session, execution: Any, *, rated: bool, isolated: bool) -> Started | RateRefused | None:
    """The start marker an executor sends before the handler runs: a suspect's (START_SQL) or a
    rate-limited attempt's (RATE_START_SQL: granted, or refused and handed back). None: not ours."""
    tasks = session.tasks()
    if rated:
        return tasks.rate_start(
            execution.id, session.id, execution.token, isolated=isolated, queue=execution.task.queue
        )
    return tasks.start(execution.id, session.id, execution.token, isolated=isolated)
