"""The worker process: claims tasks under a lease, runs them in threads, heartbeats, finishes.

Parts (each thread with its own database connection), sharing one :class:`~tasks.ledger.Ledger` of
attempts keyed by (task id, token):

- the dispatcher (the thread that calls :meth:`Worker.run`) sends one statement per round: finish
  the attempts that completed, mark the ones that began, claim the next batch; it also abandons
  attempts past their timeout and hands back claims it cannot run;
- ``concurrency`` executor threads run task handlers, with no transaction or lock held. Whatever a
  handler does (raise any ``BaseException``, return what jsonb cannot hold) ends as an outcome;
- an event loop in one more thread runs up to ``async_concurrency`` ``async def`` handlers at once
  (:mod:`tasks.aio`), on the same ledger, heartbeat and outcome path;
- a heartbeat thread renews every held attempt in one statement about every ttl/3;
- a listener thread waits on LISTEN/NOTIFY so an idle worker starts new work at once;
- optionally a recovery thread, which only works while it holds the recovery lease;
- a scheduler thread when periodic tasks are declared (``tasks/scheduler.py``), which only enqueues
  while it holds the scheduler lease.

Shutdown: the first SIGTERM/SIGINT stops claiming, hands back claims that have not started, and lets
running tasks finish within the grace period, then hands the rest back (not counted as failures);
a second signal skips the wait.
"""

from __future__ import annotations

import datetime as dt
import inspect
import json
import logging
import math
import os
import queue
import random
import secrets
import select
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from inspect import iscoroutinefunction
from typing import Any

from asgiref.sync import async_to_sync
from django.db import DEFAULT_DB_ALIAS, DatabaseError, close_old_connections, connections
from django.db.models.functions import Now
from django.utils.module_loading import import_string

from leasing import clock
from leasing.bounds import bound, unbound
from tasks import allowlist, concurrency
from tasks.compat import normalize_json
from tasks.conf import get_settings
from tasks.exceptions import NotATask, TaskPathRefused, TaskTimeout, UnstorableResult
from tasks.ledger import Census, IsolationGate, Ledger, Outcome
from tasks.models import ClaimedTask, Failure, Task
from tasks.models import Worker as WorkerRow
from tasks.outcome_writer import CONNECTION_ERRORS, OutcomeWriter, is_lock_wait, minimal_failure, retrying
from tasks.outcomes import storable_json, storable_text
from tasks.reservation import IsolationReservation
from tasks.runtime import Execution, _set_current
from tasks.task_signals import FinishedSignals
from tasks.wakeup import wakeup_for


def bound_connection(using: str, *, lock_ms: int, statement_ms: int) -> None:
    """Bound the statements of this thread's connection for the worker's own work: per transaction,
    never as session state a connection pooler would hand to someone else (leasing/bounds.py)."""
    bound(connections[using], statement_ms=statement_ms, lock_ms=lock_ms)


logger = logging.getLogger("tasks.worker")

#: A start marker that met a locked row (its start is re-sent later, not lost).
LOCKED: Any = object()

#: Smoothing of the observed task duration that sizes the prefetch.
DURATION_SMOOTHING = 0.2
#: Smoothing of the share of async attempts among claims (sizes a claim by the mix of kinds).
ASYNC_SHARE_SMOOTHING = 0.3
#: Below this share (or above 1 minus it) a claim is sized for one kind alone (the other kind's free
#: slots are then probed for once per poll interval).
ASYNC_SHARE_EPSILON = 0.05
#: Tasks such a probe claims at most (what is not of the kind with free slots goes back at once).
PROBE_SIZE = 8
#: A start marker waits this long for the attempt's own outcome, which then carries it (a short task
#: costs one row update, not two); longer attempts are marked by the next round after that.
MARKER_DELAY = 0.02


#: Characters of a worker's name (``--worker-id``); its id adds ``:`` and 8 hex digits (column: 200).
NAME_MAX = 190


def default_worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def check_worker_name(name: str) -> str:
    """A name a worker can register under: printable text (PostgreSQL text refuses NUL), 1 to
    :data:`NAME_MAX` characters. Raises ValueError saying which rule it breaks."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("a worker name must be a non-empty string")
    if len(name) > NAME_MAX:
        raise ValueError(f"a worker name has at most {NAME_MAX} characters (got {len(name)})")
    if not name.isprintable():
        raise ValueError("a worker name must be printable text (no control characters)")
    return name


def incarnation_id(name: str) -> str:
    """The id a worker process holds leases under: its name and a suffix drawn anew at each start.

    A name is what an operator gives (``--worker-id``) and reuses: a StatefulSet pod, a systemd
    template instance, a restart while the previous process still drains. An id is one process's
    lifetime. Every lease, heartbeat, reconcile and stop record is keyed by the id, so one process's
    stop, death or recovery never touches the leases of another that has the same name."""
    return f"{check_worker_name(name)}:{secrets.token_hex(4)}"


def default_worker_id() -> str:
    return incarnation_id(default_worker_name())


class HandlerCache:
    """Resolves a task's path to a callable once per process. A path that came through the JSON API
    is checked against the API allow-list first (:mod:`tasks.allowlist`), before anything is imported,
    and again on every call: the lists are settings, and a refusal is not cached."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}
        self._checked: dict[str, Any] = {}  # API paths whose target passed allowlist.resolve()

    def __call__(self, path: str, *, api_origin: bool = False) -> Any:
        if api_origin:
            reason = allowlist.refusal(path)
            if reason is not None:
                raise TaskPathRefused(f"{path!r}: {reason}")
            target = self._checked.get(path)
            if target is None:
                target = self._checked[path] = allowlist.resolve(path)
            return target
        target = self._cache.get(path)
        if target is None:
            target = import_string(path)
            self._cache[path] = target
        return target


def exception_path(exc: BaseException) -> str:
    kind = type(exc)
    return f"{kind.__module__}.{kind.__qualname__}"


def failure_from(execution: Execution, exc: BaseException, *, retry: bool = True) -> Failure:
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:  # a broken __str__/__repr__ must not stop the record
        text = f"<traceback unavailable: {exception_path(exc)}>"
    try:
        message = str(exc)
    except Exception:
        message = f"<str() of the exception failed: {exception_path(exc)}>"
    return Failure(execution.id, execution.token, exception_path(exc), message, text, retry=retry)


def is_coroutine_callable(target: Any) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one (calling either returns a
    coroutine, which must be awaited, not stored as the task's result)."""
    if iscoroutinefunction(target):
        return True
    call = inspect.getattr_static(type(target), "__call__", None)
    return not isinstance(target, type) and iscoroutinefunction(call)


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
        self.ttl = ttl or conf.TTL
        self.poll_interval = poll_interval or conf.POLL_INTERVAL
        self.shutdown_grace = conf.SHUTDOWN_GRACE if shutdown_grace is None else shutdown_grace
        self.recovery = recovery
        self.recovery_interval = recovery_interval or conf.RECOVERY_INTERVAL
        self.scheduler = scheduler and bool(conf.SCHEDULES)  # the periodic-task scheduler thread
        self.prefetch_window = conf.PREFETCH_WINDOW if prefetch_window is None else prefetch_window
        self.isolate_after = conf.ISOLATE_AFTER
        self.name = worker_id or default_worker_name()
        self.id = incarnation_id(self.name)
        self.max_tasks = max_tasks
        self.using = using
        self.install_signal_handlers = install_signal_handlers
        # A process worker (``run_worker``) ends for sure: task code can leave a thread that never
        # returns, or hang a statement past any timeout; after a stop request plus this many
        # seconds the process exits whatever it is doing (its claims lapse and are recovered).
        self.hard_exit_after = hard_exit_after
        if self.concurrency < 1 or self.batch_size < 1:
            raise ValueError("concurrency and batch size must be at least 1")
        if self.async_concurrency < 0:
            raise ValueError("async concurrency must be 0 (off) or more")

        self.stats = {
            "claimed": 0,
            "started": 0,
            "succeeded": 0,
            "retried": 0,
            "failed": 0,
            "rejected": 0,
            "lost": 0,
            "timed_out": 0,
            "late_results_dropped": 0,
            "claims_returned": 0,
            "reconciled": 0,
            "connection_errors": 0,
            "heartbeats": 0,
            "heartbeat_failures": 0,
            "heartbeat_busy": 0,
            "zombies": 0,
        }
        self.ledger = Ledger()
        self.isolation = IsolationGate()
        self.reservation = IsolationReservation(
            using=self.using,
            worker_id=self.id,
            queues=self.queues,
            isolate_after=self.isolate_after,
            ttl=self.ttl,
            interval=self.poll_interval,
        )
        self.writer = OutcomeWriter(self)
        self.signals = FinishedSignals(using)  # django.tasks' task_finished, once an outcome is stored
        self._work: queue.SimpleQueue[Execution | None] = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._starts: queue.SimpleQueue[tuple[Execution, float]] = queue.SimpleQueue()
        self._returns: queue.SimpleQueue[Execution] = queue.SimpleQueue()  # claims an executor could not begin
        # Started attempts to hand back with a reason (coroutines cancelled on lease loss, neighbours
        # of a coroutine that blocked the event loop): uncharged, the reason in their error entries.
        self._handbacks: queue.SimpleQueue[tuple[Execution, str]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._notified = threading.Event()  # a NOTIFY for one of our queues arrived
        self._stop = threading.Event()  # background threads end
        self._stop_pipe = (-1, -1)  # (read, write): a byte written ends the listener's wait at once
        self._stopped = threading.Event()  # run() has returned
        self._draining = threading.Event()  # first signal: stop claiming
        self.hurry = threading.Event()  # second signal: do not wait for running tasks or retries
        self._resolve = HandlerCache()
        self._threads: list[threading.Thread] = []
        self._executor_count = 0
        self._recovery: Any = None
        self._scheduler: Any = None
        self._duration: float | None = None  # smoothed seconds per task, sizes the prefetch
        self._async_duration: float | None = None  # the same for coroutines
        # Share of async attempts among recent claims. A claim cannot choose by kind, so its size
        # follows the mix: as many as both kinds' room allows at this mix, never more.
        self._async_share = 0.0
        self._kinds: dict[tuple[str, bool], bool] = {}  # (path, via a django.tasks backend) -> async
        self.aio: Any = None  # tasks.aio.AsyncExecutor when async_concurrency > 0
        self._probing = False  # this round's claim looks for a kind recent claims did not bring
        self._next_probe = 0.0
        self._pending_starts: dict[tuple[int, int], tuple[Execution, float, float]] = {}
        self._last_beat: float | None = None  # local clock of the last heartbeat that got through
        self._own_threads: set[int] = set()  # dispatcher and heartbeat: their statements are bounded
        self._deferred: list[tuple[float, Outcome]] = []  # outcomes whose row was locked: (retry at, outcome)
        self._zombies = 0  # abandoned attempts whose thread has not returned yet
        # Abandoned attempts whose handler (or a thread of it) still runs: tasks/concurrency.py.
        self._outliving: set[tuple[int, int]] = set()
        self._outliving_lock = threading.Lock()
        # Lost or abandoned attempts whose handler returned: their kept key slots to give back.
        self._slots_to_release: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._unreleased: list[tuple[int, int]] = []
        self.drain_deadline: float | None = None
        # The worker's own statements never wait long on a row lock or a slow server: another
        # session locking a task row (or a hung statement) must not wedge the dispatcher or the
        # heartbeat. Handler code runs on other connections and is not bounded.
        self.lock_timeout_ms = int(max(100, min(2000, self.ttl * 1000 / 6)))
        self.statement_timeout_ms = int(max(1000, self.ttl * 1000 / 3))
        self.wakeup = wakeup_for(self.using, self.poll_interval)

    # -- public --------------------------------------------------------------------------------

    def bind(self) -> None:
        """Bound the statement and lock waits of the worker's own threads (dispatcher, heartbeat);
        never an executor's connection, which task code uses."""
        if threading.get_ident() in self._own_threads:
            bound_connection(self.using, lock_ms=self.lock_timeout_ms, statement_ms=self.statement_timeout_ms)

    def retry_deadline(self) -> float:
        """How long a retry loop may go on: one TTL, and never past the drain deadline."""
        deadline = clock.monotonic() + self.ttl
        if self.drain_deadline is not None:
            deadline = min(deadline, self.drain_deadline + 1.0)
        elif self._draining.is_set():
            deadline = min(deadline, clock.monotonic() + self.shutdown_grace + 1.0)
        return deadline

    def request_stop(self) -> None:
        """First call: drain. Second call: hand back at once."""
        if self._draining.is_set():
            self.hurry.set()
        elif self.hard_exit_after is not None:
            threading.Thread(target=self._hard_exit, name="hard-exit", daemon=True).start()
        self._draining.set()
        self._wake.set()

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
        self._own_threads.add(threading.get_ident())
        self._register()
        previous_handlers = self._install_signals()
        try:
            self._start_threads()
            logger.info(
                "worker %s started: queues=%s concurrency=%d batch=%d ttl=%gs wake-up=%s",
                self.id,
                ",".join(self.queues),
                self.concurrency,
                self.batch_size,
                self.ttl,
                self.wakeup.description,
            )
            self._dispatch()
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

    # -- dispatcher ------------------------------------------------------------------------------

    def prefetch(self) -> int:
        """Claims to hold beyond the executors: only what they will start within the window."""
        if self._duration is None:
            return 0
        return min(self.batch_size, math.floor(self.concurrency * self.prefetch_window / max(self._duration, 1e-4)))

    def async_prefetch(self) -> int:
        """The same for the event loop's slots."""
        if self._async_duration is None or self.aio is None:
            return 0
        return min(
            self.batch_size, math.floor(self.async_concurrency * self.prefetch_window / max(self._async_duration, 1e-4))
        )

    def observe_async_duration(self, elapsed: float) -> None:
        previous = self._async_duration
        self._async_duration = elapsed if previous is None else previous + DURATION_SMOOTHING * (elapsed - previous)

    def _room(self, census: Census) -> int:
        """How many to claim: enough to fill the free slots (plus prefetch) of either kind at the
        observed mix of kinds; what does not fit is handed back at once (:meth:`_fit`). With no
        async executor, or only sync tasks seen, this is exactly the threads' room."""
        self._probing = False
        sync_in_hand = census.in_hand - census.async_unstarted - census.async_running
        sync_room = max(0, self.concurrency + self.prefetch() - sync_in_hand)
        if self.aio is None:
            return sync_room
        async_room = max(
            0, self.async_concurrency + self.async_prefetch() - census.async_unstarted - census.async_running
        )
        share = self._async_share
        room = 0.0
        if share < 1.0 - ASYNC_SHARE_EPSILON:
            room = max(room, sync_room / (1.0 - share))
        if share > ASYNC_SHARE_EPSILON:
            room = max(room, async_room / share)
        if room < 1:
            # One kind's slots are free but recent claims brought only the other kind: look again
            # once in a while (the queue's mix may have changed), never every round.
            unseen = async_room if share <= ASYNC_SHARE_EPSILON else sync_room
            if unseen and clock.monotonic() >= self._next_probe:
                self._next_probe = clock.monotonic() + self.poll_interval
                self._probing = True
                return min(unseen, PROBE_SIZE)
        return math.floor(room)

    def _wanted(self, census: Census) -> int:
        if self._draining.is_set() or census.isolated:
            return 0  # an isolated attempt runs alone: claim nothing beside it
        if self.reservation.active and census.in_hand:
            return 0  # becoming idle for a task that must run isolated (tasks/reservation.py)
        if self._last_beat is not None and clock.monotonic() - self._last_beat > self.ttl / 2:
            return 0  # heartbeats are not getting through: claims would only lapse (invariant 6)
        wanted = min(self.batch_size, self._room(census))
        if self.max_tasks is not None:
            wanted = min(wanted, self.max_tasks - self.stats["claimed"])
        return max(0, wanted)

    def _dispatch(self) -> None:
        may_have_work = True  # false after a short claim, until a NOTIFY or the poll timeout
        drain_deadline: float | None = None
        while True:
            self._wake.clear()
            if self._notified.is_set():
                self._notified.clear()
                may_have_work = True
            census = self.ledger.census(clock.monotonic())
            self.bind()
            self.reservation.tick(
                busy=census.in_hand > 0,
                holds_isolated=census.isolated > 0,
                can_serve=self._zombies == 0 and self._async_zombies() == 0,
                stopping=self._draining.is_set(),
            )
            self._abandon(census.overdue)
            self._release_kept_slots()
            self._take_returns()
            self._take_handbacks()
            outcomes = self._take(self._outcomes) + self._due_deferred()
            starts = self._due_starts(outcomes)
            wanted = self._wanted(census)
            # Refill before the executors run dry: keep as many claims ready as there are idle
            # executors, or (short tasks, prefetch allowed) as many as there are executors.
            idle = self.concurrency - (census.running - census.async_running)
            starving = census.unstarted - census.async_unstarted < max(idle, min(self.concurrency, self.prefetch()))
            starving = starving or self._probing
            if self.aio is not None and self._async_share > ASYNC_SHARE_EPSILON:
                idle_async = self.async_concurrency - census.async_running
                starving = starving or census.async_unstarted < max(
                    idle_async, min(self.async_concurrency, self.async_prefetch())
                )
            claim = wanted if may_have_work and wanted > 0 and (wanted >= self.batch_size or starving) else 0
            if outcomes or starts or claim:
                claimed = self._round(outcomes, starts, claim, idle=census.in_hand == 0)
                if claim:
                    if claimed is not None and len(claimed) == claim:
                        continue  # there may be more; go round without waiting
                    may_have_work = claimed is None  # a failed claim is retried; a short one waits
            if self._draining.is_set():
                if drain_deadline is None:
                    drain_deadline = self.drain_deadline = clock.monotonic() + self.shutdown_grace
                    logger.info("worker %s draining: %d attempt(s) held", self.id, len(self.ledger))
                    self._hand_back_unstarted()
                running = self.ledger.census(clock.monotonic()).running
                if not running or self.hurry.is_set() or clock.monotonic() >= drain_deadline:
                    return
                self._wake.wait(min(0.1, max(0.0, drain_deadline - clock.monotonic())))
                continue
            if self.max_tasks is not None and self.stats["claimed"] >= self.max_tasks:
                if not self.ledger.census(clock.monotonic()).in_hand:
                    return
                self._wake.wait(0.1)
                continue
            if not self._wake.wait(self._next_wait(census)):
                may_have_work = True  # the fallback poll

    def _due_starts(self, outcomes: list[Outcome]) -> list[tuple[Execution, float]]:
        """Start markers to send now: those older than MARKER_DELAY whose attempt has not ended
        (an ended attempt is marked by the statement that records its end)."""
        for execution, at in self._take(self._starts):
            self._pending_starts[execution.key] = (execution, at, clock.monotonic() + MARKER_DELAY)
        for outcome in outcomes:
            self._pending_starts.pop(outcome.key, None)
        now = clock.monotonic()
        due = [key for key, (_e, _at, when) in self._pending_starts.items() if when <= now]
        return [self._pending_starts.pop(key)[:2] for key in due]

    def _due_deferred(self) -> list[Outcome]:
        if not self._deferred:
            return []
        now = clock.monotonic()
        due = [o for at, o in self._deferred if at <= now]
        self._deferred = [(at, o) for at, o in self._deferred if at > now]
        return due

    def _next_wait(self, census: Census) -> float:
        wait = self.poll_interval
        now = clock.monotonic()
        for at, _o in self._deferred:
            wait = min(wait, max(0.0, at - now) + 0.001)
        if census.next_deadline is not None:
            wait = min(wait, max(0.0, census.next_deadline - now) + 0.001)
        for _e, _at, when in self._pending_starts.values():
            wait = min(wait, max(0.0, when - now) + 0.001)
        if census.unstarted:
            wait = min(wait, MARKER_DELAY)  # an executor may start one at any moment
        return wait

    @staticmethod
    def _take(source: queue.SimpleQueue[Any]) -> list[Any]:
        items: list[Any] = []
        while True:
            try:
                items.append(source.get_nowait())
            except queue.Empty:
                return items

    def _round(
        self, outcomes: list[Outcome], starts: list[tuple[Execution, float]], claim: int, idle: bool = False
    ) -> list[ClaimedTask] | None:
        """Write outcomes and start markers, claim ``claim`` more: one statement in the steady state."""
        manager = Task.objects.db_manager(self.using)
        failures = [o for o in outcomes if not o.ok]
        successes = [o for o in outcomes if o.ok]
        ended = {o.key for o in outcomes}
        # An attempt that already ended is marked by the statement that records its end.
        starts = [(e, at) for e, at in starts if e.key not in ended]
        failed = self.writer.fail(failures) if failures else set()
        results = [
            (o.execution.id, o.execution.token, o.value_json or "null", o.execution.started_epoch) for o in successes
        ]
        markers = [(e.id, e.token, at) for e, at in starts]
        accepted: set[tuple[int, int]] = set()
        claimed: list[ClaimedTask] | None = []
        refused: list[Outcome] = []
        sent = clock.monotonic()
        try:
            self.bind()
            if markers or claim:
                accepted, marked, claimed = manager.finish_start_claim(
                    self.id,
                    results,
                    markers,
                    limit=claim,
                    queues=self.queues,
                    ttl=self.ttl,
                    isolate_after=self.isolate_after,
                    # a task to run isolated goes only to a worker holding nothing else
                    take_isolated=idle and self._zombies == 0 and self._async_zombies() == 0,
                )
            else:  # only results: the plain finish statement is lighter to send
                accepted, marked = (manager.complete_many(self.id, results) if results else set()), {}
        except CONNECTION_ERRORS as exc:
            claimed = None
            if is_lock_wait(exc):
                # A row of ours is locked by another session: nothing committed, the connection is
                # fine. Write the rest one by one now; the locked one waits for a later round.
                logger.warning("worker %s: a row it is finishing is locked by another session: %s", self.id, exc)
                accepted, refused = self.writer.complete(successes)
                marked = self._resend_markers(starts)
            else:
                self.writer.connection_lost("finish-start-claim", exc)
                accepted, refused = self.writer.reconcile(self.writer.completions, successes)
                marked = self._resend_markers(starts)
                if claim:
                    self.writer.return_unknown_claims(lambda key: key in self.ledger)
                self._wake.wait(min(self.poll_interval, 0.5))
        except DatabaseError as exc:
            # Refused, not lost: something in it cannot be stored. Nothing committed; isolate.
            logger.warning("worker %s: round refused by the database (%s); isolating", self.id, exc)
            claimed = None
            accepted, refused = self.writer.complete(successes)
            marked = self._resend_markers(starts)
        for execution, at in starts:
            started = marked.get(execution.key)
            if started is not None:
                if started is not LOCKED:
                    execution.attempt = started.attempt
                else:  # its row is locked right now: send the marker again a little later
                    self._pending_starts[execution.key] = (execution, at, clock.monotonic() + 0.5)
            elif not execution.lost:
                execution.mark_lost("its start could not be recorded: the claim is no longer ours")
        deferred = self.writer.deferred
        if deferred:
            self.writer.deferred = []
            keys = {o.key for o in deferred}
            successes = [o for o in successes if o.key not in keys]
            failures = [o for o in failures if o.key not in keys]
            retry_at = clock.monotonic() + 0.5
            self._deferred += [(retry_at, o) for o in deferred]
        if refused:
            for outcome in refused:
                outcome.failure = minimal_failure(outcome, "the database refused the result")
                outcome.value_json = None
            failed |= self.writer.fail(refused)
            failures += refused
            successes = [o for o in successes if o.ok]
        self._settle(successes, accepted, failures, failed)
        if claimed:
            executions = [Execution(task, self.id, self.ttl, sent, self.using) for task in claimed]
            for execution in executions:
                execution.is_async = self._is_async(execution)
            excess: list[Execution] = []
            if self.aio is not None:
                share = sum(e.is_async for e in executions) / len(executions)
                self._async_share += ASYNC_SHARE_SMOOTHING * (share - self._async_share)
                executions, excess = self._fit(executions)
            self.ledger.add(executions + excess)  # before any executor can see them
            self.stats["claimed"] += len(executions) + len(excess)
            for execution in executions:
                if execution.is_async:
                    self.aio.submit(execution)
                else:
                    self._work.put(execution)
            for execution in excess:
                execution.mark_lost("handed back: no free slot of its kind (the mix of sync and async tasks changed)")
                self._returns.put(execution)
        return claimed

    def _fit(self, executions: list[Execution]) -> tuple[list[Execution], list[Execution]]:
        """Split a claim into what the executors of each kind will start within the prefetch window
        and the excess, handed back at once (uncharged): a claim cannot choose by kind, and a worker
        must not hold tasks it cannot start while another worker could. The claim was sized by the
        observed mix, so there is excess only while that mix changes."""
        census = self.ledger.census(clock.monotonic())
        async_held = census.async_unstarted + census.async_running
        free = {
            False: self.concurrency + self.prefetch() - (census.in_hand - async_held),
            True: self.async_concurrency + self.async_prefetch() - async_held,
        }
        kept: list[Execution] = []
        excess: list[Execution] = []
        for execution in executions:
            if free[execution.is_async] > 0:
                free[execution.is_async] -= 1
                kept.append(execution)
            else:
                excess.append(execution)
        return kept, excess

    def _is_async(self, execution: Execution) -> bool:
        """Whether the attempt runs on the event loop: its handler is a coroutine function (or a
        django.tasks Task of one). Resolved once per path; a path that does not resolve goes to a
        thread, which records why. Isolated attempts run on a thread, alone in the process."""
        task = execution.task
        if self.aio is None or task.isolate:
            return False
        key = (task.task_path, task.backend_alias is not None)
        kind = self._kinds.get(key)
        if kind is not None and not task.api_origin:
            return kind
        try:
            # An API path is checked against the allow-list on every call (the lists are settings).
            target = self._resolve(task.task_path, api_origin=task.api_origin)
        except Exception:
            return False
        from tasks.compat import Task as DjangoTask

        if isinstance(target, DjangoTask):
            kind = iscoroutinefunction(target.func)
        else:
            # A path enqueued through a django.tasks backend must be a Task: the thread refuses it.
            kind = task.backend_alias is None and callable(target) and is_coroutine_callable(target)
        self._kinds[key] = kind
        return kind

    def _resend_markers(self, starts: list[tuple[Execution, float]]) -> dict[tuple[int, int], Any]:
        marked: dict[tuple[int, int], Any] = {}
        manager = Task.objects.db_manager(self.using)
        for execution, _at in starts:
            # Idempotent: a marker that did land matches again and changes nothing.
            def mark(e: Execution = execution) -> Any:
                try:
                    return manager.start(e.id, self.id, e.token)
                except CONNECTION_ERRORS as exc:
                    if is_lock_wait(exc):
                        return LOCKED
                    raise

            started = retrying("recording a start", self, mark)
            if started is not None:
                marked[execution.key] = started
        return marked

    def _settle(
        self, successes: list[Outcome], accepted: set[tuple[int, int]], failures: list[Outcome], failed: set[Any]
    ) -> None:
        for outcome in successes:
            self._finish_log(outcome, "succeeded" if outcome.key in accepted else None)
            self.signals.ended(outcome.execution, "SUCCESSFUL" if outcome.key in accepted else None, outcome)
        for outcome in failures:
            result = self.writer.fail_results.pop(outcome.key, None)
            if outcome.key not in failed:
                state = None
            else:
                state = "retried" if result is not None and result.retried else "failed"
            self._finish_log(outcome, state)
            stored = None if state is None else ("READY" if state == "retried" else "FAILED")
            self.signals.ended(outcome.execution, stored, outcome)
        self.ledger.remove(o.key for o in successes + failures)

    def _abandon(self, overdue: list[Execution]) -> None:
        """Attempts past their timeout: stop heartbeating them, record the timeout now (so the late
        result is refused by the database), and give the executor slot to a new thread. A keyed
        attempt keeps its key's slot until its handler has returned (tasks/concurrency.py)."""
        abandoned = [execution for execution in overdue if self.ledger.abandon(execution)]  # not finished
        reasons = {}
        for execution in abandoned:
            with self._outliving_lock:
                if not execution.handler_done or execution.threads:
                    self._outliving.add(execution.key)  # live for the heartbeat until it returns
            timeout = execution.task.timeout or 0.0
            reasons[execution.key] = f"ran past its timeout of {timeout:g}s: abandoned, its late result will be refused"
            # Lost before its slot is kept: a handler that returns meanwhile asks for the slot back,
            # and this thread sends that after the keep.
            execution.mark_lost(reasons[execution.key])
        if abandoned:
            try:
                concurrency.keep_slots(self.id, [e.key for e in abandoned], reason="timeout", using=self.using)
            except DatabaseError as exc:
                # Recorded all the same: a timeout must not wait on the database. The slot is then free
                # from the timeout on, as before this rule existed; said in the log.
                logger.warning("worker %s: could not keep the key slots of timed-out attempts: %s", self.id, exc)
        for execution in abandoned:
            self.isolation.release(execution)  # a stuck handler must not keep anything else from running
            if not execution.is_async:
                self._zombies += 1
                self.stats["zombies"] = self._zombies
            reason = reasons[execution.key]
            self.stats["timed_out"] += 1
            logger.warning("task %d %s %s", execution.id, execution.task.task_path, reason)
            timed_out = TaskTimeout(f"task {execution.id} {reason}")
            self._outcomes.put(Outcome(execution, failure=failure_from(execution, timed_out), error=timed_out))
            if execution.is_async:
                # A coroutine is cancelled, not replaced: the loop goes on running the others. One
                # that ignores the cancellation is a zombie until it ends; one blocking the loop is
                # the watchdog's (tasks/aio.py).
                self.aio.zombies += 1
                self.aio.cancel(execution, "timeout", f"cancelled: {reason}")
                continue
            if not self._draining.is_set():
                self._spawn_executor()  # the stuck thread retires when (if) its handler returns
            if self._zombies > 2 * self.concurrency and not self._draining.is_set():
                logger.error(
                    "worker %s: %d handlers stuck past their timeouts; stopping so that a supervisor"
                    " restarts a clean process",
                    self.id,
                    self._zombies,
                )
                self.request_stop()

    def handler_returned(self, execution: Execution) -> None:
        """The attempt's handler function or coroutine has returned (its thread or the loop's)."""
        execution.handler_done = True
        self._release_if_ended(execution)

    def thread_started(self, execution: Execution) -> None:
        """A coroutine of the attempt handed work to a thread (tasks/aio.py, AttemptThreads)."""
        with self._outliving_lock:
            execution.threads += 1

    def thread_returned(self, execution: Execution) -> None:
        with self._outliving_lock:
            execution.threads -= 1
        self._release_if_ended(execution)

    def _release_if_ended(self, execution: Execution) -> None:
        """An attempt that was abandoned or lost may have had its key slot kept, by this worker or by
        recovery: once its handler and its threads have all returned, the dispatcher gives it back
        (and the heartbeat gives back any kept for an attempt whose handler is not running)."""
        if not execution.lost:
            return  # the common path: nothing can be kept for an attempt still ours
        with self._outliving_lock:
            if not execution.handler_done or execution.threads:
                return
            self._outliving.discard(execution.key)
        self._slots_to_release.put(execution.key)
        self._wake.set()

    def live_attempts(self) -> list[tuple[int, int]]:
        """The attempts with a handler (or a thread of one) running in the process now: those in hand
        that began and have not returned, and abandoned ones still running."""
        running = [e.key for e in self.ledger.snapshot() if e.started is not None and not e.handler_done]
        with self._outliving_lock:
            return running + list(self._outliving)

    def _release_kept_slots(self) -> None:
        self._unreleased += self._take(self._slots_to_release)
        if not self._unreleased:
            return
        try:
            concurrency.release_kept(self.id, self._unreleased, using=self.using)
        except DatabaseError as exc:
            logger.warning("worker %s: giving back kept key slots failed (again next round): %s", self.id, exc)
            return
        self._unreleased = []

    def hand_back_later(self, execution: Execution, reason: str) -> None:
        """A started attempt the dispatcher hands back (uncharged) with ``reason`` recorded."""
        self._handbacks.put((execution, reason))
        self._wake.set()

    def _take_handbacks(self) -> None:
        handbacks = self._take(self._handbacks)
        by_reason: dict[str, list[Execution]] = {}
        for execution, reason in handbacks:
            by_reason.setdefault(reason, []).append(execution)
        for reason, executions in by_reason.items():
            handed = retrying(
                "handing back cancelled attempts",
                self,
                lambda e=executions, r=reason: Task.objects.db_manager(self.using).hand_back(  # type: ignore[misc]
                    self.id, [x.key for x in e], reason=r
                ),
            )
            for execution in executions:
                logger.warning(
                    "task %d %s: %s%s",
                    execution.id,
                    execution.task.task_path,
                    reason,
                    "" if handed and execution.key in handed else " (the row was no longer ours)",
                )
                if execution.started is not None:
                    self.signals.ended(execution)
            self.ledger.remove(e.key for e in executions)

    def _take_returns(self) -> None:
        returns = self._take(self._returns)
        if not returns:
            return
        # Lapsed ones too: "lost" is this worker's own (early) verdict; if the row is still ours, it
        # goes back now rather than after its lease (the compare-and-set refuses the rest).
        retrying(
            "handing back claims",
            self,
            lambda: Task.objects.db_manager(self.using).hand_back(
                self.id, [e.key for e in returns], reason="handed back by its worker before it could run"
            ),
        )
        self.stats["claimed"] -= len(returns)
        self.ledger.remove(e.key for e in returns)

    def _hand_back_unstarted(self) -> None:
        """On drain, claims not yet begun go back to the queue at once, uncharged."""
        unstarted = [e for e in self._take(self._work) if e is not None]
        if not unstarted:
            return
        for execution in unstarted:
            execution.mark_lost("handed back unstarted at shutdown")
        retrying(
            "handing back unstarted claims",
            self,
            lambda: Task.objects.db_manager(self.using).hand_back(self.id, [e.key for e in unstarted]),
        )
        self.ledger.remove(e.key for e in unstarted)

    def _finish_log(self, outcome: Outcome, state: str | None) -> None:
        execution = outcome.execution
        elapsed = clock.monotonic() - (execution.started or execution.claimed_at)
        task = execution.task
        if state is None:
            self.stats["rejected"] += 1
            logger.warning(
                "task %d %s: outcome REJECTED (fencing): this worker no longer held it (%s)",
                task.id,
                task.task_path,
                execution.lost_reason or "lease expired or taken over",
            )
            return
        self.stats[state] += 1
        if state == "succeeded":
            logger.info(
                "task %d %s succeeded in %.3fs (attempt %d)", task.id, task.task_path, elapsed, execution.attempt
            )
        else:
            failure = outcome.failure
            logger.warning(
                "task %d %s %s in %.3fs (attempt %d): %s: %s",
                task.id,
                task.task_path,
                "failed, will retry" if state == "retried" else "FAILED for good",
                elapsed,
                execution.attempt,
                failure.exception_class_path if failure else "?",
                storable_text(failure.message, 500) if failure else "",
            )

    # -- executors -------------------------------------------------------------------------------

    def _spawn_executor(self) -> None:
        self._executor_count += 1
        self._spawn(self._executor, f"executor-{self._executor_count}")

    def _executor(self) -> None:
        try:
            while (execution := self._work.get()) is not None:
                if self._run_one(execution):
                    return  # abandoned: a replacement thread already took this one's place
        finally:
            connections.close_all()

    def _return(self, execution: Execution) -> bool:
        self._returns.put(execution)  # handed back uncharged by the dispatcher (or dropped if lapsed)
        self._wake.set()
        return False

    def _run_one(self, execution: Execution) -> bool:
        """Run one attempt to an outcome. Returns True when this thread must retire."""
        isolated = execution.task.isolate
        if isolated:
            # Its workers vanished beside other attempts more than once: run it alone, so that if it
            # kills this process too, the crash is attributable. Waiting longer than its lease would
            # only hold it from workers that are free: hand it back instead.
            if not self.isolation.enter_exclusive(execution, execution.deadline, clock.monotonic):
                logger.info("task %d: no quiet moment to run it isolated; handed back", execution.id)
                return self._return(execution)
        elif not self.isolation.enter_shared(execution, self._draining):
            return self._return(execution)
        try:
            if execution.lost or self._draining.is_set():
                return self._return(execution)  # a lapsed or unwanted claim: not ours to run
            return self._run_admitted(execution, isolated)
        finally:
            self.isolation.release(execution)

    def _run_admitted(self, execution: Execution, isolated: bool) -> bool:
        if execution.task.suspect:
            # An earlier worker vanished while holding this task: mark the start before the handler
            # runs, so a poison pill is charged for every try after the first.
            # Idempotent, so a start whose reply was lost is simply sent again. An abandoned thread
            # still running in this process means the attempt does not run alone after all.
            alone = isolated and self._zombies == 0
            started = retrying(
                "recording a start",
                self,
                lambda: Task.objects.db_manager(self.using).start(
                    execution.id, self.id, execution.token, isolated=alone
                ),
            )
            if started is None:
                execution.mark_lost("the claim lapsed before it could start")
                return self._return(execution)
            execution.begin(started)
            self.ledger.begin(execution)
        else:
            now = time.time()
            execution.begin_local(now)
            self.ledger.begin(execution)
            # No wake-up: the dispatcher looks for start markers every MARKER_DELAY while it holds
            # claims that may start, and an outcome wakes it anyway.
            self._starts.put((execution, now))
        self.stats["started"] += 1
        try:
            outcome = self._execute(execution)
        except BaseException as exc:  # the worker's own code around the handler; never lose the attempt
            logger.exception("task %d: executor error", execution.id)
            outcome = Outcome(execution, failure=failure_from(execution, exc))
        finally:
            self.handler_returned(execution)
        elapsed = clock.monotonic() - (execution.started or clock.monotonic())
        self._duration = (
            elapsed if self._duration is None else self._duration + DURATION_SMOOTHING * (elapsed - self._duration)
        )
        if not self.ledger.finish(execution):
            self._zombies -= 1
            self.stats["zombies"] = self._zombies
            self.stats["late_results_dropped"] += 1
            logger.warning("task %d: late result of an abandoned attempt dropped", execution.id)
            return True
        self._outcomes.put(outcome)
        self._wake.set()
        return False

    def _execute(self, execution: Execution) -> Outcome:
        task = execution.task
        _set_current(execution)
        try:
            target = self._resolve(task.task_path, api_origin=task.api_origin)
            value = self._call(target, execution)
        except BaseException as exc:
            return self.failure_outcome(execution, exc)
        finally:
            _set_current(None)
            try:
                close_old_connections()
            except Exception:
                logger.debug("closing the handler's connections failed", exc_info=True)
        return self.value_outcome(execution, value)

    @staticmethod
    def failure_of(execution: Execution, exc: BaseException) -> Failure:
        return failure_from(execution, exc)

    def failure_outcome(self, execution: Execution, exc: BaseException) -> Outcome:
        """What a handler raised, as an outcome (threads and coroutines alike)."""
        # Anything the handler raises ends the attempt as a recorded failure: SystemExit,
        # KeyboardInterrupt, GeneratorExit and CancelledError included (the worker's own shutdown
        # never raises inside a handler; its cancellations of coroutines are told apart by
        # ``execution.cancelled_by_worker``). An import error will not import next time, and a
        # refused path will not be admitted next time: neither is retried.
        retry = not isinstance(exc, ImportError | NotATask | TaskPathRefused)
        if not retry:
            from tasks.backends import refused

            refused(execution)  # a backend's task that cannot run here: task_finished says so
        return Outcome(execution, failure=failure_from(execution, exc, retry=retry), error=exc)

    def value_outcome(self, execution: Execution, value: Any) -> Outcome:
        """What a handler returned, as an outcome: stored JSON, or a failure if it cannot be stored."""
        try:
            if execution.django is not None:
                try:
                    value = normalize_json(value)  # what django.tasks stores of a return value, with its errors
                except RecursionError:  # nested too deeply: the same every time, like storable_json's verdict
                    raise UnstorableResult("not JSON-serialisable: nested too deeply") from None
            return Outcome(execution, value_json=storable_json(value))
        except UnstorableResult as exc:
            exc.args = (f"the return value cannot be stored: {exc}",)
            return Outcome(execution, failure=failure_from(execution, exc, retry=False), error=exc)
        except (TypeError, ValueError) as exc:  # normalize_json refused it: the same every time
            return Outcome(execution, failure=failure_from(execution, exc, retry=False), error=exc)

    def _call(self, target: Any, execution: Execution) -> Any:
        from tasks.compat import Task as DjangoTask

        if isinstance(target, DjangoTask):
            from tasks.backends import run_django_task

            return run_django_task(target, execution)
        if execution.task.backend_alias is not None:
            # Enqueued through a django.tasks backend: only a Task runs (as in Django's other
            # database backends), whatever else the path imports.
            raise NotATask(f"{execution.task.task_path} is not a django.tasks Task")
        if not callable(target):
            raise TypeError(f"{execution.task.task_path} is not callable")
        if is_coroutine_callable(target):
            return async_to_sync(target)(*execution.task.args, **execution.task.kwargs)
        return target(*execution.task.args, **execution.task.kwargs)

    # -- heartbeat -------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        self._own_threads.add(threading.get_ident())
        interval = self.ttl / 3
        delay = 0.0  # a first beat at once registers the worker as alive
        try:
            while not self._stop.wait(delay):
                delay = interval * random.uniform(0.9, 1.1)
                sent = clock.monotonic()
                held = self.ledger.to_heartbeat(sent, self.ttl)
                try:
                    self.bind()
                    renewed, busy = Task.objects.db_manager(self.using).heartbeat_detail(
                        self.id,
                        [e.key for e in held],
                        ttl=self.ttl,
                        stats=self.stats,
                        running=self.ledger.census(sent).running + self._zombies + self._async_zombies(),
                        live=self.live_attempts(),
                    )
                except DatabaseError as exc:
                    self.stats["heartbeat_failures"] += 1
                    logger.warning("worker %s: heartbeat failed: %s", self.id, exc)
                    connections[self.using].close()
                    delay = min(interval, 1.0)
                    continue
                self.stats["heartbeats"] += 1
                self._last_beat = sent
                for execution in held:
                    if execution.key in renewed:
                        execution.renewed(sent, self.ttl)
                    elif execution.key in busy:
                        # Ours, but another session holds its row lock: not renewed this beat. If that
                        # lasts a TTL, the local deadline gives the attempt up.
                        self.stats["heartbeat_busy"] += 1
                    elif not execution.finished:  # a finish that committed meanwhile is no loss
                        execution.mark_lost("heartbeat rejected: lease expired, task recovered or cancelled")
                        self.stats["lost"] += 1
                        logger.warning("task %d: lease lost; its result will be rejected", execution.id)
        finally:
            connections.close_all()

    def _async_zombies(self) -> int:
        return 0 if self.aio is None else int(self.aio.zombies)

    # -- LISTEN/NOTIFY ---------------------------------------------------------------------------

    def _listen(self) -> None:
        from tasks.models import NOTIFY_CHANNEL

        connect = self.wakeup.connect
        assert connect is not None
        while not self._stop.is_set():
            conn = None
            try:
                conn = connect()
                conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                self._notified.set()  # anything enqueued while we were not listening
                self._wake.set()
                # Wait on the connection and on the stop pipe at once: a stop ends the wait at once
                # (no polling), a notification wakes the dispatcher at once.
                poller = select.poll()
                poller.register(conn.fileno(), select.POLLIN)
                poller.register(self._stop_pipe[0], select.POLLIN)
                while not self._stop.is_set():
                    poller.poll(self.poll_interval * 1000)
                    for notice in conn.notifies(timeout=0):
                        if notice.payload in self.queues:
                            self._notified.set()
                            self._wake.set()
            except Exception as exc:
                logger.warning("worker %s: listener connection failed: %s", self.id, exc)
                self._stop.wait(1.0)
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        logger.debug("closing the listener connection failed", exc_info=True)

    # -- lifecycle -------------------------------------------------------------------------------

    def _register(self) -> None:
        rows = WorkerRow.objects.using(self.using)
        horizon = Now() - dt.timedelta(seconds=2 * self.ttl)
        namesakes = list(
            rows.filter(name=self.name, stopped_at__isnull=True, last_seen_at__gte=horizon)
            .exclude(pk=self.id)
            .values_list("id", "hostname", "pid")
        )
        if namesakes:
            # Safe (each holds its own leases), and expected while a predecessor drains; two replicas
            # configured with one name for good is usually a mistake worth a line in the log.
            logger.warning(
                "worker %s: %d other live worker(s) named %r: %s; each keeps its own leases",
                self.id,
                len(namesakes),
                self.name,
                ", ".join(f"{i} (pid {p} on {h})" for i, h, p in namesakes),
            )
        rows.update_or_create(
            id=self.id,
            defaults={
                "name": self.name,
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "queues": self.queues,
                "concurrency": self.concurrency,
                "ttl": self.ttl,
                "started_at": Now(),  # run() again on this object: a new start (crash attribution)
                "stopped_at": None,
                "stop_reason": "",
            },
        )

    def _install_signals(self) -> dict[int, Any]:
        if not self.install_signal_handlers or threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: self.request_stop())
        return previous

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _start_threads(self) -> None:
        for _ in range(self.concurrency):
            self._spawn_executor()
        if self.async_concurrency > 0:
            from tasks.aio import AsyncExecutor

            conf = get_settings()
            self.aio = AsyncExecutor(
                self,
                capacity=self.async_concurrency,
                db_threads=conf.ASYNC_DB_THREADS,
                block_limit=conf.ASYNC_BLOCK_LIMIT,
            )
            self.aio.start()
        self._spawn(self._heartbeat, "heartbeat")
        if self.wakeup.connect is not None:
            self._stop_pipe = os.pipe()
            self._spawn(self._listen, "listener")
        if self.recovery:
            from tasks.recovery import RecoveryController

            self._recovery = RecoveryController(interval=self.recovery_interval, using=self.using)
            self._spawn(self._recovery.run, "recovery")
        if self.scheduler:
            from tasks.scheduler import Scheduler

            self._scheduler = Scheduler(using=self.using)
            self._spawn(self._scheduler.run, "scheduler")

    def _shutdown(self) -> None:
        self.reservation.release()
        self._abandon(self.ledger.census(clock.monotonic()).overdue)
        self._release_kept_slots()  # handlers still running keep theirs: recovery frees them once we stop
        self._take_returns()
        self._take_handbacks()
        # Outcomes may still arrive while the last rounds are in flight: write until none is left.
        pending = [o for _at, o in self._deferred]  # rows that were locked get one more try
        self._deferred = []
        for _ in range(10):
            outcomes = self._take(self._outcomes) + pending
            pending = []
            for execution, at in self._take(self._starts):
                self._pending_starts[execution.key] = (execution, at, 0.0)
            ended = {o.key for o in outcomes}
            starts = [(e, at) for key, (e, at, _when) in self._pending_starts.items() if key not in ended]
            self._pending_starts.clear()
            if not outcomes and not starts:
                break
            self._round(outcomes, starts, 0)
        # Everything still held goes back: unstarted and running attempts, and finished ones whose
        # outcome could not be written (their compare-and-set protects the rows they no longer own).
        unfinished = [e for e in self.ledger.snapshot() if not e.abandoned]
        for execution in unfinished:
            execution.mark_lost("handed back at shutdown")
        if unfinished:
            handed = retrying(
                "handing back at shutdown",
                self,
                lambda: Task.objects.db_manager(self.using).hand_back(self.id, [e.key for e in unfinished]),
            )
            for execution in unfinished:
                if execution.started is not None:
                    self.signals.ended(execution)  # handed back (or lapsing): the row says where it stands
            if handed is None:
                logger.warning("worker %s: hand-back failed (tasks return after their TTL)", self.id)
            else:
                logger.info(
                    "worker %s handed back %d unfinished task(s): %s",
                    self.id,
                    len(handed),
                    sorted(k[0] for k in handed),
                )
        if self.aio is not None:
            self.aio.stop()  # handed back above: now cancel the coroutines (cooperatively)
        self._stop.set()
        if self._stop_pipe[1] >= 0:
            os.write(self._stop_pipe[1], b"x")  # ends the listener's wait now
        if self._recovery is not None:
            self._recovery.stop()
        if self._scheduler is not None:
            self._scheduler.stop()
        for _ in range(self._executor_count):
            self._work.put(None)
        for thread in self._threads:
            if thread.name in ("heartbeat", "listener", "recovery", "scheduler"):
                thread.join(timeout=5)
        self.signals.close(timeout=5)
        if self._stop_pipe[0] >= 0 and not any(t.name == "listener" and t.is_alive() for t in self._threads):
            for fd in self._stop_pipe:
                os.close(fd)
            self._stop_pipe = (-1, -1)
        try:
            WorkerRow.objects.using(self.using).filter(id=self.id).update(
                stopped_at=Now(), last_seen_at=Now(), running=0, stats=self.stats, stop_reason="stopped"
            )
        except DatabaseError as exc:
            logger.warning("worker %s: could not record its stop: %s", self.id, exc)
        logger.info("worker %s stopped: %s", self.id, json.dumps(self.stats))
