"""Hold a lease for the duration of a block: acquire with backoff, renew in the background, release.

Why one module of ~550 lines: the sync and async holders share the renewal, loss detection and
release rules; they are written side by side so that each rule is visibly the same in both.

    with lease("reports:daily", ttl=30, timeout=5) as held:
        for row in rows:
            held.check()                       # raises LeaseLost once the lease is gone
            write(row, fence=held.token)

    async with lease("reports:daily") as held:
        ...

Loss is detected two ways. The heartbeat thread's renewal can be rejected (the lease expired,
was revoked, or was taken over), or the holder's own monotonic deadline (time the last successful
acquire/renew statement was *sent* + ttl) can pass without a renewal: the process was paused, the
database was unreachable. The local deadline only ever makes a holder give up *earlier* than the
database would; the database clock alone decides when somebody else may take over.

The local deadline is enforced by a process-wide watchdog thread, not by the heartbeat: a renewal
can hang (a frozen network, a server that stopped answering) and the thread that sent it with it,
yet ``on_lost`` and ``lease_lost`` must still arrive by the deadline. The heartbeat bounds its own
statements too (``statement_timeout``/``lock_timeout``), so that a renewal queued behind somebody's
row lock fails and is retried instead of waiting past the deadline.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import heapq
import itertools
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.db import Error, connections

from leasing import clock, metrics, signals
from leasing.bounds import bound
from leasing.conf import get_settings
from leasing.exceptions import LeaseAcquisitionError, LeaseLost
from leasing.models import Grant, Lease, acquire_on, acquire_slot_on, release_on, renew_on, seconds
from leasing.routing import lease_database

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    # typing.Self is 3.11+; annotations are not evaluated at run time (__future__), so no run-time dependency.
    from typing_extensions import Self

logger = logging.getLogger("leasing")

DEADLINE_PASSED = "the local deadline passed without a successful renewal"

#: The shortest statement_timeout/lock_timeout a renewal gets: below this, a healthy but busy
#: server would time renewals out for no reason.
MIN_STATEMENT_TIMEOUT = 0.05

#: The watchdog's longest sleep between looks at the clock (see DeadlineWatchdog._next_due).
WATCHDOG_MAX_SLEEP = 1.0


def default_holder_id() -> str:
    """host:pid:random suffix, unique per holder so two threads of one process are two holders."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def backoff_delay(attempt: int, initial: float, maximum: float) -> float:
    """Capped exponential backoff with "equal jitter": between half and all of the capped step."""
    step = min(maximum, initial * (2**attempt))
    return step / 2 + random.uniform(0, step / 2)


class DeadlineWatchdog:
    """One daemon thread that declares holders lost when their local deadline passes.

    Holders ``watch`` (register or move) and ``cancel`` their deadline. The thread sleeps on a
    Condition until the earliest deadline in a heap; a holder's superseded entries stay in the heap
    and are skipped when they come up (each renewal adds one, about three per TTL). The thread
    never runs user code: ``on_lost`` and the ``lease_lost`` receivers run in a thread of their own
    per loss, so one that blocks (a receiver writing to an unreachable database) cannot delay the
    loss of every other lease in the process.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._condition = threading.Condition()
        self._heap: list[tuple[float, int, LeaseHolder]] = []
        self._current: dict[LeaseHolder, int] = {}  # holder -> sequence number of its live entry
        self._sequence = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, holder: LeaseHolder, deadline: float) -> None:
        with self._condition:
            entry = next(self._sequence)
            self._current[holder] = entry
            heapq.heappush(self._heap, (deadline, entry, holder))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lease-deadline-watchdog", daemon=True)
                self._thread.start()
            if self._heap[0][1] == entry:  # a new earliest deadline: the thread sleeps too long
                self._condition.notify()

    def cancel(self, holder: LeaseHolder) -> None:
        with self._condition:
            if self._current.pop(holder, None) is None:
                return
            # Cancelled holders' entries would otherwise stay (with the holder) until their deadline.
            if len(self._heap) > 64 and len(self._heap) > 4 * len(self._current):
                self._heap = [item for item in self._heap if self._current.get(item[2]) == item[1]]
                heapq.heapify(self._heap)

    def watched(self) -> int:
        with self._condition:
            return len(self._current)

    def _next_due(self) -> LeaseHolder:
        with self._condition:
            while True:
                heap = self._heap
                while heap and self._current.get(heap[0][2]) != heap[0][1]:
                    heapq.heappop(heap)  # superseded or cancelled
                if not heap:
                    self._condition.wait()
                    continue
                deadline, _, holder = heap[0]
                remaining = deadline - clock.monotonic()
                if remaining <= 0:
                    heapq.heappop(heap)
                    del self._current[holder]
                    return holder
                # Condition.wait times out on CLOCK_MONOTONIC, which stands still while the
                # machine is suspended; deadlines are on CLOCK_BOOTTIME, which does not. Short
                # slices bound how late a loss is announced after a resume.
                self._condition.wait(min(remaining, WATCHDOG_MAX_SLEEP))

    def _run(self) -> None:
        while True:
            holder = self._next_due()
            try:
                holder._deadline_passed()
            except Exception:  # the watchdog must outlive any one holder
                logger.exception("lease watchdog: declaring %r lost failed", holder)


_watchdog = DeadlineWatchdog()
# A forked child has no watchdog thread, and the parent may have held the lock while forking.
# (Windows has no fork, nor os.register_at_fork: importing the package there must not fail.)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_watchdog._reset)


def bound_statements(connection: BaseDatabaseWrapper, timeout: float) -> float:
    """Make every later statement on ``connection`` fail after ``timeout`` seconds, or after
    waiting that long for a lock, instead of hanging; returns ``timeout``.

    Set per transaction, in the statement's own round trip (leasing/bounds.py): a pooled server
    connection keeps nothing of it.
    """
    milliseconds = max(1, round(timeout * 1000))
    bound(connection, statement_ms=milliseconds, lock_ms=milliseconds)
    return timeout


class LeaseHolder:
    """Holds one lease; use it through :func:`lease` as a sync or async context manager."""

    def __init__(
        self,
        resource: str,
        *,
        ttl: float | dt.timedelta | None = None,
        timeout: float | None = None,
        holder: str | None = None,
        on_lost: Callable[[LeaseHolder], Any] | None = None,
        renew_interval: float | None = None,
        metadata: dict[str, Any] | None = None,
        using: str | None = None,
        limit: int | None = None,
    ) -> None:
        conf = get_settings()
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be a whole number of slots, at least 1; got {limit!r}")
        self.resource = resource
        self.limit = limit
        self.ttl = seconds(conf.DEFAULT_TTL if ttl is None else ttl)
        self.timeout = conf.ACQUIRE_TIMEOUT if timeout is None else float(timeout)
        if self.timeout < 0:
            raise ValueError("timeout must be >= 0")
        self.holder = holder or default_holder_id()
        self.renew_interval = self.ttl * conf.RENEW_FRACTION if renew_interval is None else float(renew_interval)
        if not 0 < self.renew_interval < self.ttl:
            raise ValueError("renew_interval must be positive and shorter than the ttl")
        self.on_lost = on_lost
        self.metadata = metadata
        # The lease's database: given, or the one its namespace is routed to (leasing/routing.py).
        self.using = using or lease_database(resource)
        self._jitter = conf.RENEW_JITTER
        self._backoff = (conf.BACKOFF_INITIAL, conf.BACKOFF_MAX)
        self._grant: Grant | None = None
        self._deadline = 0.0  # clock.monotonic() time after which we no longer trust that we hold the lease
        self._lost = threading.Event()
        self._lost_reason: str | None = None
        self._rejected = False  # the database told us it is gone: no release needed
        self._state_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the body sees ------------------------------------------------------------------

    @property
    def grant(self) -> Grant:
        if self._grant is None:
            raise LeaseLost(f"lease {self.resource!r} is not held")
        return self._grant

    @property
    def token(self) -> int:
        """The fencing token of this grant: pass it to the storage you write to."""
        return self.grant.token

    @property
    def expires_at(self) -> dt.datetime:
        """Expiry of the last successful acquire/renew, on the database clock."""
        return self.grant.expires_at

    @property
    def lost(self) -> bool:
        """True once the lease is gone, or may be gone: never true again after becoming false."""
        if self._lost.is_set():
            return True
        # After release() the deadline means nothing: a lease handed back cleanly is not lost.
        if self._grant is not None and not self._stop.is_set() and clock.monotonic() >= self._deadline:
            self._mark_lost(DEADLINE_PASSED)
            return True
        return False

    @property
    def lost_reason(self) -> str | None:
        return self._lost_reason

    def check(self) -> None:
        """Raise :class:`LeaseLost` if the lease is gone; call it before each unit of work."""
        if self.lost:
            raise LeaseLost(
                f"lease {self.resource!r} (token {self._grant and self._grant.token}) lost: {self._lost_reason}"
            )

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds, waking as soon as the lease is lost; return ``lost``."""
        end = None if timeout is None else clock.monotonic() + timeout
        while not self.lost:
            now = clock.monotonic()
            slice_end = self._deadline if end is None else min(end, self._deadline)
            if end is not None and now >= end:
                return False
            self._lost.wait(max(0.0, slice_end - now) + 0.001)
        return True

    # -- acquire / release -------------------------------------------------------------------

    @contextmanager
    def _statement_connection(self) -> Iterator[BaseDatabaseWrapper]:
        connection = connections[self.using]
        if not connection.in_atomic_block:
            yield connection
            return
        # Inside the caller's transaction the lease row would stay invisible (and locked) until the
        # caller commits, and vanish on rollback: use a connection of our own instead.
        dedicated = connections.create_connection(self.using)
        try:
            yield dedicated
        finally:
            dedicated.close()

    def try_acquire(self) -> bool:
        """One acquire statement; True when the lease is now ours."""
        with self._statement_connection() as connection:
            sent = clock.monotonic()
            if self.limit is None:
                grant = acquire_on(connection, self.resource, self.holder, self.ttl, self.metadata)
            else:  # one of ``limit`` slots; the grant names the slot's own lease row
                grant = acquire_slot_on(connection, self.resource, self.holder, self.ttl, self.limit, self.metadata)
        if grant is None:
            return False
        with self._state_lock:
            self._grant, self._deadline = grant, sent + self.ttl
            if not self._lost.is_set():
                _watchdog.watch(self, self._deadline)
        return True

    def _next_backoff(self, attempt: int, give_up_at: float) -> float | None:
        remaining = give_up_at - clock.monotonic()
        if remaining <= 0:
            return None
        return min(remaining, backoff_delay(attempt, *self._backoff))

    def _acquisition_error(self) -> LeaseAcquisitionError:
        if self.limit is not None:
            return LeaseAcquisitionError(
                f"all {self.limit} slots of {self.resource!r} are held by others (waited {self.timeout:g}s)"
            )
        return LeaseAcquisitionError(f"lease {self.resource!r} is held by another holder (waited {self.timeout:g}s)")

    def acquire(self) -> Self:
        give_up_at = clock.monotonic() + self.timeout
        attempt = 0
        with metrics.acquisition_timer():
            while not self.try_acquire():
                delay = self._next_backoff(attempt, give_up_at)
                if delay is None:
                    raise self._acquisition_error()
                time.sleep(delay)
                attempt += 1
        self._start_heartbeat()
        return self

    async def aacquire(self) -> Self:
        give_up_at = clock.monotonic() + self.timeout
        attempt = 0
        try_acquire = sync_to_async(self.try_acquire)
        while not await try_acquire():
            delay = self._next_backoff(attempt, give_up_at)
            if delay is None:
                raise self._acquisition_error()
            await asyncio.sleep(delay)
            attempt += 1
        self._start_heartbeat()
        return self

    def release(self) -> bool:
        """Stop renewing and release; True if the lease was still ours when released.

        Bounded in time even when the database stopped answering: after a loss it waits at most
        ``renew_interval`` for the heartbeat thread and ``ttl`` for the release statement.
        """
        self._stop.set()
        # The body is done: a deadline passing from now on is nobody's loss to announce.
        _watchdog.cancel(self)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # A renewal in flight finishes first, so that it cannot land after the release. After
            # a loss the renewal's own statement timeout has passed: one still running hangs on a
            # connection that stopped answering, and waiting for it helps nobody.
            thread.join(timeout=self.renew_interval if self._lost.is_set() else self.ttl)
        grant = self._grant
        if grant is None or self._rejected:
            return False
        if self._lost.is_set() or clock.monotonic() >= self._deadline:
            return self._release_after_loss(grant)
        with self._statement_connection() as connection:
            released = release_on(connection, grant.resource, grant.holder, grant.token) is not None
        if not released and not self._lost.is_set():
            self._mark_lost("the lease was gone at release")
        return released

    def _release_after_loss(self, grant: Grant) -> bool:
        """Release a lease we gave up on, if the database still has it, without waiting long.

        The lease may well still be live in the database (only our local deadline passed), and
        releasing it lets a successor in before the TTL runs out. But whatever stalled the
        renewals may stall this statement too (a frozen network, a row lock), so it runs on a
        connection of its own with bounded statements, in a thread waited for at most a TTL.
        """
        released = threading.Event()

        def release_bounded() -> None:
            connection = connections.create_connection(self.using)
            try:
                bound_statements(connection, self._statement_timeout(self.renew_interval))
                if release_on(connection, grant.resource, grant.holder, grant.token) is not None:
                    released.set()
            except Error as exc:
                logger.warning("releasing lost lease %r failed: %s", self.resource, exc)
            finally:
                connection.close()
                connections.close_all()  # lease_released receivers may have used this thread's

        thread = threading.Thread(target=release_bounded, name=f"lease-release:{self.resource}", daemon=True)
        thread.start()
        thread.join(timeout=self.ttl)
        return released.is_set()

    # -- heartbeat ---------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-heartbeat:{self.resource}", daemon=True)
        self._thread.start()

    def _next_renewal_delay(self) -> float:
        return self.renew_interval * random.uniform(1 - self._jitter, 1 + self._jitter)

    def _statement_timeout(self, remaining: float) -> float:
        """How long one heartbeat statement may take: at most a renew interval, and no longer
        than is left until the local deadline (past it the watchdog has given the lease up)."""
        return max(MIN_STATEMENT_TIMEOUT, min(self.renew_interval, remaining))

    def _heartbeat(self) -> None:
        connection: BaseDatabaseWrapper | None = None
        bound = 0.0  # the statement timeout set on ``connection``
        delay = self._next_renewal_delay()
        try:
            while not self._stop.wait(delay):
                if self.lost:  # the local deadline passed while we slept (paused process, slow DB)
                    return
                grant = self.grant
                sent = clock.monotonic()
                try:
                    if connection is None:
                        connection, bound = connections.create_connection(self.using), 0.0
                    timeout = self._statement_timeout(self._deadline - sent)
                    if timeout != bound:
                        bound = bound_statements(connection, timeout)
                    renewed = renew_on(connection, grant.resource, grant.holder, grant.token, self.ttl)
                except Error as exc:
                    # Transient (server restart, network, a row lock held past the statement
                    # timeout): retry quickly until the local deadline.
                    logger.warning("renewing lease %r failed: %s", self.resource, exc)
                    if connection is not None:
                        connection.close()
                    connection = None
                    delay = min(self.renew_interval, max(0.05, (self._deadline - clock.monotonic()) / 4))
                    continue
                if renewed is None:
                    self._rejected = True
                    self._mark_lost("renewal was rejected: the lease expired, was revoked or was taken over")
                    return
                with self._state_lock:
                    late = self._lost.is_set()
                    if not late:
                        self._grant, self._deadline = renewed, sent + self.ttl
                        _watchdog.watch(self, self._deadline)
                if late:
                    # The watchdog gave up while this renewal was on its way, and the body has
                    # been told to stop: a late success does not take that back. Hand the
                    # extension back rather than keep a successor out for a TTL for nobody.
                    try:
                        release_on(connection, renewed.resource, renewed.holder, renewed.token)
                    except Error as exc:
                        logger.warning("releasing lease %r after a late renewal failed: %s", self.resource, exc)
                    return
                delay = self._next_renewal_delay()
        finally:
            if connection is not None:
                connection.close()
            # Signal receivers and on_lost callbacks may have used this thread's default connections.
            connections.close_all()

    # -- loss --------------------------------------------------------------------------------

    def _set_lost(self, reason: str, *, only_past_deadline: bool = False) -> bool:
        """Mark the lease lost; True for the one call that did (so ``on_lost`` runs once)."""
        with self._state_lock:
            if self._lost.is_set():
                return False
            if only_past_deadline and (self._stop.is_set() or clock.monotonic() < self._deadline):
                return False  # released meanwhile, or a renewal moved the deadline after the watchdog picked it
            self._lost_reason = reason
            self._lost.set()
            _watchdog.cancel(self)
        return True

    def _announce_lost(self, reason: str) -> None:
        logger.warning("lease %r (holder %s) lost: %s", self.resource, self.holder, reason)
        signals.lease_lost.send(sender=Lease, grant=self._grant, reason=reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                logger.exception("on_lost callback of lease %r failed", self.resource)

    def _mark_lost(self, reason: str) -> None:
        """Mark the lease lost and tell the body, in the calling thread; idempotent."""
        if self._set_lost(reason):
            self._announce_lost(reason)

    def _deadline_passed(self) -> None:
        """Called by the watchdog thread at the local deadline."""
        if self._set_lost(DEADLINE_PASSED, only_past_deadline=True):
            thread = threading.Thread(
                target=self._announce_lost_and_close, args=(DEADLINE_PASSED,), name=f"lease-lost:{self.resource}"
            )
            thread.daemon = True
            thread.start()

    def _announce_lost_and_close(self, reason: str) -> None:
        try:
            self._announce_lost(reason)
        finally:
            connections.close_all()  # receivers may have used this thread's default connections

    # -- context manager protocol ------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    async def __aenter__(self) -> Self:
        return await self.aacquire()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await sync_to_async(self.release)()

    def __repr__(self) -> str:
        token = self._grant.token if self._grant else None
        return f"<LeaseHolder {self.resource!r} holder={self.holder!r} token={token} lost={self._lost.is_set()}>"


def lease(
    resource: str,
    *,
    ttl: float | dt.timedelta | None = None,
    timeout: float | None = None,
    holder: str | None = None,
    on_lost: Callable[[LeaseHolder], Any] | None = None,
    renew_interval: float | None = None,
    metadata: dict[str, Any] | None = None,
    using: str | None = None,
    limit: int | None = None,
) -> LeaseHolder:
    """A lease on ``resource`` for a ``with`` or ``async with`` block.

    ``timeout`` (seconds, default ``LEASING["ACQUIRE_TIMEOUT"]``) bounds the wait for a held lease;
    0 tries once. Raises :class:`LeaseAcquisitionError` when the wait runs out.

    With ``limit=N`` the lease is one of N slots of a counting semaphore (at most N holders at once
    on the database clock); ``holder.grant.resource`` names the slot (``resource#k``), whose
    fencing token, renewal and loss detection are those of a plain lease.

    ``using``: the database holding the lease; by default the one ``LEASING["DATABASES"]`` routes
    the resource's namespace to (``default`` when none matches). Fencing tokens are per database.
    """
    return LeaseHolder(
        resource,
        ttl=ttl,
        timeout=timeout,
        holder=holder,
        on_lost=on_lost,
        renew_interval=renew_interval,
        metadata=metadata,
        using=using,
        limit=limit,
    )
