"""Leader election: run a callable only while this process holds a lease.

    election = LeaderElection("scheduler", ttl=15)
    election.run(lead)          # blocks; another thread or a signal handler calls election.stop()

    def lead(term: Term) -> None:
        while not term.should_stop:
            do_one_round(fence=term.token)
            term.wait(1.0)      # wakes at once on loss or stop

``lead`` must return soon after ``term.should_stop`` becomes true: Python cannot stop a thread
from outside, so stopping is cooperative, and the lease's fencing token is what keeps a leader
that is late to notice from doing harm. When ``lead`` returns or the lease is lost, the lease is
released and this instance goes back to standing by; ``stop()`` releases it so that a standby
takes over within its retry interval rather than after the TTL.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import threading
from collections.abc import Callable
from typing import Any

from django.db import Error, close_old_connections, connections

from leasing import clock
from leasing.conf import get_settings
from leasing.holder import LeaseHolder, default_holder_id
from leasing.routing import lease_database

logger = logging.getLogger("leasing.election")


class Term:
    """One period of leadership, handed to the ``lead`` callable."""

    def __init__(self, held: LeaseHolder, wake: threading.Event, stopping: threading.Event) -> None:
        self.held = held
        self._wake = wake
        self._stopping = stopping

    @property
    def token(self) -> int:
        return self.held.token

    @property
    def should_stop(self) -> bool:
        return self._stopping.is_set() or self.held.lost

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds; return True as soon as leadership must end."""
        # The holder's clock: its deadline is on it (CLOCK_BOOTTIME, which counts through suspend).
        end = clock.monotonic() + timeout
        while not self.should_stop:
            now = clock.monotonic()
            if now >= end:
                return False
            # Wake at the holder's local deadline too, so a stalled heartbeat still ends the term.
            self._wake.wait(min(end, self.held._deadline) - now + 0.001)
        return True


class LeaderElection:
    def __init__(
        self,
        resource: str,
        *,
        ttl: float | dt.timedelta | None = None,
        holder: str | None = None,
        retry_interval: float | None = None,
        using: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.resource = resource
        self.ttl = ttl
        self.holder = holder or default_holder_id()
        self.retry_interval = get_settings().ELECTION_RETRY_INTERVAL if retry_interval is None else retry_interval
        self.using = using or lease_database(resource)  # leasing/routing.py
        self.metadata = metadata
        self.terms = 0
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._leading = threading.Event()

    @property
    def is_leader(self) -> bool:
        return self._leading.is_set()

    def stop(self) -> None:
        """Ask ``run`` to end its term (if any), release the lease and return."""
        self._stopping.set()
        self._wake.set()

    def wait_for_leadership(self, timeout: float) -> bool:
        return self._leading.wait(timeout)

    def run_once(self, lead: Callable[[Term], Any]) -> bool:
        """Try to lead once; returns whether this instance led (and ``lead`` ran)."""
        self._wake.clear()
        held = LeaseHolder(
            self.resource,
            ttl=self.ttl,
            timeout=0,
            holder=self.holder,
            on_lost=lambda _held: self._wake.set(),
            using=self.using,
            metadata=self.metadata,
        )
        if not held.try_acquire():
            return False
        held._start_heartbeat()
        self.terms += 1
        self._leading.set()
        logger.info("%s leads %r (token %s)", self.holder, self.resource, held.token)
        try:
            lead(Term(held, self._wake, self._stopping))
        finally:
            self._leading.clear()
            released = held.release()
            logger.info("%s stepped down from %r (released=%s)", self.holder, self.resource, released)
        return True

    def run(self, lead: Callable[[Term], Any]) -> None:
        """Stand by and lead, again and again, until ``stop()``.

        Meant for a thread or process of its own: on return it closes that thread's database
        connections (``lead`` and the lease statements used them).
        """
        try:
            self._run(lead)
        finally:
            connections.close_all()

    def _run(self, lead: Callable[[Term], Any]) -> None:
        while not self._stopping.is_set():
            try:
                led = self.run_once(lead)
            except Error as exc:
                logger.warning("leader election for %r: database error: %s", self.resource, exc)
                close_old_connections()
                led = False
            if not led and not self._stopping.is_set():
                self._stopping.wait(self.retry_interval * random.uniform(0.8, 1.2))
