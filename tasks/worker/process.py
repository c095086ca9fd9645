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

Run on the main thread with its signal handlers (``run_worker``), the worker's own work (register,
dispatch, shut down) runs on a thread of its own and the main thread only watches for stop signals:
a statement can wait without any bound the server's timeouts give (queued at a transaction pooler
whose every server connection is taken: ``statement_timeout`` starts only once a server runs it), and
a stop request must be acted on whatever the database does.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from leasing import clock
from leasing.bounds import unbound
from tasks.conf import get_settings
from tasks.lifecycle.listening import wakeup_for
from tasks.maintenance.service import Services
from tasks.models import SharedFairCursor
from tasks.models.task_attempts import is_fair_claim
from tasks.worker.aio import AsyncExecutor
from tasks.worker.dispatcher import Dispatcher, DispatcherParts, DispatcherSettings
from tasks.worker.handlers import HandlerCache
from tasks.worker.heartbeat import Heartbeat
from tasks.worker.identity import default_worker_name, incarnation_id, record_stop, register
from tasks.worker.isolation import IsolationGate, IsolationReservation
from tasks.worker.ledger import Ledger
from tasks.worker.listener import Listener
from tasks.worker.mailbox import Mailbox
from tasks.worker.session import Session
from tasks.worker.signals import FinishedSignals
from tasks.worker.sizing import Pace, default_batch_size
from tasks.worker.slots import KeptSlots
from tasks.worker.threads import ThreadExecutors
from tasks.worker.writer import OutcomeWriter

logger = logging.getLogger("tasks.worker")

#: How often the main thread looks for a stop signal while the worker runs on its own thread.
SIGNAL_POLL = 0.1
#: After the second stop request, the seconds the worker's last writes (the hand-backs) get before a
#: ``run_worker`` process exits anyway (status 70, as its hard exit): a statement queued at a pooler
#: with no server connection free waits as long as the pooler lets it (PgBouncer: 120 s).
HURRY_EXIT_AFTER = 5.0


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
        explicit_batch = batch_size or conf.BATCH_SIZE
        self.batch_size = explicit_batch or default_batch_size(self.concurrency)
        self.async_batch_size = explicit_batch or default_batch_size(self.async_concurrency)
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
        settings = DispatcherSettings(
            queues=self.queues,
            batch_size=self.batch_size,
            async_batch_size=self.async_batch_size,
            prefetch_window=conf.PREFETCH_WINDOW if prefetch_window is None else prefetch_window,
            isolate_after=conf.ISOLATE_AFTER,
            max_tasks=max_tasks,
        )
        reservation = IsolationReservation(
            using=using,
            worker_id=session.id,
            queues=self.queues,
            isolate_after=conf.ISOLATE_AFTER,
            ttl=session.ttl,
            interval=session.poll_interval,
        )
        parts = DispatcherParts(
            threads=self.threads,
            aio=self.aio,
            gate=gate,
            reservation=reservation,
            slots=slots,
            heartbeat=self.heartbeat,
            writer=self.writer,
            signals=self.signals,
            resolve=resolve,
            pace=pace,
            request_stop=self.request_stop,
            # a fair queue's turns start where the claimers of the database left them, not at the
            # first key every time this process starts (tasks/models/fair_cursor.py)
            fair_cursor=SharedFairCursor(self.queues[0], using) if is_fair_claim(self.queues, 1) else None,
        )
        self.dispatcher = Dispatcher(session, mailbox, ledger, settings, parts)
        self.wakeup = wakeup_for(using, session.poll_interval)
        self.services = Services()
        self._stopped = threading.Event()  # run() has returned
        self._signals_received = 0  # counted by the signal handler, acted on by the main thread

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
        self.session.request_drain()
        self.mailbox.wake()

    def _hard_exit(self) -> None:
        assert self.hard_exit_after is not None
        if self._stopped.wait(self.hard_exit_after):
            return
        self._give_up(f"{self.hard_exit_after:.0f}s after the stop request")

    def run(self) -> None:
        if self.install_signal_handlers and threading.current_thread() is threading.main_thread():
            self._run_watched()
        else:
            self._run()

    def _run(self) -> None:
        """Register, dispatch until drained, stop (on the calling thread)."""
        self.session.own_thread()
        register(self.session, queues=self.queues, concurrency=self.concurrency)
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

    def _run_watched(self) -> None:
        """The worker on a thread of its own; the main thread acts on stop signals. Every database
        wait of the worker's (a statement queued at a pooler, a connect) happens on other threads,
        so a stop request is logged and acted on within SIGNAL_POLL whatever the database does.
        After the second one the worker gets HURRY_EXIT_AFTER more seconds."""
        errors: list[BaseException] = []

        def body() -> None:
            try:
                self._run()
            except BaseException as exc:
                errors.append(exc)
            finally:
                connections.close_all()  # this thread's own; the caller's stay as they were

        # The handler only counts: it runs between two bytecodes of the main thread, which may then
        # hold a lock that request_stop() would take (an Event's, the logging handler's).
        def on_signal(*_: Any) -> None:
            self._signals_received += 1

        previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            thread = threading.Thread(target=body, name="worker-main", daemon=True)
            thread.start()
            self._watch(thread)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if errors:
            raise errors[0]

    def _watch(self, thread: threading.Thread) -> None:
        acted_on = 0
        give_up_at: float | None = None
        while thread.is_alive():
            thread.join(SIGNAL_POLL)
            while acted_on < self._signals_received:
                acted_on += 1
                first = not self.session.draining.is_set()
                self.request_stop()
                if first:
                    logger.info(
                        "worker %s draining: stop requested; claiming nothing more, running tasks get %gs"
                        " (a second signal hands them back at once)",
                        self.id,
                        self.shutdown_grace,
                        extra={"worker_id": self.id},
                    )
                elif give_up_at is None:
                    give_up_at = clock.monotonic() + HURRY_EXIT_AFTER
                    logger.info(
                        "worker %s: second stop request; handing back what runs", self.id, extra={"worker_id": self.id}
                    )
            if give_up_at is not None and clock.monotonic() >= give_up_at and thread.is_alive():
                self._give_up(f"{HURRY_EXIT_AFTER:.0f}s after the second stop request")
                return

    def _give_up(self, when: str) -> None:
        """The worker's thread did not end in time (its statements wait on the database): a
        ``run_worker`` process exits now (its claims lapse and are recovered); run in a caller's
        process, run() returns and the worker's thread ends when the database lets it."""
        process = self.hard_exit_after is not None
        logger.critical(
            "worker %s still running %s (stuck task code or database): %s",
            self.id,
            when,
            "exiting now" if process else "returning; its thread ends when the database lets it",
            extra={"worker_id": self.id},
        )
        if process:
            logging.shutdown()
            os._exit(70)

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
