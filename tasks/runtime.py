"""What a running task sees of its own claim: attempt, fencing token, checkpoints, loss.

from tasks.runtime import current_task

def import_rows(path):
    run = current_task()
    start = (run.progress or {}).get("row", 0)     # resume from the last checkpoint
    for n, row in enumerate(read(path)[start:], start):
        run.check()                                 # raises TaskLeaseLost once the claim is gone
        save(row, fence=run.token)
        if n % 1000 == 0:
            run.checkpoint({"row": n})

From an ``async def`` handler (run on the worker's event loop) the same object is there, one per
coroutine (a context variable, not a thread-local), with ``await run.acheckpoint(...)``.
"""

from __future__ import annotations

import datetime as dt
from contextvars import ContextVar
from typing import Any

from django.db import connections

from leasing import clock
from tasks.exceptions import Cancel, Discard, Snooze, TaskLeaseLost
from tasks.lifecycle.policy import RetryPolicy, retry_policy
from tasks.models import ClaimedTask, Started, Task

# A context variable rather than a thread-local: each coroutine on the worker's event loop is its own
# context and sees its own attempt, a thread sees the one its executor set, and code a handler runs
# through sync_to_async / async_to_sync inherits it (asgiref copies the context across).
_current: ContextVar[Execution | None] = ContextVar("tasks_current_execution", default=None)


class Execution:
    """One attempt of one task in this process, identified by its key: (task id, fencing token).

    States: claimed (held, not begun) -> running (START committed, handler called) -> done
    (outcome handed to the writer). ``lost`` (the claim is gone or may be gone) and ``abandoned``
    (past its timeout: no longer heartbeated, its late result dropped) can happen at any point.
    """

    def __init__(
        self, task: ClaimedTask, worker_id: str, ttl: float, claimed_at: float, using: str = "default"
    ) -> None:
        self.task = task
        self.key: tuple[int, int] = (task.id, task.token)
        self.worker_id = worker_id
        self.using = using
        self.claimed_at = claimed_at
        self.started: float | None = None  # local clock at START; None until the attempt began
        # Local deadline: the claim statement was sent at ``claimed_at``; the lease ends ttl later at
        # the latest. Used to give up early, never to hold longer.
        self.deadline = claimed_at + ttl
        # A plain flag (set once, never cleared; one attribute write is atomic under the GIL): an
        # Event here cost a Condition and a lock per claimed task on the dispatcher's hot path.
        self._lost = False
        self.lost_reason: str | None = None
        self.abandoned = False
        self.finished = False  # the handler returned; its outcome waits for the writer
        # Its outcome's write waits for a lock another session holds (a row, or a workflow's settle lock
        # held by an operator's open transaction): heartbeated until written, however long that takes.
        self.write_waits = False
        # For a key slot kept past the row (tasks/lifecycle/concurrency.py): the handler function or coroutine
        # has returned, and the threads a coroutine handed work to that still run (tasks/worker/aio.py).
        self.handler_done = False
        self.threads = 0
        self.finished_at = 0.0  # local clock when it finished
        self.gate_slot: str | None = None  # "shared" / "exclusive" while it holds the isolation gate
        self.progress: Any = task.progress
        # Durable steps (tasks/steps.py): the task's stored steps, read at this attempt's first step,
        # and the position of the next step the handler calls.
        self.steps: dict[int, tuple[str, str | None]] | None = None
        self.step_position = 0
        self.attempt = task.attempts  # the attempt number once START charged it
        # The claim does not read the task's start times (fewer columns on the hot path); a start
        # marker that returns them fills these in.
        self._started_at: dt.datetime | None = None
        self._attempted_epoch: float | None = None  # when this attempt began (epoch seconds)
        self._attempted_at: dt.datetime | None = None
        self._stalled_until = 0.0
        #: A django.tasks Task's attempt: what its signals carry (:class:`tasks.backends.DjangoRun`).
        self.django: Any = None
        #: Runs on the worker's event loop (an ``async def`` handler) rather than an executor thread.
        self.is_async = False
        #: Why the worker cancelled this attempt's coroutine ("timeout", "lost", "shutdown", "blocked").
        self.cancelled_by_worker: str | None = None
        #: The attempt's OpenTelemetry span while tracing is on (tasks/tracing.py): opened as the handler
        #: begins, ended when the outcome is recorded (by the dispatcher's thread). None otherwise.
        self.span: Any = None

    @property
    def started_epoch(self) -> float | None:
        """When the handler was called, in epoch seconds (what a folded start marker records)."""
        if self._attempted_epoch is None and self._attempted_at is not None:
            return self._attempted_at.timestamp()
        return self._attempted_epoch

    @property
    def last_attempted_at(self) -> dt.datetime | None:
        """When this attempt began (the task's ``last_attempted_at`` once its start is recorded)."""
        if self._attempted_epoch is not None:
            return dt.datetime.fromtimestamp(self._attempted_epoch, dt.timezone.utc)
        return self._attempted_at

    @property
    def started_at(self) -> dt.datetime | None:
        """When the task's first attempt began."""
        return self._started_at or self.last_attempted_at

    @property
    def id(self) -> int:
        return self.task.id

    def log_fields(self, outcome: str | None = None) -> dict[str, Any]:
        """The ``extra`` fields of a log record about this attempt (:func:`task_log_fields`)."""
        return task_log_fields(self.task.id, self.task.queue, self.attempt, self.worker_id, outcome)

    @property
    def token(self) -> int:
        return self.task.token

    def begin(self, started: Started) -> None:
        """The start marker committed before the handler runs (a suspect task)."""
        self.started = clock.monotonic()
        self.attempt = started.attempt
        self._started_at = started.started_at
        self._attempted_at = started.last_attempted_at

    def begin_local(self, now: float) -> None:
        """The handler runs now (``now``: epoch seconds); the start marker follows in the dispatcher's
        next round. The claim holds the row for us, so the attempt number it will charge is known."""
        self.started = clock.monotonic()
        self.attempt = self.task.attempts + 1
        # Whole microseconds: the start marker stores it with PostgreSQL's to_timestamp() while the
        # attempt's TaskResult converts it with datetime.fromtimestamp(); for a float with more digits
        # the two rounded a half microsecond differently (1 µs apart, once in a few hundred starts).
        # The marker sends this rounded value too (Mailbox.started reads it back), never the raw one.
        self._attempted_epoch = round(now, 6)

    @property
    def lost(self) -> bool:
        if not self._lost and clock.monotonic() >= self.deadline:
            self.mark_lost("the lease ran out without a successful heartbeat")
        return self._lost

    def mark_lost(self, reason: str) -> None:
        if not self._lost:
            self.lost_reason = reason
            self._lost = True

    def renewed(self, sent: float, ttl: float) -> None:
        """A heartbeat sent at ``sent`` (local clock) renewed the lease for ``ttl`` seconds."""
        self.deadline = max(self.deadline, sent + ttl)

    def check(self) -> None:
        if self.lost:
            raise TaskLeaseLost(f"task {self.id} is no longer held by this worker: {self.lost_reason}")

    def checkpoint(self, progress: Any) -> bool:
        """Save ``progress`` (JSON) on the task row; a retry of the task starts from it.

        Returns False (and marks the execution lost) when the claim is no longer ours. Raises
        :class:`~tasks.exceptions.UnstorableResult` (a ValueError) for progress jsonb cannot hold.
        """
        connection = connections[self.using]
        if connection.in_atomic_block:
            # Inside the handler's own transaction the checkpoint would hold the task's row lock
            # until the handler commits, and the worker's heartbeat and finish could not touch the
            # row meanwhile; it would also vanish on rollback. Write it on a connection of its own.
            dedicated = connections.create_connection(self.using)
            try:
                saved = Task.objects.db_manager(self.using).checkpoint_on(
                    dedicated, self.id, self.worker_id, self.token, progress
                )
            finally:
                dedicated.close()
        else:
            saved = Task.objects.db_manager(self.using).checkpoint(self.id, self.worker_id, self.token, progress)
        if saved:
            self.progress = progress
        else:
            self.mark_lost("checkpoint rejected: the task is no longer ours")
        return saved

    async def acheckpoint(self, progress: Any) -> bool:
        """:meth:`checkpoint` from async code: the same one statement, sent from the worker's small
        pool of database threads (``sync_to_async(thread_sensitive=False)`` runs on the event loop's
        default executor, which the async executor bounds), never from a connection per coroutine."""
        from asgiref.sync import sync_to_async
        from django.db import close_old_connections

        def checkpoint() -> bool:
            try:
                return self.checkpoint(progress)
            except Exception:
                close_old_connections()  # a pool thread's broken connection is replaced next time
                raise

        return await sync_to_async(checkpoint, thread_sensitive=False)()

    # -- fault injection ------------------------------------------------------------------------

    def miss_heartbeats(self, seconds: float) -> None:
        """Fault injection (the demo's latency spike): the worker leaves this attempt out of its
        heartbeats for ``seconds``, as if this task alone had stalled, so its lease can lapse and
        another worker take the task over while the rest of the process carries on."""
        self._stalled_until = clock.monotonic() + seconds

    @property
    def heartbeat_paused(self) -> bool:
        return clock.monotonic() < self._stalled_until


#: The ``extra`` fields every log record about a task carries (the worker's ``tasks.worker`` records and
#: the recovery's ``tasks.maintenance.recovery`` ones; docs/howto/production.md, "Structured logs").
#: ``outcome`` only on the record that ends an attempt.
LOG_FIELDS = ("task_id", "queue", "attempt", "worker_id", "outcome")


def task_log_fields(
    task_id: int, queue: str, attempt: int, worker_id: str | None, outcome: str | None = None
) -> dict[str, Any]:
    """A log record's ``extra`` about one attempt of a task (:data:`LOG_FIELDS`)."""
    fields: dict[str, Any] = {"task_id": task_id, "queue": queue, "attempt": attempt, "worker_id": worker_id}
    if outcome is not None:
        fields["outcome"] = outcome
    return fields


#: What a handler may raise to decide its attempt's outcome, and the decorator of its retry policy.
__all__ = ["Cancel", "Discard", "Execution", "RetryPolicy", "Snooze", "current_task", "retry_policy"]


def current_task() -> Execution:
    """The execution running in this thread or coroutine (inside a task handler)."""
    execution = _current.get()
    if execution is None:
        raise RuntimeError("current_task() is only available inside a task run by a worker")
    return execution


def _set_current(execution: Execution | None) -> None:
    _current.set(execution)
