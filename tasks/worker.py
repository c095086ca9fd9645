"""The worker process: claims tasks under a lease, runs them in threads, heartbeats, finishes.

Threads (each with its own database connection):

- the dispatcher (the thread that calls :meth:`Worker.run`) claims batches of tasks and writes
  batches of outcomes, each batch one statement;
- ``concurrency`` executor threads run task handlers, with no transaction or lock held;
- a heartbeat thread renews every held task in one statement about every ttl/3;
- a listener thread waits on LISTEN/NOTIFY so an idle worker starts new work at once (polling is
  only the fallback);
- optionally a recovery thread, which only works while it holds the recovery lease.

Shutdown: the first SIGTERM/SIGINT stops claiming and lets running tasks finish within the grace
period, then hands the unfinished ones back (runnable at once, the attempt not counted); a second
signal skips the wait.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import secrets
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from inspect import iscoroutinefunction
from typing import Any

from asgiref.sync import async_to_sync
from django.db import DEFAULT_DB_ALIAS, Error, close_old_connections, connections
from django.db.models.functions import Now
from django.utils.module_loading import import_string

from tasks.conf import get_settings
from tasks.models import ClaimedTask, FailOutcome, Failure, Task
from tasks.models import Worker as WorkerRow
from tasks.runtime import Execution, _set_current

logger = logging.getLogger("tasks.worker")


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass(slots=True)
class Outcome:
    execution: Execution
    ok: bool
    value: Any = None
    failure: Failure | None = None


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


def _exception_path(exc: BaseException) -> str:
    kind = type(exc)
    return f"{kind.__module__}.{kind.__qualname__}"


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
        self.id = worker_id or default_worker_id()
        self.max_tasks = max_tasks
        self.using = using
        self.install_signal_handlers = install_signal_handlers
        if self.concurrency < 1 or self.batch_size < 1:
            raise ValueError("concurrency and batch size must be at least 1")

        self.stats = {
            "claimed": 0,
            "succeeded": 0,
            "retried": 0,
            "failed": 0,
            "rejected": 0,
            "lost": 0,
            "heartbeats": 0,
            "heartbeat_failures": 0,
        }
        self._running: dict[int, Execution] = {}
        self._running_lock = threading.Lock()
        self._work: queue.SimpleQueue[Execution | None] = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._notified = threading.Event()  # a NOTIFY for one of our queues arrived
        self._stop = threading.Event()  # background threads end
        self._draining = threading.Event()  # first signal: stop claiming
        self._hurry = threading.Event()  # second signal: do not wait for running tasks
        self._resolve = HandlerCache()
        self._threads: list[threading.Thread] = []
        self._recovery: Any = None

    # -- public --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """First call: drain. Second call: hand back at once."""
        if self._draining.is_set():
            self._hurry.set()
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

    def _dispatch(self) -> None:
        # Up to one claim batch is prefetched beyond the executors, so claims and finishes go to
        # the database in batches instead of one statement per task. Prefetched tasks are held
        # (and heartbeated) like running ones.
        capacity = self.concurrency + self.batch_size
        may_have_work = True  # false after a short claim, until a NOTIFY or the poll timeout
        drain_deadline: float | None = None
        while True:
            self._wake.clear()
            if self._notified.is_set():
                self._notified.clear()
                may_have_work = True
            outcomes = self._take_outcomes()
            free = capacity - len(self._running) + len(outcomes)
            starving = self._work.qsize() < self.concurrency
            wanted = min(free, self.batch_size)
            if self.max_tasks is not None:
                wanted = min(wanted, self.max_tasks - self.stats["claimed"])
            if not self._draining.is_set() and may_have_work and wanted > 0 and (free >= self.batch_size or starving):
                # The steady state: finish what completed and claim the next batch in one statement.
                claimed = self._write_outcomes(outcomes, claim=wanted)
                if claimed is not None and len(claimed) == wanted:
                    continue  # there may be more; go round without waiting
                may_have_work = claimed is None  # a failed claim is retried; a short one waits
            else:
                self._write_outcomes(outcomes)
            if self._draining.is_set():
                if drain_deadline is None:
                    drain_deadline = time.monotonic() + self.shutdown_grace
                    logger.info("worker %s draining: %d task(s) held", self.id, len(self._running))
                    self._hand_back_unstarted()
                if not self._running or self._hurry.is_set() or time.monotonic() >= drain_deadline:
                    return
                self._wake.wait(min(0.1, max(0.0, drain_deadline - time.monotonic())))
                continue
            if self.max_tasks is not None and self.stats["claimed"] >= self.max_tasks:
                if not self._running:
                    return
                self._wake.wait(0.1)
                continue
            if not self._wake.wait(self.poll_interval):
                may_have_work = True  # the fallback poll

    def _hand_back_unstarted(self) -> None:
        """On drain, tasks claimed but not yet started go back to the queue at once."""
        unstarted: list[Execution] = []
        while True:
            try:
                execution = self._work.get_nowait()
            except queue.Empty:
                break
            if execution is not None:
                unstarted.append(execution)
        if not unstarted:
            return
        held = {execution.id: execution.token for execution in unstarted}
        try:
            Task.objects.db_manager(self.using).hand_back(self.id, held)
        except Error as exc:
            logger.warning("worker %s: hand-back failed (tasks return after their TTL): %s", self.id, exc)
        with self._running_lock:
            for execution in unstarted:
                execution.mark_lost("handed back unstarted at shutdown")
                self._running.pop(execution.id, None)

    def _take_outcomes(self) -> list[Outcome]:
        outcomes: list[Outcome] = []
        while True:
            try:
                outcomes.append(self._outcomes.get_nowait())
            except queue.Empty:
                return outcomes

    def _flush_outcomes(self) -> None:
        self._write_outcomes(self._take_outcomes())

    def _retrying(self, what: str, statement: Callable[[], Any], outcomes: list[Outcome]) -> Any:
        """Run one statement until it succeeds; outcomes live only in memory until written.

        Each statement is retried on its own: re-sending one that already committed would make the
        compare-and-set refuse its rows, and they would be miscounted as fencing rejections.
        Gives up (None) once every execution's lease is gone anyway.
        """
        while True:
            try:
                return statement()
            except Error as exc:
                logger.warning("worker %s: %s failed, retrying: %s", self.id, what, exc)
                connections[self.using].close()
                if all(o.execution.lost for o in outcomes):
                    return None
                time.sleep(0.2)

    def _complete(self, manager: Any, results: list[tuple[int, int, Any]], successes: list[Outcome]) -> set[int]:
        written = self._retrying("writing outcomes", lambda: manager.complete_many(self.id, results), successes)
        return written or set()

    def _write_outcomes(self, outcomes: list[Outcome], *, claim: int = 0) -> list[ClaimedTask] | None:
        """Write finished executions (and claim ``claim`` new tasks in the same statement)."""
        manager = Task.objects.db_manager(self.using)
        successes = [o for o in outcomes if o.ok]
        failures = [o for o in outcomes if o.failure is not None]
        fail_results: dict[int, FailOutcome] = {}
        if failures:
            reports = [o.failure for o in failures if o.failure is not None]
            written = self._retrying("writing failures", lambda: manager.fail_many(self.id, reports), failures)
            fail_results = written or {}
        results = [(o.execution.id, o.execution.token, o.value) for o in successes]
        claimed: list[ClaimedTask] | None = []
        accepted: set[int] = set()
        sent = time.monotonic()
        if claim:
            try:
                accepted, claimed = manager.finish_and_claim(
                    self.id, results, limit=claim, queues=self.queues, ttl=self.ttl
                )
            except Error as exc:
                logger.warning("worker %s: finish-and-claim failed: %s", self.id, exc)
                connections[self.using].close()
                claimed = None  # the statement rolled back: nothing was claimed; write outcomes alone
                if results:
                    accepted = (
                        self._retrying("writing outcomes", lambda: manager.complete_many(self.id, results), successes)
                        or set()
                    )
                self._wake.wait(min(self.poll_interval, 1.0))
        elif results:
            accepted = (
                self._retrying("writing outcomes", lambda: manager.complete_many(self.id, results), successes) or set()
            )
        for outcome in successes:
            self._finish_log(outcome, "succeeded" if outcome.execution.id in accepted else None)
        for outcome in failures:
            result = fail_results.get(outcome.execution.id)
            state = None if result is None else ("retried" if result.status == "READY" else "failed")
            self._finish_log(outcome, state)
        with self._running_lock:
            for outcome in outcomes:
                self._running.pop(outcome.execution.id, None)
        for task in claimed or []:
            execution = Execution(task, self.id, self.ttl, sent)
            with self._running_lock:
                self._running[task.id] = execution
            self.stats["claimed"] += 1
            self._work.put(execution)
        return claimed

    def _finish_log(self, outcome: Outcome, state: str | None) -> None:
        execution = outcome.execution
        elapsed = time.monotonic() - execution.started
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
            logger.info("task %d %s succeeded in %.3fs (attempt %d)", task.id, task.task_path, elapsed, task.attempts)
        else:
            failure = outcome.failure
            logger.warning(
                "task %d %s %s in %.3fs (attempt %d/%d): %s: %s",
                task.id,
                task.task_path,
                "failed, will retry" if state == "retried" else "FAILED for good",
                elapsed,
                task.attempts,
                task.max_attempts,
                failure.exception_class_path if failure else "?",
                failure.message if failure else "",
            )

    # -- executors -------------------------------------------------------------------------------

    def _executor(self) -> None:
        try:
            while (execution := self._work.get()) is not None:
                # A prefetched task whose claim lapsed before we got to it is not ours to run.
                outcome = Outcome(execution, ok=False) if execution.lost else self._execute(execution)
                self._outcomes.put(outcome)
                self._wake.set()
        finally:
            connections.close_all()

    def _execute(self, execution: Execution) -> Outcome:
        task = execution.task
        _set_current(execution)
        try:
            target = self._resolve(task.task_path)
            value = self._call(target, execution)
            json.dumps(value)  # the result must be storable; a TypeError here fails the attempt
            return Outcome(execution, ok=True, value=value)
        except Exception as exc:
            return Outcome(
                execution,
                ok=False,
                failure=Failure(
                    task.id,
                    task.token,
                    _exception_path(exc),
                    str(exc),
                    "".join(traceback.format_exception(exc)),
                    # A handler that cannot even be imported will not import on the next attempt either.
                    retry=not isinstance(exc, ImportError),
                ),
            )
        finally:
            _set_current(None)
            close_old_connections()

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
                with self._running_lock:
                    executions = list(self._running.values())
                held = {}
                for execution in executions:
                    if execution.overdue:
                        # A handler past its timeout cannot be stopped from outside; let its lease
                        # lapse so recovery retries the task, and its late result is rejected.
                        execution.mark_lost(f"ran past its timeout of {execution.task.timeout:g}s")
                    if not execution.lost:
                        held[execution.id] = execution.token
                sent = time.monotonic()
                try:
                    lost = Task.objects.db_manager(self.using).heartbeat(self.id, held, ttl=self.ttl, stats=self.stats)
                except Error as exc:
                    self.stats["heartbeat_failures"] += 1
                    logger.warning("worker %s: heartbeat failed: %s", self.id, exc)
                    connections[self.using].close()
                    delay = min(interval, 1.0)
                    continue
                self.stats["heartbeats"] += 1
                for execution in executions:
                    if execution.id in lost:
                        execution.mark_lost("heartbeat rejected: lease expired, task recovered or cancelled")
                        self.stats["lost"] += 1
                        logger.warning("task %d: lease lost; its result will be rejected", execution.id)
                    elif execution.id in held:
                        execution.deadline = sent + self.ttl
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
                    for notice in conn.notifies(timeout=0.5):
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
                "stopped_at": None,
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
        for index in range(self.concurrency):
            self._spawn(self._executor, f"executor-{index}")
        self._spawn(self._heartbeat, "heartbeat")
        self._spawn(self._listen, "listener")
        if self.recovery:
            from tasks.recovery import RecoveryController

            self._recovery = RecoveryController(interval=self.recovery_interval, using=self.using)
            self._spawn(self._recovery.run, "recovery")

    def _shutdown(self) -> None:
        self._flush_outcomes()
        with self._running_lock:
            unfinished = {execution.id: execution.token for execution in self._running.values()}
            for execution in self._running.values():
                execution.mark_lost("handed back at shutdown")
        if unfinished:
            try:
                handed = Task.objects.db_manager(self.using).hand_back(self.id, unfinished)
                logger.info("worker %s handed back %d unfinished task(s): %s", self.id, len(handed), sorted(handed))
            except Error as exc:
                logger.warning("worker %s: hand-back failed (tasks return after their TTL): %s", self.id, exc)
        self._stop.set()
        if self._recovery is not None:
            self._recovery.stop()
        for _ in range(self.concurrency):
            self._work.put(None)
        for thread in self._threads:
            if thread.name in ("heartbeat", "listener", "recovery"):
                thread.join(timeout=5)
        try:
            WorkerRow.objects.using(self.using).filter(id=self.id).update(
                stopped_at=Now(), last_seen_at=Now(), running=0, stats=self.stats
            )
        except Error as exc:
            logger.warning("worker %s: could not record its stop: %s", self.id, exc)
        logger.info("worker %s stopped: %s", self.id, json.dumps(self.stats))
