"""Running tasks inside a test, in this thread, on its own database connection: the worker's claim,
start, handler call and finish, one attempt at a time.

A worker runs handlers on threads of their own, each with its own connection: inside a Django
``TestCase`` they would never see the rows the test wrote (its transaction is not committed). This
runner sends the worker's own statements (``Task.objects.claim`` / ``start`` / ``complete_many`` /
``fail_many``: CLAIM_SQL, START_SQL, COMPLETE_SQL, FAIL_SQL) on the calling thread's connection, and
turns what a handler returns or raises into an outcome with the worker's own code
(:mod:`tasks.worker.handlers`: retry policies, snooze, cancel, discard, unstorable results). So a task
run here ends exactly as on a worker: the same columns, the same error entries, the same retries, the
workflow steps it releases, django.tasks' ``task_started`` and ``task_finished`` signals.

What it does not do: run handlers concurrently, heartbeat (its lease is long instead: nothing else
claims in a test), or stop a handler that overruns its timeout (the attempt is recorded as timed out
when it returns, as a worker records one it abandoned).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.functions import Now
from psycopg import pq

from leasing import clock
from tasks.exceptions import TaskError, TaskTimeout
from tasks.models import WAITING, ClaimedTask, RateRefused, Task, TaskStatus
from tasks.runtime import Execution, _set_current
from tasks.worker import handlers
from tasks.worker.handlers import HandlerCache
from tasks.worker.identity import default_worker_name, incarnation_id
from tasks.worker.ledger import Outcome
from tasks.worker.session import rate_limited
from tasks.worker.signals import finished_result, send_finished

logger = logging.getLogger("tasks.testing")

#: The lease an inline attempt is claimed under, seconds. Nothing heartbeats it (one thread runs the
#: test and the handler), so it must outlast any handler a test runs.
INLINE_TTL = 3600.0
#: Attempts one call may run before it stops and raises :class:`RunLimitReached`: a task that
#: enqueues itself (or snoozes, with ``with_scheduled``) must fail the test, not hang it.
DEFAULT_LIMIT = 1000


@dataclass(frozen=True, slots=True)
class Drained:
    """What a run did, by how each attempt ended: ``succeeded``; ``failed`` (FAILED for good: out of
    attempts, discarded, not retryable); ``retried`` (failed, will run again after its backoff);
    ``snoozed``; ``cancelled`` (its handler raised Cancel); ``rejected`` (its outcome was refused:
    the task was cancelled or taken from under it while it ran). ``task_ids``: the task of each
    attempt, in the order they ran."""

    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    snoozed: int = 0
    cancelled: int = 0
    rejected: int = 0
    #: Starts a rate key refused (docs/howto/rate-limits.md): handed back uncharged, to run when the
    #: key's window has room, as on a worker; a run does not wait for them.
    rate_refused: int = 0
    task_ids: tuple[int, ...] = ()

    @property
    def attempts(self) -> int:
        return len(self.task_ids)

    def __add__(self, other: Drained) -> Drained:
        return Drained(
            succeeded=self.succeeded + other.succeeded,
            failed=self.failed + other.failed,
            retried=self.retried + other.retried,
            snoozed=self.snoozed + other.snoozed,
            cancelled=self.cancelled + other.cancelled,
            rejected=self.rejected + other.rejected,
            rate_refused=self.rate_refused + other.rate_refused,
            task_ids=self.task_ids + other.task_ids,
        )

    @classmethod
    def of(cls, ends: list[tuple[int, str]]) -> Drained:
        counts = Counter(end for _id, end in ends)
        return cls(
            succeeded=counts["succeeded"],
            failed=counts["failed"],
            retried=counts["retried"],
            snoozed=counts["snoozed"],
            cancelled=counts["cancelled"],
            rejected=counts["rejected"],
            rate_refused=counts["rate_refused"],
            task_ids=tuple(task_id for task_id, _end in ends),
        )


class RunLimitReached(TaskError):
    """Tasks were still runnable after the run's limit of attempts (a task that enqueues itself, a
    handler that always snoozes under ``with_scheduled``)."""

    def __init__(self, message: str, drained: Drained) -> None:
        super().__init__(message)
        #: What the run did before it stopped.
        self.drained = drained


class InlineExecution(Execution):
    """An attempt run on the test's own connection: a checkpoint is written there too (a worker's
    goes through a connection of its own when the handler is inside a transaction, which here would
    not see the uncommitted task row)."""

    def checkpoint(self, progress: Any) -> bool:
        saved = Task.objects.db_manager(self.using).checkpoint(self.id, self.worker_id, self.token, progress)
        if saved:
            self.progress = progress
        else:
            self.mark_lost("checkpoint rejected: the task is no longer ours")
        return saved

    async def acheckpoint(self, progress: Any) -> bool:
        from asgiref.sync import sync_to_async

        # thread_sensitive: back on the test's thread (async_to_sync runs the handler's loop beside
        # it), whose connection holds the test's transaction.
        return await sync_to_async(self.checkpoint, thread_sensitive=True)(progress)


class InlineRunner:
    """Runs claimed attempts one at a time on the calling thread's connection to ``using``."""

    def __init__(self, using: str = DEFAULT_DB_ALIAS, *, ttl: float = INLINE_TTL) -> None:
        self.using = using
        self.ttl = ttl
        self.worker_id = incarnation_id(f"inline:{default_worker_name()}")
        self.resolve = HandlerCache()

    @property
    def tasks(self) -> Any:
        return Task.objects.db_manager(self.using)

    def run(self, claimed: ClaimedTask) -> str:
        """Start, call and finish one claimed attempt; returns how it ended (a :class:`Drained` field)."""
        execution = InlineExecution(claimed, self.worker_id, self.ttl, clock.monotonic(), self.using)
        if rate_limited(claimed):
            # As a worker's executor does: the start is taken from the key's window, shared with
            # every worker (runs here had bypassed it).
            started = self.tasks.rate_start(claimed.id, self.worker_id, claimed.token, queue=claimed.queue)
            if isinstance(started, RateRefused):
                return "rate_refused"
        else:
            started = self.tasks.start(claimed.id, self.worker_id, claimed.token)
        if started is None:  # only if the test changed the row between the claim and now
            return "rejected"
        execution.begin(started)
        outcome = self._call(execution)
        return self._finish(execution, outcome)

    def _call(self, execution: Execution) -> Outcome:
        task = execution.task
        connection = connections[self.using]
        # Inside the test's transaction a handler's database error would break it for the rest of the
        # test: the handler runs under a savepoint, rolled back only then (its other writes stay, as
        # they would have been committed one by one on a worker).
        savepoint = connection.savepoint() if connection.in_atomic_block else None
        target = None
        began = time.monotonic()
        _set_current(execution)
        try:
            target = self.resolve(task.task_path, api_origin=task.api_origin)
            outcome = handlers.value_outcome(execution, handlers.call(target, execution))
        except KeyboardInterrupt:
            raise  # the person running the tests stops them; the transaction goes with the test
        except BaseException as exc:  # invariant 9: whatever the handler raises is its attempt's outcome
            outcome = handlers.failure_outcome(execution, exc, target)
        finally:
            _set_current(None)
            if savepoint is not None:
                _end_savepoint(connection, savepoint)
        if task.timeout is not None and time.monotonic() - began > task.timeout:
            # A worker would have abandoned it at its timeout and refused its late result.
            timed_out = TaskTimeout(f"task {execution.id} ran past its timeout of {task.timeout:g}s")
            failure = handlers.with_policy(
                handlers.failure_from(execution, timed_out), execution, timed_out, target, backoff=False
            )
            outcome = Outcome(execution, failure=failure, error=timed_out)
        return outcome

    def _finish(self, execution: Execution, outcome: Outcome) -> str:
        key = execution.key
        if outcome.ok:
            accepted = self.tasks.complete_many(
                self.worker_id, [(execution.id, execution.token, outcome.value_json or "null")]
            )
            end, stored = ("succeeded", TaskStatus.SUCCESSFUL) if key in accepted else ("rejected", None)
        else:
            failure = outcome.failure
            assert failure is not None
            result = self.tasks.fail_many(self.worker_id, [failure]).get(key)
            stored = None if result is None else result.status
            if result is None:
                end = "rejected"
            elif failure.kind in ("snooze", "cancel"):
                end = "snoozed" if failure.kind == "snooze" else "cancelled"
            elif result.retried:
                end = "retried"
            else:
                end = "failed"  # discarded ones too: FAILED for good
        logger.debug("inline attempt of task %d %s: %s", execution.id, execution.task.task_path, end)
        if execution.django is not None:
            self._signal_finished(execution, stored, outcome)
        return end

    def _signal_finished(self, execution: Execution, stored: str | None, outcome: Outcome) -> None:
        """django.tasks' ``task_finished``, on this thread, with the row as the attempt left it."""
        row = self.tasks.filter(pk=execution.id).first()
        try:
            result = finished_result(execution, row, stored, outcome)
            send_finished(execution.django.sender, result, outcome.error)
        except Exception:  # receivers are user code: a worker logs their errors and goes on; so does this
            logger.exception("task %d: a task_finished receiver failed", execution.id)


def _end_savepoint(connection: BaseDatabaseWrapper, savepoint: str) -> None:
    broken = connection.needs_rollback
    raw = connection.connection
    if raw is not None and raw.info.transaction_status == pq.TransactionStatus.INERROR:
        broken = True
    if broken:
        connection.needs_rollback = False  # as Django's atomic() does before it rolls back its savepoint
        connection.savepoint_rollback(savepoint)
    else:
        connection.savepoint_commit(savepoint)


def _queues_with_ready_tasks(using: str) -> list[str]:
    return sorted(set(Task.objects.using(using).ready().order_by().values_list("queue", flat=True).distinct()))


def run_until_empty(
    queues: Sequence[str] | None = None,
    *,
    using: str = DEFAULT_DB_ALIAS,
    with_scheduled: bool = False,
    limit: int = DEFAULT_LIMIT,
    ttl: float = INLINE_TTL,
) -> Drained:
    """Run the due tasks of ``queues`` (None: every queue) on this thread until none is left, with the
    worker's statements and handler code, and say how each attempt ended.

    Works inside a ``TestCase``'s transaction: everything happens on the test's connection. A task's
    retry waits for its backoff as on a worker, so it is not run again here unless ``with_scheduled``
    is true: then waiting tasks (backed off, deferred with ``run_after``, snoozed) are made due now
    (``Task.objects.retry_now()``) before each claim, and run too. Workflow steps a finished task
    releases run in the same call. Paused queues are left alone, as a worker leaves them.

    Raises :class:`RunLimitReached` (with what ran, ``.drained``) once ``limit`` attempts have run and
    a task is still runnable."""
    if isinstance(queues, str):
        raise TypeError("queues is a list of queue names, not one string")
    if limit < 1:
        raise ValueError("limit must be at least 1")
    runner = InlineRunner(using, ttl=ttl)
    ends: list[tuple[int, str]] = []
    names = list(queues) if queues is not None else []
    while True:
        if with_scheduled:
            # Not the starts a rate key refused in this run: made due, they would be refused again.
            refused = [task_id for task_id, end in ends if end == "rate_refused"]
            runner.tasks.filter(status__in=WAITING, run_after__gt=Now()).exclude(pk__in=refused).retry_now()
        claimed = runner.tasks.claim(runner.worker_id, limit=1, queues=names, ttl=ttl) if names else []
        if not claimed:
            if queues is None:
                # Every queue: those with READY tasks, looked up again only when a claim comes back
                # empty (a handler may have enqueued into a queue not seen yet).
                found = set(_queues_with_ready_tasks(using)) - set(names)
                if found:
                    names = sorted({*names, *found})
                    continue
            return Drained.of(ends)
        if len(ends) >= limit:
            runner.tasks.hand_back(runner.worker_id, [claimed[0].key], reason="the inline run reached its limit")
            drained = Drained.of(ends)
            raise RunLimitReached(
                f"tasks were still runnable after {limit} attempts (a task that enqueues itself, or snoozes "
                f"forever?); the last one ran: {claimed[0].task_path}",
                drained,
            )
        ends.append((claimed[0].id, runner.run(claimed[0])))


__all__ = ["DEFAULT_LIMIT", "INLINE_TTL", "Drained", "InlineRunner", "RunLimitReached", "run_until_empty"]
