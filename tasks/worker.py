"""The worker process: claims tasks under a lease, runs them in threads, heartbeats, finishes.

Parts (each thread with its own database connection), sharing one :class:`~tasks.ledger.Ledger` of
attempts keyed by (task id, token):

- the dispatcher (the thread that calls :meth:`Worker.run`) sends one statement per round: finish
  the attempts that completed, mark the ones that began, claim the next batch; it also abandons
  attempts past their timeout and hands back claims it cannot run;
- ``concurrency`` executor threads run task handlers, with no transaction or lock held. Whatever a
  handler does (raise any ``BaseException``, return what jsonb cannot hold) ends as an outcome;
- a heartbeat thread renews every held attempt in one statement about every ttl/3;
- a listener thread waits on LISTEN/NOTIFY so an idle worker starts new work at once;
- optionally a recovery thread, which only works while it holds the recovery lease.

Shutdown: the first SIGTERM/SIGINT stops claiming, hands back claims that have not started, and lets
running tasks finish within the grace period, then hands the rest back (not counted as failures);
a second signal skips the wait.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import queue
import random
import secrets
import signal
import socket
import threading
import traceback
from collections.abc import Callable, Sequence
from inspect import iscoroutinefunction
from typing import Any

from asgiref.sync import async_to_sync
from django.db import DEFAULT_DB_ALIAS, DatabaseError, close_old_connections, connections
from django.db.models.functions import Now
from django.utils.module_loading import import_string

from leasing import clock
from tasks.conf import get_settings
from tasks.exceptions import TaskTimeout, UnstorableResult
from tasks.ledger import Census, IsolationGate, Ledger, Outcome
from tasks.models import ClaimedTask, Failure, Task
from tasks.models import Worker as WorkerRow
from tasks.outcome_writer import CONNECTION_ERRORS, OutcomeWriter, minimal_failure, retrying
from tasks.outcomes import storable_json, storable_text
from tasks.runtime import Execution, _set_current

logger = logging.getLogger("tasks.worker")

#: Smoothing of the observed task duration that sizes the prefetch.
DURATION_SMOOTHING = 0.2
#: A start marker waits this long for the attempt's own outcome, which then carries it (a short task
#: costs one row update, not two); longer attempts are marked by the next round after that.
MARKER_DELAY = 0.02


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class HandlerCache:
    """Resolves a task's path to a callable once per process."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def __call__(self, path: str) -> Any:
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
        worker_id: str | None = None,
        max_tasks: int | None = None,
        using: str = DEFAULT_DB_ALIAS,
        install_signal_handlers: bool = True,
        prefetch_window: float | None = None,
    ) -> None:
        conf = get_settings()
        self.queues = list(queues)
        self.concurrency = concurrency or conf.CONCURRENCY
        self.batch_size = batch_size or conf.BATCH_SIZE
        self.ttl = ttl or conf.TTL
        self.poll_interval = poll_interval or conf.POLL_INTERVAL
        self.shutdown_grace = conf.SHUTDOWN_GRACE if shutdown_grace is None else shutdown_grace
        self.recovery = recovery
        self.recovery_interval = recovery_interval or conf.RECOVERY_INTERVAL
        self.prefetch_window = conf.PREFETCH_WINDOW if prefetch_window is None else prefetch_window
        self.id = worker_id or default_worker_id()
        self.max_tasks = max_tasks
        self.using = using
        self.install_signal_handlers = install_signal_handlers
        if self.concurrency < 1 or self.batch_size < 1:
            raise ValueError("concurrency and batch size must be at least 1")

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
        }
        self.ledger = Ledger()
        self.isolation = IsolationGate()
        self.writer = OutcomeWriter(self)
        self._work: queue.SimpleQueue[Execution | None] = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._starts: queue.SimpleQueue[tuple[Execution, dt.datetime]] = queue.SimpleQueue()
        self._returns: queue.SimpleQueue[Execution] = queue.SimpleQueue()  # claims an executor could not begin
        self._wake = threading.Event()
        self._notified = threading.Event()  # a NOTIFY for one of our queues arrived
        self._stop = threading.Event()  # background threads end
        self._draining = threading.Event()  # first signal: stop claiming
        self.hurry = threading.Event()  # second signal: do not wait for running tasks or retries
        self._resolve = HandlerCache()
        self._threads: list[threading.Thread] = []
        self._executor_count = 0
        self._recovery: Any = None
        self._duration: float | None = None  # smoothed seconds per task, sizes the prefetch
        self._pending_starts: dict[tuple[int, int], tuple[Execution, dt.datetime, float]] = {}

    # -- public --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """First call: drain. Second call: hand back at once."""
        if self._draining.is_set():
            self.hurry.set()
        self._draining.set()
        self._wake.set()

    def run(self) -> None:
        self._register()
        previous_handlers = self._install_signals()
        try:
            self._start_threads()
            logger.info(
                "worker %s started: queues=%s concurrency=%d batch=%d ttl=%gs",
                self.id,
                ",".join(self.queues),
                self.concurrency,
                self.batch_size,
                self.ttl,
            )
            self._dispatch()
        finally:
            self._shutdown()
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)

    # -- dispatcher ------------------------------------------------------------------------------

    def prefetch(self) -> int:
        """Claims to hold beyond the executors: only what they will start within the window."""
        if self._duration is None:
            return 0
        return min(self.batch_size, math.floor(self.concurrency * self.prefetch_window / max(self._duration, 1e-4)))

    def _wanted(self, census: Census) -> int:
        if self._draining.is_set():
            return 0
        wanted = min(self.batch_size, self.concurrency + self.prefetch() - census.in_hand)
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
            self._abandon(census.overdue)
            self._take_returns()
            outcomes = self._take(self._outcomes)
            starts = self._due_starts(outcomes)
            wanted = self._wanted(census)
            idle = self.concurrency - census.running
            starving = census.unstarted < idle
            claim = wanted if may_have_work and wanted > 0 and (wanted >= self.batch_size or starving) else 0
            if outcomes or starts or claim:
                claimed = self._round(outcomes, starts, claim)
                if claim:
                    if claimed is not None and len(claimed) == claim:
                        continue  # there may be more; go round without waiting
                    may_have_work = claimed is None  # a failed claim is retried; a short one waits
            if self._draining.is_set():
                if drain_deadline is None:
                    drain_deadline = clock.monotonic() + self.shutdown_grace
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

    def _due_starts(self, outcomes: list[Outcome]) -> list[tuple[Execution, dt.datetime]]:
        """Start markers to send now: those older than MARKER_DELAY whose attempt has not ended
        (an ended attempt is marked by the statement that records its end)."""
        for execution, at in self._take(self._starts):
            self._pending_starts[execution.key] = (execution, at, clock.monotonic() + MARKER_DELAY)
        for outcome in outcomes:
            self._pending_starts.pop(outcome.key, None)
        now = clock.monotonic()
        due = [key for key, (_e, _at, when) in self._pending_starts.items() if when <= now]
        return [self._pending_starts.pop(key)[:2] for key in due]

    def _next_wait(self, census: Census) -> float:
        wait = self.poll_interval
        now = clock.monotonic()
        if census.next_deadline is not None:
            wait = min(wait, max(0.0, census.next_deadline - now) + 0.001)
        for _e, _at, when in self._pending_starts.values():
            wait = min(wait, max(0.0, when - now) + 0.001)
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
        self, outcomes: list[Outcome], starts: list[tuple[Execution, dt.datetime]], claim: int
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
        markers = [(e.id, e.token, at.timestamp()) for e, at in starts]
        accepted: set[tuple[int, int]] = set()
        claimed: list[ClaimedTask] | None = []
        refused: list[Outcome] = []
        sent = clock.monotonic()
        try:
            accepted, marked, claimed = manager.finish_start_claim(
                self.id, results, markers, limit=claim, queues=self.queues, ttl=self.ttl
            )
        except CONNECTION_ERRORS as exc:
            self.writer.connection_lost("finish-start-claim", exc)
            claimed = None
            accepted, refused = self.writer.reconcile(
                "writing results", successes, self.writer.send_completions, self.writer.completed
            )
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
        for execution, _ in starts:
            started = marked.get(execution.key)
            if started is not None:
                execution.attempt = started.attempt
            elif not execution.lost:
                execution.mark_lost("its start could not be recorded: the claim is no longer ours")
        if refused:
            for outcome in refused:
                outcome.failure = minimal_failure(outcome, "the database refused the result")
                outcome.value_json = None
            failed |= self.writer.fail(refused)
            failures += refused
            successes = [o for o in successes if o.ok]
        self._settle(successes, accepted, failures, failed)
        for task in claimed or []:
            execution = Execution(task, self.id, self.ttl, sent, self.using)
            self.ledger.add([execution])
            self.stats["claimed"] += 1
            self._work.put(execution)
        return claimed

    def _resend_markers(self, starts: list[tuple[Execution, dt.datetime]]) -> dict[tuple[int, int], Any]:
        marked: dict[tuple[int, int], Any] = {}
        manager = Task.objects.db_manager(self.using)
        for execution, _at in starts:
            # Idempotent: a marker that did land matches again and changes nothing.
            def mark(e: Execution = execution) -> Any:
                return manager.start(e.id, self.id, e.token)

            started = retrying("recording a start", self, mark)
            if started is not None:
                marked[execution.key] = started
        return marked

    def _settle(
        self, successes: list[Outcome], accepted: set[tuple[int, int]], failures: list[Outcome], failed: set[Any]
    ) -> None:
        for outcome in successes:
            self._finish_log(outcome, "succeeded" if outcome.key in accepted else None)
        for outcome in failures:
            result = self.writer.fail_results.pop(outcome.key, None)
            if outcome.key not in failed:
                state = None
            else:
                state = "retried" if result is not None and result.status == "READY" else "failed"
            self._finish_log(outcome, state)
        self.ledger.remove(o.key for o in successes + failures)

    def _abandon(self, overdue: list[Execution]) -> None:
        """Attempts past their timeout: stop heartbeating them, record the timeout now (so the late
        result is refused by the database), and give the executor slot to a new thread."""
        for execution in overdue:
            if not self.ledger.abandon(execution):
                continue  # it finished in the meantime
            self.isolation.release(execution)  # a stuck handler must not keep anything else from running
            timeout = execution.task.timeout or 0.0
            reason = f"ran past its timeout of {timeout:g}s: abandoned, its late result will be refused"
            execution.mark_lost(reason)
            self.stats["timed_out"] += 1
            logger.warning("task %d %s %s", execution.id, execution.task.task_path, reason)
            failure = failure_from(execution, TaskTimeout(f"task {execution.id} {reason}"))
            self._outcomes.put(Outcome(execution, failure=failure))
            if not self._draining.is_set():
                self._spawn_executor()  # the stuck thread retires when (if) its handler returns

    def _take_returns(self) -> None:
        returns = self._take(self._returns)
        if not returns:
            return
        live = [e for e in returns if not e.lost]
        if live:
            retrying(
                "handing back claims",
                self,
                lambda: Task.objects.db_manager(self.using).hand_back(self.id, [e.key for e in live]),
            )
            self.stats["claimed"] -= len(live)
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
        if execution.lost or self._draining.is_set():
            return self._return(execution)  # a lapsed or unwanted claim: not ours to run
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
                return self._return(execution)
            return self._run_admitted(execution, isolated)
        finally:
            self.isolation.release(execution)

    def _run_admitted(self, execution: Execution, isolated: bool) -> bool:
        if execution.task.suspect:
            # An earlier worker vanished while holding this task: mark the start before the handler
            # runs, so a poison pill is charged for every try after the first.
            try:
                started = Task.objects.db_manager(self.using).start(
                    execution.id, self.id, execution.token, isolated=isolated
                )
            except DatabaseError as exc:
                logger.warning("task %d: could not record its start: %s", execution.id, exc)
                connections[self.using].close()
                started = None
            if started is None:
                execution.mark_lost("the claim lapsed before it could start")
                return self._return(execution)
            execution.begin(started)
            self.ledger.begin(execution)
        else:
            now = dt.datetime.now(dt.UTC)
            execution.begin_local(now)
            self.ledger.begin(execution)
            self._starts.put((execution, now))
            self._wake.set()
        self.stats["started"] += 1
        try:
            outcome = self._execute(execution)
        except BaseException as exc:  # the worker's own code around the handler; never lose the attempt
            logger.exception("task %d: executor error", execution.id)
            outcome = Outcome(execution, failure=failure_from(execution, exc))
        elapsed = clock.monotonic() - (execution.started or clock.monotonic())
        self._duration = (
            elapsed if self._duration is None else self._duration + DURATION_SMOOTHING * (elapsed - self._duration)
        )
        if not self.ledger.finish(execution):
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
            target = self._resolve(task.task_path)
            value = self._call(target, execution)
        except BaseException as exc:
            # Anything the handler raises ends the attempt as a recorded failure: SystemExit,
            # KeyboardInterrupt, GeneratorExit and CancelledError included (the worker's own
            # shutdown never raises inside a handler). An import error will not import next time.
            return Outcome(execution, failure=failure_from(execution, exc, retry=not isinstance(exc, ImportError)))
        finally:
            _set_current(None)
            try:
                close_old_connections()
            except Exception:
                logger.debug("closing the handler's connections failed", exc_info=True)
        try:
            return Outcome(execution, value_json=storable_json(value))
        except UnstorableResult as exc:
            exc.args = (f"the return value cannot be stored: {exc}",)
            return Outcome(execution, failure=failure_from(execution, exc, retry=False))

    def _call(self, target: Any, execution: Execution) -> Any:
        from django.tasks import Task as DjangoTask

        if isinstance(target, DjangoTask):
            from tasks.backends import run_django_task

            return run_django_task(target, execution)
        if not callable(target):
            raise TypeError(f"{execution.task.task_path} is not callable")
        if iscoroutinefunction(target):
            return async_to_sync(target)(*execution.task.args, **execution.task.kwargs)
        return target(*execution.task.args, **execution.task.kwargs)

    # -- heartbeat -------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        interval = self.ttl / 3
        delay = 0.0  # a first beat at once registers the worker as alive
        try:
            while not self._stop.wait(delay):
                delay = interval * random.uniform(0.9, 1.1)
                held = self.ledger.to_heartbeat()
                sent = clock.monotonic()
                try:
                    lost = Task.objects.db_manager(self.using).heartbeat(
                        self.id, [e.key for e in held], ttl=self.ttl, stats=self.stats
                    )
                except DatabaseError as exc:
                    self.stats["heartbeat_failures"] += 1
                    logger.warning("worker %s: heartbeat failed: %s", self.id, exc)
                    connections[self.using].close()
                    delay = min(interval, 1.0)
                    continue
                self.stats["heartbeats"] += 1
                for execution in held:
                    if execution.key in lost:
                        execution.mark_lost("heartbeat rejected: lease expired, task recovered or cancelled")
                        self.stats["lost"] += 1
                        logger.warning("task %d: lease lost; its result will be rejected", execution.id)
                    else:
                        execution.renewed(sent, self.ttl)
        finally:
            connections.close_all()

    # -- LISTEN/NOTIFY ---------------------------------------------------------------------------

    def _listen(self) -> None:
        from tasks.models import NOTIFY_CHANNEL

        wrapper = connections[self.using]
        while not self._stop.is_set():
            conn = None
            try:
                conn = wrapper.get_new_connection(wrapper.get_connection_params())
                conn.autocommit = True
                conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                self._notified.set()  # anything enqueued while we were not listening
                self._wake.set()
                while not self._stop.is_set():
                    for notice in conn.notifies(timeout=0.2):
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
        WorkerRow.objects.using(self.using).update_or_create(
            id=self.id,
            defaults={
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "queues": self.queues,
                "concurrency": self.concurrency,
                "ttl": self.ttl,
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
        self._spawn(self._heartbeat, "heartbeat")
        self._spawn(self._listen, "listener")
        if self.recovery:
            from tasks.recovery import RecoveryController

            self._recovery = RecoveryController(interval=self.recovery_interval, using=self.using)
            self._spawn(self._recovery.run, "recovery")

    def _shutdown(self) -> None:
        self._abandon(self.ledger.census(clock.monotonic()).overdue)
        self._take_returns()
        outcomes = self._take(self._outcomes)
        for execution, at in self._take(self._starts):
            self._pending_starts[execution.key] = (execution, at, 0.0)
        starts = [
            (e, at) for key, (e, at, _when) in self._pending_starts.items() if key not in {o.key for o in outcomes}
        ]
        self._pending_starts.clear()
        if outcomes or starts:
            self._round(outcomes, starts, 0)
        unfinished = [e for e in self.ledger.snapshot() if not e.finished and not e.abandoned]
        for execution in unfinished:
            execution.mark_lost("handed back at shutdown")
        if unfinished:
            handed = retrying(
                "handing back at shutdown",
                self,
                lambda: Task.objects.db_manager(self.using).hand_back(self.id, [e.key for e in unfinished]),
            )
            if handed is None:
                logger.warning("worker %s: hand-back failed (tasks return after their TTL)", self.id)
            else:
                logger.info(
                    "worker %s handed back %d unfinished task(s): %s",
                    self.id,
                    len(handed),
                    sorted(k[0] for k in handed),
                )
        self._stop.set()
        if self._recovery is not None:
            self._recovery.stop()
        for _ in range(self._executor_count):
            self._work.put(None)
        for thread in self._threads:
            if thread.name in ("heartbeat", "listener", "recovery"):
                thread.join(timeout=5)
        try:
            WorkerRow.objects.using(self.using).filter(id=self.id).update(
                stopped_at=Now(), last_seen_at=Now(), running=0, stats=self.stats, stop_reason="stopped"
            )
        except DatabaseError as exc:
            logger.warning("worker %s: could not record its stop: %s", self.id, exc)
        logger.info("worker %s stopped: %s", self.id, json.dumps(self.stats))
