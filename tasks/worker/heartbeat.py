"""The heartbeat: renews every attempt the worker holds, and the worker's own row, in one statement
about every ttl/3 (jittered), on a connection of its own.

An attempt the database no longer gives this worker (expired, recovered, cancelled) is marked lost:
its result will be refused, and its coroutine cancelled. An attempt whose row another session holds
locked is not renewed this beat; if that lasts a TTL, its local deadline gives it up."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

from django.db import DatabaseError, connections

from leasing import clock
from tasks.worker.ledger import Ledger
from tasks.worker.logs import log_attempt
from tasks.worker.session import Session

logger = logging.getLogger("tasks.worker")

Key = tuple[int, int]


class Heartbeat:
    def __init__(
        self,
        session: Session,
        ledger: Ledger,
        *,
        running: Callable[[float], int],
        live: Callable[[], list[Key]],
    ) -> None:
        self.session = session
        self.ledger = ledger
        self._running = running  # handlers running now (for the worker's row), at a local time
        self._live = live  # attempts whose handlers run: their kept key slots stay kept
        #: Local clock time of the last beat that got through (the dispatcher claims nothing while
        #: beats fail for half a TTL: its claims would only lapse).
        self.last_beat: float | None = None
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        session = self.session
        session.own_thread()
        interval = session.ttl / 3
        delay = 0.0  # a first beat at once registers the worker as alive
        try:
            while not self._stop.wait(delay):
                delay = interval * random.uniform(0.9, 1.1)
                if not self.beat():
                    delay = min(interval, 1.0)
        finally:
            connections.close_all()

    def beat(self) -> bool:
        session = self.session
        sent = clock.monotonic()
        held = self.ledger.to_heartbeat(sent, session.ttl)
        # Not beside the dispatcher's retry of a write that met a lock (its rows would be busy), but
        # never kept waiting for it long either: a retry whose connection failed reconciles for up to
        # a TTL, and every other attempt's lease depends on this beat.
        gated = session.write_gate.acquire(timeout=session.ttl / 6)
        try:
            session.bind()
            renewed, busy = session.tasks().heartbeat_detail(
                session.id,
                [e.key for e in held],
                ttl=session.ttl,
                stats=session.stats,
                running=self._running(sent),
                live=self._live(),
            )
        except DatabaseError as exc:
            session.stats["heartbeat_failures"] += 1
            logger.warning("worker %s: heartbeat failed: %s", session.id, exc)
            connections[session.using].close()
            return False
        finally:
            if gated:
                session.write_gate.release()
        session.stats["heartbeats"] += 1
        self.last_beat = sent
        for execution in held:
            if execution.key in renewed:
                execution.renewed(sent, session.ttl)
            elif execution.key in busy:
                # Ours, but another session holds its row lock: not renewed this beat. If that lasts
                # a TTL, the local deadline gives the attempt up.
                session.stats["heartbeat_busy"] += 1
            elif not execution.finished:  # a finish that committed meanwhile is no loss
                execution.mark_lost("heartbeat rejected: lease expired, task recovered or cancelled")
                session.stats["lost"] += 1
                log_attempt(
                    logger, logging.WARNING, execution, "task %d: lease lost; its result will be rejected", execution.id
                )
        return True
