"""The worker process: claims tasks under a lease, runs them, heartbeats, finishes.

This class only builds the parts, starts them, runs the dispatcher on the calling thread and stops
everything in order; each part is built from the session, the mailbox and the ledger:

- :mod:`~tasks.worker.dispatcher`: the one thread that writes (finish, mark started, claim, route);
- :mod:`~tasks.worker.threads`: ``concurrency`` executor threads running handlers, no transaction held;
- :mod:`~tasks.worker.aio`: an event loop running up to ``async_concurrency`` ``async def`` handlers;
- :mod:`~tasks.worker.heartbeat`: renews every held attempt in one statement about every ttl/3;
- :mod:`~tasks.worker.listener`: LISTEN/NOTIFY so an idle worker starts new work at once;
- the maintenance services, each working only while it holds its lease: recovery
  (:mod:`tasks.maintenance.recovery`) and the periodic-task scheduler (declared or stored schedules).

Shutdown: the first SIGTERM/SIGINT stops claiming, hands back claims that have not started, and lets
running tasks finish within the grace period, then hands the rest back (not counted as failures);
a second signal skips the wait.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from leasing.bounds import unbound
from tasks.conf import get_settings
from tasks.lifecycle.listening import wakeup_for
from tasks.maintenance.service import Services
from tasks.models import SharedFairCursor
from tasks.models.task_attempts import is_fair_claim
from tasks.worker.aio import AsyncExecutor
from tasks.worker.dispatcher import Dispatcher
from tasks.worker.handlers import HandlerCache
from tasks.worker.heartbeat import Heartbeat
from tasks.worker.identity import default_worker_name, incarnation_id, record_stop, register
from tasks.worker.isolation import IsolationGate, IsolationReservation
from tasks.worker.ledger import Ledger
from tasks.worker.listener import Listener
from tasks.worker.mailbox import Mailbox
from tasks.worker.session import Session
from tasks.worker.signals import FinishedSignals
from tasks.worker.sizing import Pace
from tasks.worker.slots import KeptSlots
from tasks.worker.threads import ThreadExecutors
from tasks.worker.writer import OutcomeWriter

logger = logging.getLogger("tasks.worker")


class Worker:
    def __init__(
        self,
        *,
        queues: Sequence[str] = ("default",),
        concurrency: int | None = None,
        batch_size: int | None = None,
        ttl: float | None = None,
        poll_interval: float | None = None,
        shutdown_grace: float | None = None,
        recovery: bool = True,
        recovery_interval: float | None = None,
        scheduler: bool = True,
        worker_id: str | None = None,
        max_tasks: int | None = None,
        using: str = DEFAULT_DB_ALIAS,
        install_signal_handlers: bool = True,
        prefetch_window: float | None = None,
        hard_exit_after: float | None = None,
        async_concurrency: int | None = None,
    ) -> None:
        conf = get_settings()
        self.queues = list(queues)
        self.concurrency = concurrency or conf.CONCURRENCY
        self.async_concurrency = conf.ASYNC_CONCURRENCY if async_concurrency is None else async_concurrency
        self.batch_size = batch_size or conf.BATCH_SIZE
        if self.concurrency < 1 or self.batch_size < 1:
            raise ValueError("concurrency and batch size must be at least 1")
        if self.async_concurrency < 0:
            raise ValueError("async concurrency must be 0 (off) or more")
        self.recovery = recovery
        self.recovery_interval = recovery_interval or conf.RECOVERY_INTERVAL
        # The periodic-task scheduler service, whether or not settings declare a schedule: one may be
        # stored at runtime, before or after this worker starts. With none declared, it takes no lease
        # and only looks for a stored one now and then (Scheduler._wait_for_stored).
        self.scheduler = scheduler
        self.max_tasks = max_tasks
        self.install_signal_handlers = install_signal_handlers
        # A process worker (``run_worker``) ends for sure: task code can leave a thread that never
        # returns, or hang a statement past any timeout; after a stop request plus this many
        # seconds the process exits whatever it is doing (its claims lapse and are recovered).
        self.hard_exit_after = hard_exit_after
        self.name = worker_id or default_worker_name()
        self.session = session = Session(
            id=incarnation_id(self.name),
            name=self.name,
            using=using,
            ttl=ttl or conf.TTL,
            shutdown_grace=conf.SHUTDOWN_GRACE if shutdown_grace is None else shutdown_grace,
            poll_interval=poll_interval or conf.POLL_INTERVAL,
        )
        self.mailbox = mailbox = Mailbox()
        self.ledger = ledger = Ledger()
        self.gate = IsolationGate()
        self.pace = Pace()
        self.resolve = HandlerCache()
        self.slots = KeptSlots(session, mailbox, ledger)
        self.writer = OutcomeWriter(session)
        self.signals = FinishedSignals(using)  # django.tasks' task_finished, once an outcome is stored
        gate, slots, resolve, pace = self.gate, self.slots, self.resolve, self.pace
        self.threads = ThreadExecutors(
            session, mailbox, ledger, concurrency=self.concurrency, gate=gate, slots=slots, resolve=resolve, pace=pace
        )
        self.aio = None
        if self.async_concurrency > 0:
            self.aio = AsyncExecutor(
                session,
                mailbox,
                ledger,
                gate=gate,
                slots=slots,
                resolve=resolve,
                pace=pace,
                request_stop=self.request_stop,
                capacity=self.async_concurrency,
                db_threads=conf.ASYNC_DB_THREADS,
                block_limit=conf.ASYNC_BLOCK_LIMIT,
            )
        self.heartbeat = Heartbeat(
            session,
            ledger,
            running=lambda now: ledger.census(now).running + self.dispatcher.zombies(),
            live=self.slots.live_attempts,
        )
        self.dispatcher = Dispatcher(
            session,
            mailbox,
            ledger,
            queues=self.queues,
            batch_size=self.batch_size,
            prefetch_window=conf.PREFETCH_WINDOW if prefetch_window is None else prefetch_window,
            isolate_after=conf.ISOLATE_AFTER,
            max_tasks=max_tasks,
            threads=self.threads,
            aio=self.aio,
            reservation=IsolationReservation(
                using=using,
                worker_id=session.id,
                queues=self.queues,
                isolate_after=conf.ISOLATE_AFTER,
                ttl=session.ttl,
                interval=session.poll_interval,
            ),
            heartbeat=self.heartbeat,
            writer=self.writer,
            signals=self.signals,
            request_stop=self.request_stop,
            gate=gate,
            slots=slots,
            resolve=resolve,
            pace=pace,
            # a fair queue's turns start where the claimers of the database left them, not at the
            # first key every time this process starts (tasks/models/fair_cursor.py)
            fair_cursor=SharedFairCursor(self.queues[0], using) if is_fair_claim(self.queues, 1) else None,
        )
        self.wakeup = wakeup_for(using, session.poll_interval)
        self.services = Services()
        self._stopped = threading.Event()  # run() has returned

    # The session's fields, as the worker's own (the commands, the tests and the dashboard read them).
    @property
    def id(self) -> str:
        return self.session.id

    @property
    def using(self) -> str:
        return self.session.using

    @property
    def ttl(self) -> float:
        return self.session.ttl

    @property
    def shutdown_grace(self) -> float:
        return self.session.shutdown_grace

    @property
    def poll_interval(self) -> float:
        return self.session.poll_interval

    @property
    def stats(self) -> dict[str, int]:
        return self.session.stats

    def request_stop(self) -> None:
        """First call: drain. Second call: hand back at once."""
        if self.session.draining.is_set():
            self.session.hurry.set()
        elif self.hard_exit_after is not None:
            threading.Thread(target=self._hard_exit, name="hard-exit", daemon=True).start()
        self.session.draining.set()
        self.mailbox.wake()

    def _hard_exit(self) -> None:
        assert self.hard_exit_after is not None
        if self._stopped.wait(self.hard_exit_after):
            return
        logger.critical(
            "worker %s still running %.0fs after the stop request (stuck task code or database): exiting now",
            self.id,
            self.hard_exit_after,
        )
        logging.shutdown()
        os._exit(70)

    def run(self) -> None:
        self.session.own_thread()
        register(self.session, queues=self.queues, concurrency=self.concurrency)
        previous_handlers = self._install_signals()
        try:
            self._start()
            logger.info(
                "worker %s started: queues=%s concurrency=%d batch=%d ttl=%gs wake-up=%s",
                self.id,
                ",".join(self.queues),
                self.concurrency,
                self.batch_size,
                self.ttl,
                self.wakeup.description,
                extra={"worker_id": self.id},
            )
            self.dispatcher.run()
        finally:
            try:
                self._shutdown()
            finally:
                # The thread that called run() may be the caller's own (a test, call_command): its
                # connection serves the caller again, unbounded.
                unbound(connections[self.using])
                self._stopped.set()
                for signum, handler in previous_handlers.items():
                    signal.signal(signum, handler)

    def _start(self) -> None:
        self.threads.start()
        if self.aio is not None:
            self.aio.start()
        self.services.start("heartbeat", self.heartbeat)
        if self.wakeup.connect is not None:
            listener = Listener(
                self.wakeup,
                self.mailbox,
                queues=self.queues,
                worker_id=self.id,
                poll_interval=self.poll_interval,
            )
            self.services.start("listener", listener)
        if self.recovery:
            from tasks.maintenance.recovery import RecoveryController

            self.services.start("recovery", RecoveryController(interval=self.recovery_interval, using=self.using))
        if self.scheduler:
            from tasks.maintenance.scheduler import Scheduler

            self.services.start("scheduler", Scheduler(using=self.using))

    def _shutdown(self) -> None:
        self.dispatcher.close()  # the last outcomes written, everything still held handed back
        if self.aio is not None:
            self.aio.stop()  # handed back above: now cancel the coroutines (cooperatively)
        self.services.stop()
        self.threads.stop()
        self.services.join(timeout=5)
        self.signals.close(timeout=5)
        record_stop(self.session)

    def _install_signals(self) -> dict[int, Any]:
        if not self.install_signal_handlers or threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: self.request_stop())
        return previous
