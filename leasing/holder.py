"""Hold a lease for the duration of a block: acquire with backoff, renew in the background, release.

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
"""

from __future__ import annotations

import asyncio
import datetime as dt
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
from typing import TYPE_CHECKING, Any, Self

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, Error, connections

from leasing import metrics, signals
from leasing.conf import get_settings
from leasing.exceptions import LeaseAcquisitionError, LeaseLost
from leasing.models import Grant, Lease, acquire_on, release_on, renew_on, seconds

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

logger = logging.getLogger("leasing")


def default_holder_id() -> str:
    """host:pid:random suffix, unique per holder so two threads of one process are two holders."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def backoff_delay(attempt: int, initial: float, maximum: float) -> float:
    """Capped exponential backoff with "equal jitter": between half and all of the capped step."""
    step = min(maximum, initial * (2**attempt))
    return step / 2 + random.uniform(0, step / 2)


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
        using: str = DEFAULT_DB_ALIAS,
    ) -> None:
        conf = get_settings()
        self.resource = resource
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
        self.using = using
        self._jitter = conf.RENEW_JITTER
        self._backoff = (conf.BACKOFF_INITIAL, conf.BACKOFF_MAX)
        self._grant: Grant | None = None
        self._deadline = 0.0  # monotonic time after which we no longer trust that we hold the lease
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
        if self._grant is not None and time.monotonic() >= self._deadline:
            self._mark_lost("the local deadline passed without a successful renewal")
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
        end = None if timeout is None else time.monotonic() + timeout
        while not self.lost:
            now = time.monotonic()
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
            sent = time.monotonic()
            grant = acquire_on(connection, self.resource, self.holder, self.ttl, self.metadata)
        if grant is None:
            return False
        with self._state_lock:
            self._grant, self._deadline = grant, sent + self.ttl
        return True

    def _next_backoff(self, attempt: int, give_up_at: float) -> float | None:
        remaining = give_up_at - time.monotonic()
        if remaining <= 0:
            return None
        return min(remaining, backoff_delay(attempt, *self._backoff))

    def _acquisition_error(self) -> LeaseAcquisitionError:
        return LeaseAcquisitionError(f"lease {self.resource!r} is held by another holder (waited {self.timeout:g}s)")

    def acquire(self) -> Self:
        give_up_at = time.monotonic() + self.timeout
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
        give_up_at = time.monotonic() + self.timeout
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
        """Stop renewing and release; True if the lease was still ours when released."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # A renewal in flight finishes first, so the release below uses the current token.
            thread.join(timeout=self.ttl)
        grant = self._grant
        if grant is None or self._rejected:
            return False
        with self._statement_connection() as connection:
            released = release_on(connection, grant.resource, grant.holder, grant.token) is not None
        if not released and not self._lost.is_set():
            self._mark_lost("the lease was gone at release")
        return released

    # -- heartbeat ---------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-heartbeat:{self.resource}", daemon=True)
        self._thread.start()

    def _next_renewal_delay(self) -> float:
        return self.renew_interval * random.uniform(1 - self._jitter, 1 + self._jitter)

    def _heartbeat(self) -> None:
        connection: BaseDatabaseWrapper | None = None
        delay = self._next_renewal_delay()
        try:
            while not self._stop.wait(delay):
                if self.lost:  # the local deadline passed while we slept (paused process, slow DB)
                    return
                grant = self.grant
                if connection is None:
                    connection = connections.create_connection(self.using)
                sent = time.monotonic()
                try:
                    renewed = renew_on(connection, grant.resource, grant.holder, grant.token, self.ttl)
                except Error as exc:
                    # Transient (server restart, network): retry quickly until the local deadline.
                    logger.warning("renewing lease %r failed: %s", self.resource, exc)
                    connection.close()
                    connection = None
                    delay = min(self.renew_interval, max(0.05, (self._deadline - time.monotonic()) / 4))
                    continue
                if renewed is None:
                    self._rejected = True
                    self._mark_lost("renewal was rejected: the lease expired, was revoked or was taken over")
                    return
                with self._state_lock:
                    self._grant, self._deadline = renewed, sent + self.ttl
                delay = self._next_renewal_delay()
        finally:
            if connection is not None:
                connection.close()
            # Signal receivers and on_lost callbacks may have used this thread's default connections.
            connections.close_all()

    def _mark_lost(self, reason: str) -> None:
        with self._state_lock:
            if self._lost.is_set():
                return
            self._lost_reason = reason
            self._lost.set()
        logger.warning("lease %r (holder %s) lost: %s", self.resource, self.holder, reason)
        signals.lease_lost.send(sender=Lease, grant=self._grant, reason=reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                logger.exception("on_lost callback of lease %r failed", self.resource)

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
    using: str = DEFAULT_DB_ALIAS,
) -> LeaseHolder:
    """A lease on ``resource`` for a ``with`` or ``async with`` block.

    ``timeout`` (seconds, default ``LEASING["ACQUIRE_TIMEOUT"]``) bounds the wait for a held lease;
    0 tries once. Raises :class:`LeaseAcquisitionError` when the wait runs out.
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
    )
