"""The async executor: ``async def`` handlers run as coroutines on one event loop per worker process.

The dispatcher routes each claimed attempt by its handler (resolved once per path): a coroutine
function, or a django.tasks Task whose function is one, comes here; everything else, and any task
that must run isolated, goes to the executor threads. Up to ``ASYNC_CONCURRENCY`` coroutines run at
once on the loop's thread. They share the worker's one ledger of attempts, so the heartbeat thread's
one statement renews them with the threads' attempts, and their outcomes go through the same
finish compare-and-set (a coroutine whose lease was lost cannot win).

Database connections: the loop itself opens none per coroutine. The worker's statements made for a
coroutine (a start marker for a suspect task, ``acheckpoint``, a django.tasks retry's read and
``task_started``) and a handler's own ``sync_to_async(thread_sensitive=False)`` calls run on the
loop's default executor, a pool of ``ASYNC_DB_THREADS`` threads (one connection each). Django's async
ORM methods (``aget``, ``acreate``, ...) use asgiref's thread-sensitive executor: one more thread and
connection, shared by every coroutine.

Cancellation is cooperative (``Task.cancel`` with a message) and recorded:

- past its timeout, the dispatcher abandons the attempt (a TaskTimeout failure is written at once)
  and cancels the coroutine; whatever it returns later is dropped;
- when the lease is lost (heartbeat rejected, local deadline passed, checkpoint refused) the loop's
  ticker cancels the coroutine within a tick; the attempt is then handed back with the reason in its
  error entries (a compare-and-set: if the row is no longer ours, whoever took it has recorded why);
- at shutdown, after the grace period, the worker hands every running attempt back (uncharged) and
  cancels the coroutines.

A coroutine that blocks the loop (``time.sleep``, a CPU loop) stops every coroutine beside it but not
the heartbeat thread, which keeps renewing every lease. A watchdog thread sees the loop not turning
for ``ASYNC_BLOCK_LIMIT`` seconds: it abandons the blocking attempt (an EventLoopBlocked failure,
charged like a timeout), hands its neighbours back uncharged, and starts a fresh loop for new work.
The old loop's thread retires when (if) the blocking call returns: it cancels what it still runs and
stops. Three retired loops still blocked at once make the worker stop, for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Any

from asgiref.sync import SyncToAsync, sync_to_async
from django.db import close_old_connections, connections

from leasing import clock
from tasks import tracing
from tasks.exceptions import EventLoopBlocked
from tasks.models import RateRefused
from tasks.runtime import Execution, _current, _set_current
from tasks.worker import handlers
from tasks.worker.handlers import HandlerCache
from tasks.worker.isolation import IsolationGate
from tasks.worker.ledger import Ledger, Outcome
from tasks.worker.logs import log_attempt
from tasks.worker.mailbox import Mailbox
from tasks.worker.session import Session, rate_limited, retrying, take_start
from tasks.worker.sizing import Pace
from tasks.worker.slots import KeptSlots

logger = logging.getLogger("tasks.worker")

#: How often the loop's ticker runs: it proves the loop turns and cancels coroutines whose lease was lost.
TICK = 0.1
#: A coroutine waiting for an isolated attempt elsewhere in the process looks again this often.
ADMIT_RETRY = 0.05
#: Retired loops still blocked at once before the worker stops.
MAX_BLOCKED_LOOPS = 3
#: Seconds the cancelled coroutines get to end at shutdown (their finally blocks, cleanup awaits).
CANCEL_WAIT = 3.0


def _then_close_broken(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    finally:
        handlers.close_broken_connections()


def _where(thread: threading.Thread | None, depth: int = 6) -> str:
    """The innermost calls ``thread`` is in now (the call that blocks a loop, for its log line)."""
    frame = None if thread is None or thread.ident is None else sys._current_frames().get(thread.ident)
    if frame is None:
        return "?"
    calls = traceback.extract_stack(frame)[-depth:]
    return " < ".join(f"{c.name} ({c.filename.rsplit('/', 2)[-1]}:{c.lineno})" for c in reversed(calls))


class AttemptThreads(ThreadPoolExecutor):
    """The event loop's default executor: ``sync_to_async(thread_sensitive=False)``,
    ``asyncio.to_thread`` and ``loop.run_in_executor(None, …)`` run here. A coroutine cancelled at
    its timeout ends at once while a thread it handed work to runs on, so each job submitted from
    an attempt's context counts as a running handler of that attempt until it returns: a key slot
    kept for the attempt is given back only when its coroutine and its threads have all returned
    (tasks/lifecycle/concurrency.py).

    These threads live as long as their loop, and so do their connections: after each job, a
    connection that met a database error and is no longer usable (the server dropped it) is closed,
    so the next job connects anew instead of failing on it."""

    def __init__(self, slots: KeptSlots, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._slots = slots

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        execution = _current.get()
        if execution is None:
            return super().submit(_then_close_broken, fn, *args, **kwargs)
        self._slots.thread_started(execution)
        try:
            future = super().submit(_then_close_broken, fn, *args, **kwargs)
        except BaseException:
            self._slots.thread_returned(execution)
            raise
        future.add_done_callback(lambda _done: self._slots.thread_returned(execution))
        return future


class _Loop:
    """One event loop and the thread that runs it; retired when a coroutine blocks it."""

    def __init__(self, number: int, db_threads: int, slots: KeptSlots) -> None:
        self.number = number
        self.loop = asyncio.new_event_loop()
        self.db_threads = db_threads
        # sync_to_async(thread_sensitive=False) runs on the loop's default executor: this bounded pool.
        self.pool = AttemptThreads(slots, max_workers=db_threads, thread_name_prefix=f"async-db-{number}")
        self.loop.set_default_executor(self.pool)
        self.tick = clock.monotonic()
        self.retired = False
        # Attempts submitted to this loop and not ended, and their asyncio tasks (keyed by attempt).
        # Read by the watchdog and the dispatcher; changed under ``lock``.
        self.lock = threading.Lock()
        self.attempts: dict[tuple[int, int], Execution] = {}
        self.tasks: dict[tuple[int, int], asyncio.Task[None]] = {}
        # The attempts whose coroutine was cancelled: each is cancelled once, whoever asks again (a
        # second cancel would interrupt the cleanup the first one let it run: an await in its
        # ``except CancelledError`` or ``finally``). Read and changed on the loop's thread only.
        self.cancelled: set[tuple[int, int]] = set()
        self.thread: threading.Thread | None = None
        # Checks of the ORM thread's connections queued after failed attempts (see _check_orm_connections).
        self.checks: set[asyncio.Future[None]] = set()


class AsyncExecutor:
    def __init__(
        self,
        session: Session,
        mailbox: Mailbox,
        ledger: Ledger,
        *,
        gate: IsolationGate,
        slots: KeptSlots,
        resolve: HandlerCache,
        pace: Pace,
        request_stop: Callable[[], None],
        capacity: int,
        db_threads: int,
        block_limit: float,
    ) -> None:
        self.session = session
        self.mailbox = mailbox
        self.ledger = ledger
        self.gate = gate
        self.slots = slots
        self.resolve = resolve
        self.pace = pace
        self.request_stop = request_stop
        self.capacity = capacity
        self.block_limit = block_limit
        self.db_threads = db_threads
        self.zombies = 0  # abandoned coroutines (timeout, blocked loop) that have not ended yet
        self._switch = threading.Lock()  # submit vs. replacing the loop
        self._current: _Loop | None = None
        self._retired: list[_Loop] = []
        self._count = 0
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    # -- called from the worker's threads ---------------------------------------------------------

    def start(self) -> None:
        self._current = self._new_loop()
        self._watchdog = threading.Thread(target=self._watch, name="async-watchdog", daemon=True)
        self._watchdog.start()

    def submit(self, execution: Execution) -> None:
        """Hand a claimed attempt (already in the ledger) to the loop."""
        with self._switch:
            state = self._current
            assert state is not None
            with state.lock:
                state.attempts[execution.key] = execution
            state.loop.call_soon_threadsafe(self._spawn, state, execution)

    def cancel(self, execution: Execution, why: str, message: str) -> None:
        """Cancel the attempt's coroutine (cooperatively), from any thread."""
        if execution.cancelled_by_worker is None:
            execution.cancelled_by_worker = why
        for state in self._loops():
            if execution.key in state.tasks:
                with suppress(RuntimeError):  # that loop has closed meanwhile: nothing left to cancel
                    state.loop.call_soon_threadsafe(self._cancel_once, state, execution.key, message)

    def stop(self) -> None:
        """Cancel every coroutine (what still runs was handed back by now) and stop the loops."""
        self._stopping.set()
        for state in self._loops():
            with suppress(RuntimeError):  # a loop that closed meanwhile
                state.loop.call_soon_threadsafe(self._cancel_all, state, "shutdown", "the worker is shutting down")
        current = self._current
        if current is not None and current.thread is not None:
            current.thread.join(CANCEL_WAIT + 2.0)

    @property
    def blocked_loops(self) -> int:
        return sum(1 for state in self._retired if state.thread is not None and state.thread.is_alive())

    # -- the loop ---------------------------------------------------------------------------------

    def _loops(self) -> list[_Loop]:
        with self._switch:
            return [s for s in [self._current, *self._retired] if s is not None]

    def _new_loop(self) -> _Loop:
        self._count += 1
        state = _Loop(self._count, self.db_threads, self.slots)
        state.thread = threading.Thread(
            target=self._serve, args=(state,), name=f"async-loop-{state.number}", daemon=True
        )
        state.thread.start()
        return state

    def _serve(self, state: _Loop) -> None:
        asyncio.set_event_loop(state.loop)
        state.loop.create_task(self._ticker(state))
        while True:
            try:
                state.loop.run_forever()
                break
            except BaseException:
                # A task a handler spawned itself raised SystemExit/KeyboardInterrupt out of the
                # loop: ours are caught inside their coroutines. The loop carries on.
                logger.exception("worker %s: the event loop stopped on an exception; resuming it", self.session.id)
        self._close_pool_connections(state)
        if self._stopping.is_set():
            self._close_orm_connections()
        state.loop.close()  # also shuts its pool down

    async def _ticker(self, state: _Loop) -> None:
        while not state.retired and not self._stopping.is_set():
            state.tick = clock.monotonic()
            self._sweep(state)
            await asyncio.sleep(TICK)
        if state.retired:
            self._cancel_all(state, "blocked", "the event loop was replaced after being blocked")
        else:
            self._cancel_all(state, "shutdown", "the worker is shutting down")
        tasks: list[asyncio.Future[Any]] = [*state.tasks.values(), *state.checks]
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_WAIT)
        state.loop.stop()

    def _sweep(self, state: _Loop) -> None:
        """Cancel the coroutines whose lease is gone (the heartbeat, a checkpoint or the local
        deadline said so): they cannot win their finish, and their work would be wasted or harmful."""
        for key in list(state.tasks):
            execution = state.attempts.get(key)
            if (
                execution is not None
                and execution.started is not None
                and execution.cancelled_by_worker is None
                and not execution.finished
                and not execution.abandoned
                and execution.lost
            ):
                execution.cancelled_by_worker = "lost"
                self._cancel_once(state, key, f"the lease was lost: {execution.lost_reason}")
                # A coroutine that ignores the cancellation must not keep its slot (and the worker's
                # capacity) for ever: it cannot finish, so after a while it is given up on.
                state.loop.call_later(CANCEL_WAIT, self._give_up_lost, execution)

    def _give_up_lost(self, execution: Execution) -> None:
        """A coroutine cancelled for a lost lease that has not ended: abandon it like one past its
        timeout (its late end is dropped), free its slot and hand the row back if it is still ours."""
        if not self.ledger.abandon(execution):
            return  # it ended (and was handed back) meanwhile
        self.zombies += 1
        self.gate.release(execution)
        log_attempt(
            logger,
            logging.WARNING,
            execution,
            "task %d: ignored the cancellation after losing its lease; abandoned",
            execution.id,
        )
        self.mailbox.hand_back_later(
            execution,
            f"cancelled: the lease was lost ({execution.lost_reason}); the coroutine ignored the cancellation",
        )

    def _cancel_all(self, state: _Loop, why: str, message: str) -> None:
        for key in list(state.tasks):
            execution = state.attempts.get(key)
            if execution is not None and execution.cancelled_by_worker is None:
                execution.cancelled_by_worker = why
            self._cancel_once(state, key, message)

    @staticmethod
    def _cancel_once(state: _Loop, key: tuple[int, int], message: str) -> None:
        """Cancel the attempt's coroutine unless it was cancelled already (on the loop's thread). The
        shutdown cancels from stop() and again from the ticker, an operator's cancel may come first:
        a second cancel would end the coroutine's cleanup awaits early (a write it makes through
        ``sync_to_async`` still queued for a database thread would never run)."""
        task = state.tasks.get(key)
        if task is None or key in state.cancelled:
            return
        state.cancelled.add(key)
        task.cancel(message)

    def _spawn(self, state: _Loop, execution: Execution) -> None:
        if state.retired:
            return  # the watchdog handed it back already
        task = state.loop.create_task(self._run(state, execution))
        with state.lock:
            state.tasks[execution.key] = task

    # -- one attempt --------------------------------------------------------------------------------

    async def _run(self, state: _Loop, execution: Execution) -> None:
        try:
            while not self.gate.try_enter_shared(execution):
                if state.retired:
                    return  # the watchdog returned it already
                if self.session.draining.is_set() or execution.lost:
                    self.mailbox.give_back(execution)
                    return
                await asyncio.sleep(ADMIT_RETRY)
            try:
                if state.retired:
                    return
                if execution.lost or self.session.draining.is_set():
                    self.mailbox.give_back(execution)  # a lapsed or unwanted claim: not ours to run
                    return
                await self._run_admitted(state, execution)
            finally:
                self.gate.release(execution)
        finally:
            with state.lock:
                state.attempts.pop(execution.key, None)
                state.tasks.pop(execution.key, None)
            state.cancelled.discard(execution.key)

    async def _db(self, function: Any) -> Any:
        """Run ``function`` on the loop's database threads."""

        def call() -> Any:
            try:
                return function()
            except Exception:
                close_old_connections()  # a broken connection is replaced on the next call
                raise

        return await sync_to_async(call, thread_sensitive=False)()

    async def _run_admitted(self, state: _Loop, execution: Execution) -> None:
        if not await self._begin(state, execution):
            return
        self.session.stats["started"] += 1
        try:
            outcome = await self._execute(state, execution)
        finally:
            self.slots.handler_returned(execution)
        self.pace.observe_async(clock.monotonic() - (execution.started or clock.monotonic()))
        if not self.ledger.finish(execution):
            self.zombies -= 1
            self.session.stats["late_results_dropped"] += 1
            log_attempt(
                logger,
                logging.WARNING,
                execution,
                "task %d: late result of an abandoned coroutine dropped",
                execution.id,
            )
            return
        why = execution.cancelled_by_worker
        if why == "lost":
            self.mailbox.hand_back_later(execution, f"cancelled: the lease was lost ({execution.lost_reason})")
            return
        if why == "shutdown":
            return  # the shutdown handed it back before cancelling
        if why == "blocked":
            # Its loop was replaced and cancelled it, and it ended before the watchdog could abandon
            # it (which then leaves it to us): a neighbour, uncharged like the ones the watchdog took.
            self.mailbox.hand_back_later(execution, "handed back: the event loop it ran on was replaced")
            return
        self.mailbox.deliver(outcome)

    async def _begin(self, state: _Loop, execution: Execution) -> bool:
        """The attempt begun (its start recorded first where it must be); False when it is not to run."""
        rated = rate_limited(execution.task)
        if execution.task.suspect or rated:
            # As on a thread: the start is recorded (a rate-limited one taken or refused) before the
            # handler runs (an async attempt never runs isolated: isolated tasks go to the threads).
            started = await self._db(
                lambda: retrying(
                    "taking a rate-limited start" if rated else "recording a start",
                    self.session,
                    lambda: take_start(self.session, execution, rated=rated, isolated=False),
                )
            )
            with state.lock:
                if state.retired:
                    return False  # the watchdog handed it back while the marker was on its way
                if isinstance(started, RateRefused):
                    self.mailbox.refused(execution, started)
                    return False
                if started is None:
                    execution.mark_lost("the claim lapsed before it could start")
                    self.mailbox.give_back(execution)
                    return False
                execution.begin(started)
                # Before the ledger counts it running: from then on the dispatcher may end its span.
                tracing.start_attempt(execution, "async")
                self.ledger.begin(execution)
        else:
            with state.lock:
                if state.retired:
                    return False
                now = time.time()
                execution.begin_local(now)
                tracing.start_attempt(execution, "async")
                self.mailbox.started(execution)  # before the ledger counts it running, as in threads.py
                self.ledger.begin(execution)
        return True

    async def _execute(self, state: _Loop, execution: Execution) -> Outcome:
        # Each asyncio task runs in a copy of the context: this attempt is what current_task() returns
        # in this coroutine (and in what it awaits or runs through sync_to_async), and only there.
        _set_current(execution)
        traced = tracing.enter(execution) if execution.span is not None else None
        target = None
        try:
            target = self.resolve(execution.task.task_path, api_origin=execution.task.api_origin)
            value = await handlers.acall(target, execution)
        except BaseException as exc:
            self._check_orm_connections(state)
            return handlers.failure_outcome(execution, exc, target)
        finally:
            if traced is not None:
                tracing.leave(traced)
            _set_current(None)
        return handlers.value_outcome(execution, value)

    def _check_orm_connections(self, state: _Loop) -> None:
        """After an attempt that raised, check the connections of the thread Django's async ORM runs
        on (asgiref's one thread-sensitive thread, shared by every coroutine): one that met a database
        error and is no longer usable (the server dropped it: a restart, a failover, a pooler's
        timeout) is closed. Executor threads close theirs after every attempt; the ORM thread's
        connection otherwise lives on, and once dropped it would fail every later ORM call of every
        coroutine until the process restarts. Queued, not awaited: it runs on that thread
        before the ORM calls queued after it, and the outcome is not held up behind a long call of
        another coroutine on that thread. Only after a failure: a hop per attempt would cost every
        coroutine, and an attempt that meets a dropped connection raises."""
        check = asyncio.ensure_future(sync_to_async(handlers.close_broken_connections, thread_sensitive=True)())
        state.checks.add(check)
        check.add_done_callback(state.checks.discard)

    # -- the watchdog -------------------------------------------------------------------------------

    def _watch(self) -> None:
        interval = min(1.0, self.block_limit / 4)
        while not self._stopping.wait(interval):
            state = self._current
            if state is None:
                continue
            seen = state.tick
            if clock.monotonic() - seen <= self.block_limit:
                continue
            # A pause of the whole process (SIGSTOP, a starved or suspended machine) looks the same
            # from here, and this thread may wake before the loop's: the loop is blocked only if it
            # still does not tick once both can run. Replacing a paused loop would abandon a coroutine
            # that blocked nothing and hand its neighbours back.
            if self._stopping.wait(min(1.0, self.block_limit / 2)):
                return
            if state.tick == seen and not state.retired:
                self._replace(state, clock.monotonic() - seen)

    def _replace(self, state: _Loop, lag: float) -> None:
        with self._switch:
            with state.lock:
                state.retired = True
                attempts = list(state.attempts.values())
                tasks = dict(state.tasks)
            # The task the loop is inside of right now is the one not giving it back.
            holding = asyncio.current_task(state.loop)
            self._retired.append(state)
            self._current = self._new_loop()
        blocker = next((e for e in attempts if tasks.get(e.key) is holding and holding is not None), None)
        what = f"task {blocker.id} {blocker.task.task_path}" if blocker is not None else "code outside any task"
        logger.error(
            "worker %s: the event loop has not turned for %.1fs, blocked by %s; a new loop takes over"
            " (the loop's thread is in: %s)",
            self.session.id,
            lag,
            what,
            _where(state.thread),
            extra=blocker.log_fields() if blocker is not None else {"worker_id": self.session.id},
        )
        for execution in attempts:
            if execution.started is None:
                execution.mark_lost(f"handed back unstarted: the event loop was blocked by {what}")
                self.mailbox.give_back(execution)
                continue
            if not self.ledger.abandon(execution):
                continue  # it finished meanwhile
            self.zombies += 1
            self.gate.release(execution)
            execution.cancelled_by_worker = "blocked"
            if execution is blocker:
                reason = f"blocked the event loop for {lag:.1f}s (a blocking call in async code): abandoned"
                execution.mark_lost(reason)
                error = EventLoopBlocked(f"task {execution.id} {reason}")
                self.session.stats["timed_out"] += 1
                self.mailbox.deliver(
                    Outcome(execution, failure=handlers.failure_from(execution, error), error=error), wake=False
                )
            else:
                reason = f"handed back: the event loop it ran on was blocked by {what}"
                execution.mark_lost(reason)
                self.mailbox.hand_back_later(execution, reason)
        self.mailbox.wake()
        if self.blocked_loops >= MAX_BLOCKED_LOOPS:
            logger.error(
                "worker %s: %d event loops blocked at once; stopping so that a supervisor restarts a clean process",
                self.session.id,
                self.blocked_loops,
            )
            self.request_stop()

    @staticmethod
    def _close_orm_connections() -> None:
        """At stop: close the connections of the async ORM's thread (asgiref's thread-sensitive
        thread, which outlives the worker when it runs in a caller's process: ``call_command``)."""
        try:
            SyncToAsync.single_thread_executor.submit(connections.close_all).result(timeout=2.0)
        except Exception:
            logger.debug("closing the async ORM thread's connections failed", exc_info=True)

    @staticmethod
    def _close_pool_connections(state: _Loop) -> None:
        """Close the connections of the pool's threads: one close on each thread, met at a barrier."""
        barrier = threading.Barrier(state.db_threads)

        def close() -> None:
            with suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=1.0)
            connections.close_all()

        try:
            futures = [state.pool.submit(close) for _ in range(state.db_threads)]
        except RuntimeError:
            return  # already shut down
        for future in futures:
            try:
                future.result(timeout=2.0)
            except Exception:
                logger.debug("closing an async database thread's connection failed", exc_info=True)
