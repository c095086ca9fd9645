"""The task queue: a task's lease lives on its own row, so claim, heartbeat and finish are each one
statement (see ../shared/DESIGN.md, "Statement shapes").

Status names follow ``django.tasks.TaskResultStatus`` (READY, RUNNING, SUCCESSFUL, FAILED) plus
CANCELLED. A failed attempt that will be retried goes back to READY with a later ``run_after``;
FAILED is terminal ("dead": out of attempts, or not retryable), with every attempt's error kept.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from django.db import IntegrityError, connections, models
from django.db.models import Q
from django.db.models.functions import Now

from leasing.fencing import FencedModel
from leasing.models import GRANT_SET, LeaseFields, LeaseStateQuerySet, seconds
from tasks.conf import get_settings
from tasks.exceptions import TaskError

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

NOTIFY_CHANNEL = "leasing_tasks"


class TaskStatus(models.TextChoices):
    READY = "READY", "Ready"
    RUNNING = "RUNNING", "Running"
    SUCCESSFUL = "SUCCESSFUL", "Successful"
    FAILED = "FAILED", "Failed"
    CANCELLED = "CANCELLED", "Cancelled"


UNFINISHED = (TaskStatus.READY, TaskStatus.RUNNING)
FINISHED = (TaskStatus.SUCCESSFUL, TaskStatus.FAILED, TaskStatus.CANCELLED)


@dataclass(frozen=True, slots=True)
class ClaimedTask:
    """One task handed to a worker: its id and the fencing token that proves the claim."""

    id: int
    token: int
    task_path: str
    args: list[Any]
    kwargs: dict[str, Any]
    attempts: int
    max_attempts: int
    progress: Any
    expires_at: dt.datetime
    timeout: float | None
    queue: str
    priority: int
    enqueued_at: dt.datetime
    worker_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Enqueued:
    id: int
    created: bool  # False: an unfinished task with the same dedup key already existed


@dataclass(frozen=True, slots=True)
class FailOutcome:
    id: int
    status: str  # READY (will be retried at run_after) or FAILED (terminal)
    run_after: dt.datetime


@dataclass(frozen=True, slots=True)
class Recovered:
    id: int
    status: str
    expired_for: float | None  # seconds from lease expiry to requeue (None: it had no lease at all)


@dataclass(frozen=True, slots=True)
class Failure:
    """What a worker reports for a failed attempt."""

    id: int
    token: int
    exception_class_path: str
    message: str
    traceback: str = ""
    retry: bool = True

    def as_json(self) -> str:
        return json.dumps(
            {
                "exception_class_path": self.exception_class_path,
                "message": self.message,
                "traceback": self.traceback,
            }
        )


def _json(value: Any) -> Any:
    # Django registers a text loader for jsonb, so raw cursors see JSON as strings.
    return json.loads(value) if isinstance(value, str) else value


def _backoff_sql(exponent: str) -> str:
    """Capped exponential backoff with 50-100 % jitter, as an interval (computed in the database)."""
    return (
        "make_interval(secs => LEAST(%(backoff_max)s, %(backoff_base)s * power(2, GREATEST(" + exponent + ", 0)))"
        " * (0.5 + random() / 2))"
    )


_CLAIM_RETURNING = (
    "t.id, t.token, t.task_path, t.args, t.kwargs, t.attempts, t.max_attempts, t.progress, t.expires_at,"
    " t.timeout, t.queue, t.priority, t.enqueued_at, t.worker_ids"
)

INSERT_COLUMNS = (
    "queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts, max_attempts,"
    " timeout, dedup_key, errors, worker_ids, renewals, transitions"
)

ENQUEUE_SQL = f"""
INSERT INTO tasks_task ({INSERT_COLUMNS})
VALUES (%(queue)s, %(priority)s, %(task_path)s, %(args)s::jsonb, %(kwargs)s::jsonb, 'READY',
        COALESCE(%(run_after)s::timestamptz, statement_timestamp()), statement_timestamp(), 0, %(max_attempts)s,
        %(timeout)s, %(dedup_key)s, '[]'::jsonb, '[]'::jsonb, 0, 0)
ON CONFLICT (dedup_key) WHERE status IN ('READY', 'RUNNING') AND dedup_key IS NOT NULL DO NOTHING
RETURNING id
"""

BULK_ENQUEUE_SQL = f"""
INSERT INTO tasks_task ({INSERT_COLUMNS})
SELECT d.queue, d.priority, d.task_path, d.args, d.kwargs, 'READY', COALESCE(d.run_after, statement_timestamp()),
       statement_timestamp(), 0, d.max_attempts, d.timeout, NULL, '[]'::jsonb, '[]'::jsonb, 0, 0
FROM unnest(%(queue)s::text[], %(priority)s::smallint[], %(task_path)s::text[], %(args)s::jsonb[],
            %(kwargs)s::jsonb[], %(run_after)s::timestamptz[], %(max_attempts)s::int[], %(timeout)s::float8[])
     AS d(queue, priority, task_path, args, kwargs, run_after, max_attempts, timeout)
RETURNING id
"""

# The subquery picks and locks; SKIP LOCKED lets concurrent workers pick different rows without
# waiting. Its WHERE/ORDER BY match the partial index tasks_task_runnable_idx exactly, so the plan
# is an index scan over runnable rows only, however many finished rows the table holds.
CLAIM_SQL = f"""
UPDATE tasks_task AS t SET
    status = 'RUNNING',
    holder = %(worker)s::text,
    {GRANT_SET},
    transitions = t.transitions + 1,
    attempts = t.attempts + 1,
    started_at = COALESCE(t.started_at, clock_timestamp()),
    last_attempted_at = clock_timestamp(),
    worker_ids = t.worker_ids || jsonb_build_array(%(worker)s::text)
FROM (
    SELECT id FROM tasks_task
    WHERE status = 'READY' AND run_after <= statement_timestamp() AND queue = ANY(%(queues)s::text[])
    ORDER BY priority DESC, run_after, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
) AS picked
WHERE t.id = picked.id
RETURNING {_CLAIM_RETURNING}
"""

# One statement renews every task the worker still runs, and records the worker as alive.
HEARTBEAT_SQL = """
WITH renewed AS (
    UPDATE tasks_task
    SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
        renewed_at = clock_timestamp(),
        renewals = renewals + 1
    WHERE holder = %(worker)s AND id = ANY(%(ids)s::bigint[]) AND status = 'RUNNING'
      AND expires_at > clock_timestamp()
    RETURNING id, token
), seen AS (
    UPDATE tasks_worker SET last_seen_at = clock_timestamp(), running = %(running)s, stats = %(stats)s::jsonb
    WHERE id = %(worker)s
    RETURNING 1
)
SELECT id, token FROM renewed
"""

CHECKPOINT_SQL = """
UPDATE tasks_task SET progress = %(progress)s::jsonb, progress_at = clock_timestamp()
WHERE id = %(id)s AND holder = %(worker)s AND token = %(token)s AND status = 'RUNNING'
  AND expires_at > clock_timestamp()
"""

_OWNED = "t.id = d.id AND t.token = d.token AND t.holder = %(worker)s AND t.status = 'RUNNING'"
_LIVE = "t.expires_at > clock_timestamp()"

COMPLETE_SQL = f"""
UPDATE tasks_task AS t SET
    status = 'SUCCESSFUL',
    return_value = d.return_value,
    finished_at = clock_timestamp(),
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(values)s::jsonb[]) AS d(id, token, return_value)
WHERE {_OWNED} AND {_LIVE}
RETURNING t.id
"""

# The dispatcher's steady state in ONE statement (one round trip, one commit): finish the batch that
# just completed and claim the next one. The two CTEs touch disjoint rows (RUNNING rows of ours vs
# READY rows), and each finished row is still guarded by holder + token + RUNNING + live lease.
_COMPLETE_SET = """
    status = 'SUCCESSFUL',
    return_value = d.return_value,
    finished_at = clock_timestamp(),
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())"""
_CLAIM_BODY = CLAIM_SQL.strip().removeprefix("UPDATE tasks_task AS t SET").rsplit("RETURNING", 1)[0]
FINISH_AND_CLAIM_SQL = f"""
WITH finished AS (
    UPDATE tasks_task AS t SET {_COMPLETE_SET}
    FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(values)s::jsonb[]) AS d(id, token, return_value)
    WHERE {_OWNED} AND {_LIVE}
    RETURNING t.id
), claimed AS (
    UPDATE tasks_task AS t SET {_CLAIM_BODY}
    RETURNING {_CLAIM_RETURNING}
)
SELECT true, claimed.* FROM claimed
UNION ALL
SELECT false, finished.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM finished
"""

_RETRYABLE = "(d.retry AND t.attempts < t.max_attempts)"

FAIL_SQL = f"""
UPDATE tasks_task AS t SET
    status = CASE WHEN {_RETRYABLE} THEN 'READY' ELSE 'FAILED' END,
    run_after = CASE WHEN {_RETRYABLE} THEN clock_timestamp() + {_backoff_sql("t.attempts - 1")} ELSE t.run_after END,
    finished_at = CASE WHEN {_RETRYABLE} THEN NULL ELSE clock_timestamp() END,
    errors = t.errors || jsonb_build_array(
        d.error || jsonb_build_object('attempt', t.attempts, 'worker', t.holder, 'at', clock_timestamp())),
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(errors)s::jsonb[], %(retry)s::boolean[])
     AS d(id, token, error, retry)
WHERE {_OWNED} AND {_LIVE}
RETURNING t.id, t.status, t.run_after
"""

# Hand-back on graceful shutdown: runnable again at once, and the interrupted attempt is not counted.
HAND_BACK_SQL = f"""
UPDATE tasks_task AS t SET
    status = 'READY',
    run_after = LEAST(t.run_after, clock_timestamp()),  -- runnable at once, keeping its place
    attempts = GREATEST(t.attempts - 1, 0),
    errors = t.errors || jsonb_build_array(jsonb_build_object(
        'attempt', t.attempts, 'worker', t.holder, 'at', clock_timestamp(),
        'exception_class_path', 'tasks.exceptions.WorkerShutdown',
        'message', 'handed back by a worker shutting down; this attempt does not count', 'traceback', '')),
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS d(id, token)
WHERE {_OWNED}
RETURNING t.id
"""

_STILL_ALLOWED = "t.attempts < t.max_attempts"
# How often this task's holder died before: a poison pill that kills every worker it lands on backs
# off; a task that merely failed once (an exception, a database restart) does not lose its turn.
_PRIOR_RECOVERIES = (
    "(SELECT count(*) FROM jsonb_array_elements(t.errors) AS e"
    " WHERE e->>'exception_class_path' = 'tasks.exceptions.TaskLeaseLost')"
)

# Requeue tasks whose lease expired (their worker died or stalled) and running rows that have no
# lease at all (impossible states, repaired). A task's first recovery is immediate and keeps its
# place in the queue (run_after unchanged: a crash is not the task's fault, and behind a long backlog
# "runnable again" would otherwise mean "runs minutes later"); only a task whose holders died
# repeatedly backs off. Each recovered attempt's error records how long the lease had been expired.
RECOVER_SQL = f"""
UPDATE tasks_task AS t SET
    status = CASE WHEN {_STILL_ALLOWED} THEN 'READY' ELSE 'FAILED' END,
    run_after = CASE WHEN NOT {_STILL_ALLOWED} OR {_PRIOR_RECOVERIES} = 0 THEN LEAST(t.run_after, clock_timestamp())
                     ELSE clock_timestamp() + {_backoff_sql(_PRIOR_RECOVERIES + " - 1")} END,
    finished_at = CASE WHEN {_STILL_ALLOWED} THEN NULL ELSE clock_timestamp() END,
    errors = t.errors || jsonb_build_array(jsonb_build_object(
        'attempt', t.attempts, 'worker', t.holder, 'at', clock_timestamp(),
        'exception_class_path', 'tasks.exceptions.TaskLeaseLost',
        'message', CASE WHEN t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL
                        THEN 'orphan: running without a lease; repaired by recovery'
                        ELSE 'lease expired: the worker stopped heartbeating' END,
        'traceback', '',
        'expired_at', t.expires_at,
        'recovery_delay', EXTRACT(EPOCH FROM clock_timestamp() - t.expires_at),
        'silent_for', EXTRACT(EPOCH FROM clock_timestamp() - COALESCE(t.renewed_at, t.acquired_at)))),
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM (
    SELECT id FROM tasks_task
    WHERE status = 'RUNNING'
      AND (expires_at <= clock_timestamp() OR expires_at IS NULL OR holder IS NULL OR token IS NULL)
    ORDER BY expires_at NULLS FIRST
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
) AS picked
WHERE t.id = picked.id
RETURNING t.id, t.status, (t.errors -> -1 ->> 'recovery_delay')::float8
"""

# A lease left live on a row that is not running (it can only come from hand edits or a bug):
# release it, so the lease state querysets and the dashboard stay truthful.
RELEASE_STRAY_LEASES_SQL = """
UPDATE tasks_task SET released_at = clock_timestamp(), expires_at = LEAST(expires_at, clock_timestamp())
WHERE status <> 'RUNNING' AND released_at IS NULL AND expires_at IS NOT NULL
RETURNING id
"""

# Running tasks held by a worker that has already said it stopped: it will never heartbeat or
# finish them, so there is no reason to wait for the TTL. Expire them now; recovery requeues them.
EXPIRE_ORPHANS_SQL = """
UPDATE tasks_task AS t SET expires_at = clock_timestamp()
FROM tasks_worker AS w
WHERE t.status = 'RUNNING' AND t.holder = w.id AND w.stopped_at IS NOT NULL AND t.expires_at > clock_timestamp()
RETURNING t.id
"""


def _claimed_from_row(row: Sequence[Any]) -> ClaimedTask:
    return ClaimedTask(
        id=row[0],
        token=row[1],
        task_path=row[2],
        args=_json(row[3]),
        kwargs=_json(row[4]),
        attempts=row[5],
        max_attempts=row[6],
        progress=_json(row[7]),
        expires_at=row[8],
        timeout=row[9],
        queue=row[10],
        priority=row[11],
        enqueued_at=row[12],
        worker_ids=_json(row[13]),
    )


class TaskQuerySet(LeaseStateQuerySet["Task"]):
    """Task selection (chainable) and the queue's table-wide operations, one statement each."""

    # -- selection ------------------------------------------------------------------------

    def ready(self) -> Self:
        return self.filter(status=TaskStatus.READY)

    def runnable(self) -> Self:
        return self.filter(status=TaskStatus.READY, run_after__lte=Now())

    def running(self) -> Self:
        return self.filter(status=TaskStatus.RUNNING)

    def stuck(self) -> Self:
        """Running, but with no live lease: the worker died or stalled and recovery has not run yet."""
        return self.filter(status=TaskStatus.RUNNING).filter(
            Q(expires_at__lte=Now()) | Q(expires_at__isnull=True) | Q(holder__isnull=True)
        )

    def finished(self) -> Self:
        return self.filter(status__in=FINISHED)

    def unfinished(self) -> Self:
        return self.filter(status__in=UNFINISHED)

    # -- plumbing -------------------------------------------------------------------------

    @property
    def _connection(self) -> BaseDatabaseWrapper:
        return connections[self.db]

    def _rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        with self._connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall() if cursor.description else []

    # -- enqueue --------------------------------------------------------------------------

    def enqueue(
        self,
        task_path: str,
        *,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        queue: str = "default",
        priority: int = 0,
        run_after: dt.datetime | None = None,
        max_attempts: int | None = None,
        timeout: float | None = None,
        dedup_key: str | None = None,
    ) -> Enqueued:
        """Insert one task (one statement). With ``dedup_key``, an unfinished task with the same
        key is returned instead of a new one (``created`` is False)."""
        attempts = get_settings().MAX_ATTEMPTS if max_attempts is None else max_attempts
        _validate(queue=queue, priority=priority, max_attempts=attempts, timeout=timeout)
        params: dict[str, Any] = {
            "queue": queue,
            "priority": priority,
            "task_path": task_path,
            "args": json.dumps(list(args)),
            "kwargs": json.dumps(kwargs or {}),
            "run_after": run_after,
            "max_attempts": attempts,
            "timeout": timeout,
            "dedup_key": dedup_key,
        }
        while True:
            rows = self._rows(ENQUEUE_SQL, params)
            if rows:
                return Enqueued(rows[0][0], True)
            # Only on a duplicate: the unfinished task that holds the key (unless it just finished).
            existing = self.unfinished().filter(dedup_key=dedup_key).values_list("id", flat=True).first()
            if existing is not None:
                return Enqueued(existing, False)

    def bulk_enqueue(
        self,
        task_path: str,
        kwargs_list: Iterable[dict[str, Any]],
        *,
        queue: str = "default",
        priority: int = 0,
        run_after: dt.datetime | None = None,
        max_attempts: int | None = None,
        timeout: float | None = None,
        chunk_size: int = 5000,
    ) -> list[int]:
        """Insert many tasks of one kind: one multi-row statement per ``chunk_size`` tasks."""
        attempts = get_settings().MAX_ATTEMPTS if max_attempts is None else max_attempts
        _validate(queue=queue, priority=priority, max_attempts=attempts, timeout=timeout)
        ids: list[int] = []
        chunk: list[str] = []

        def flush() -> None:
            n = len(chunk)
            params = {
                "queue": [queue] * n,
                "priority": [priority] * n,
                "task_path": [task_path] * n,
                "args": ["[]"] * n,
                "kwargs": chunk,
                "run_after": [run_after] * n,
                "max_attempts": [attempts] * n,
                "timeout": [timeout] * n,
            }
            ids.extend(row[0] for row in self._rows(BULK_ENQUEUE_SQL, params))
            chunk.clear()

        for kwargs in kwargs_list:
            chunk.append(json.dumps(kwargs))
            if len(chunk) >= chunk_size:
                flush()
        if chunk:
            flush()
        return ids

    # -- the worker's hot path --------------------------------------------------------------

    def claim(
        self, worker: str, *, limit: int = 1, queues: Sequence[str] = ("default",), ttl: float | None = None
    ) -> list[ClaimedTask]:
        """Claim up to ``limit`` runnable tasks for ``worker`` under a lease of ``ttl`` seconds."""
        params = {
            "worker": worker,
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "queues": list(queues),
            "limit": limit,
        }
        claimed = [_claimed_from_row(row) for row in self._rows(CLAIM_SQL, params)]
        claimed.sort(key=lambda task: (-task.priority, task.id))
        return claimed

    def heartbeat(
        self,
        worker: str,
        held: dict[int, int],
        *,
        ttl: float | None = None,
        stats: dict[str, Any] | None = None,
    ) -> set[int]:
        """Renew every task in ``held`` (id -> token) in one statement; return the ids LOST.

        A task is lost when its row no longer has this worker, this token, RUNNING and a live lease.
        """
        params = {
            "worker": worker,
            "ids": list(held),
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "running": len(held),
            "stats": json.dumps(stats or {}),
        }
        renewed = {task_id for task_id, token in self._rows(HEARTBEAT_SQL, params) if held.get(task_id) == token}
        return set(held) - renewed

    def checkpoint(self, task_id: int, worker: str, token: int, progress: Any) -> bool:
        """Store ``progress`` (JSON) as the task's last checkpoint; False if the task is no longer ours."""
        params: dict[str, Any] = {"id": task_id, "worker": worker, "token": token, "progress": json.dumps(progress)}
        with self._connection.cursor() as cursor:
            cursor.execute(CHECKPOINT_SQL, params)
            return cursor.rowcount == 1

    def complete_many(self, worker: str, results: Sequence[tuple[int, int, Any]]) -> set[int]:
        """Finish (id, token, return value) triples in one statement; return the ids accepted.

        The rest were rejected by the compare-and-set: the worker no longer held them.
        """
        if not results:
            return set()
        params = {
            "worker": worker,
            "ids": [r[0] for r in results],
            "tokens": [r[1] for r in results],
            "values": [json.dumps(r[2]) for r in results],
        }
        return {row[0] for row in self._rows(COMPLETE_SQL, params)}

    def finish_and_claim(
        self,
        worker: str,
        results: Sequence[tuple[int, int, Any]],
        *,
        limit: int,
        queues: Sequence[str] = ("default",),
        ttl: float | None = None,
    ) -> tuple[set[int], list[ClaimedTask]]:
        """``complete_many`` and ``claim`` in one statement: (ids accepted, tasks claimed)."""
        params = {
            "worker": worker,
            "ids": [r[0] for r in results],
            "tokens": [r[1] for r in results],
            "values": [json.dumps(r[2]) for r in results],
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "queues": list(queues),
            "limit": limit,
        }
        accepted: set[int] = set()
        claimed: list[ClaimedTask] = []
        for row in self._rows(FINISH_AND_CLAIM_SQL, params):
            if row[0]:
                claimed.append(_claimed_from_row(row[1:]))
            else:
                accepted.add(row[1])
        claimed.sort(key=lambda task: (-task.priority, task.id))
        return accepted, claimed

    def complete(self, task_id: int, worker: str, token: int, return_value: Any = None) -> bool:
        return task_id in self.complete_many(worker, [(task_id, token, return_value)])

    def fail_many(self, worker: str, failures: Sequence[Failure]) -> dict[int, FailOutcome]:
        """Record failed attempts in one statement: retried later (READY) or terminal (FAILED)."""
        if not failures:
            return {}
        conf = get_settings()
        params = {
            "worker": worker,
            "ids": [f.id for f in failures],
            "tokens": [f.token for f in failures],
            "errors": [f.as_json() for f in failures],
            "retry": [f.retry for f in failures],
            "backoff_base": conf.BACKOFF_BASE,
            "backoff_max": conf.BACKOFF_MAX,
        }
        return {row[0]: FailOutcome(row[0], row[1], row[2]) for row in self._rows(FAIL_SQL, params)}

    def fail(self, failure: Failure, worker: str) -> FailOutcome | None:
        return self.fail_many(worker, [failure]).get(failure.id)

    def hand_back(self, worker: str, held: dict[int, int]) -> set[int]:
        """Return unfinished tasks to the queue at once (graceful shutdown); the attempt is not counted."""
        if not held:
            return set()
        params = {"worker": worker, "ids": list(held), "tokens": list(held.values())}
        return {row[0] for row in self._rows(HAND_BACK_SQL, params)}

    # -- recovery and administration ------------------------------------------------------------

    def recover_expired(self, *, limit: int = 1000) -> list[Recovered]:
        """Requeue (or fail, when out of attempts) running tasks whose lease expired, and running
        rows without a lease. Returns what it recovered, with seconds from expiry to requeue."""
        conf = get_settings()
        params = {"limit": limit, "backoff_base": conf.BACKOFF_BASE, "backoff_max": conf.BACKOFF_MAX}
        return [Recovered(row[0], row[1], row[2]) for row in self._rows(RECOVER_SQL, params)]

    def expire_orphans(self) -> list[int]:
        """Expire the leases of running tasks whose worker has recorded that it stopped."""
        return [row[0] for row in self._rows(EXPIRE_ORPHANS_SQL, {})]

    def release_stray_leases(self) -> list[int]:
        return [row[0] for row in self._rows(RELEASE_STRAY_LEASES_SQL, {})]

    def cancel(self) -> int:
        """Cancel the unfinished tasks of this queryset. A running task's worker loses it: its
        heartbeat drops the task and its late result is rejected."""
        return self.filter(status__in=UNFINISHED).update(
            status=TaskStatus.CANCELLED,
            finished_at=Now(),
            released_at=models.Case(models.When(status=TaskStatus.RUNNING, then=Now()), default="released_at"),
        )

    def requeue(self) -> int:
        """Run finished (failed, cancelled, successful) tasks again now, with a fresh set of attempts."""
        try:
            return self.filter(status__in=FINISHED).update(
                status=TaskStatus.READY, run_after=Now(), attempts=0, finished_at=None
            )
        except IntegrityError as exc:
            raise TaskError("an unfinished task with the same dedup key already exists") from exc

    def retry_now(self) -> int:
        """Run waiting (READY, backed off or deferred) tasks now."""
        return self.filter(status=TaskStatus.READY).update(run_after=Now())


def _validate(*, queue: str, priority: int, max_attempts: int, timeout: float | None) -> None:
    if not queue or len(queue) > 100:
        raise ValueError("queue must be a non-empty name of at most 100 characters")
    if not -100 <= priority <= 100:
        raise ValueError("priority must be between -100 and 100")
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    if timeout is not None and not timeout > 0:
        raise ValueError("timeout must be positive")


class Task(LeaseFields):
    """One unit of work. The lease columns (holder = worker id, token, expires_at …) are the
    claim of the worker running it."""

    queue = models.CharField(max_length=100, default="default")
    priority = models.SmallIntegerField(default=0)
    task_path = models.CharField(max_length=255, help_text="Import path of the callable or django.tasks Task.")
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True, help_text="Keyword arguments: the task's payload.")
    status = models.CharField(max_length=12, choices=TaskStatus.choices, default=TaskStatus.READY)
    run_after = models.DateTimeField(db_default=Now(), help_text="Earliest time the task may run.")
    enqueued_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True, help_text="First attempt's start.")
    last_attempted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=3)
    timeout = models.FloatField(null=True, blank=True, help_text="Seconds an attempt may run.")
    dedup_key = models.CharField(max_length=255, null=True, blank=True)
    return_value = models.JSONField(null=True, blank=True)
    errors = models.JSONField(default=list, blank=True, help_text="Every failed attempt: class, message, traceback.")
    worker_ids = models.JSONField(default=list, blank=True, help_text="The worker of each attempt.")
    progress = models.JSONField(null=True, blank=True, help_text="The last checkpoint.")
    progress_at = models.DateTimeField(null=True, blank=True)

    objects = TaskQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        indexes = [
            # Exactly the claim's WHERE + ORDER BY (see CLAIM_SQL).
            models.Index(
                models.F("priority").desc(),
                "run_after",
                "id",
                name="tasks_task_runnable_idx",
                condition=Q(status="READY"),
            ),
            # Recovery and the stuck list: running rows by lease expiry.
            models.Index(fields=["expires_at"], name="tasks_task_running_exp_idx", condition=Q(status="RUNNING")),
            models.Index(fields=["holder"], name="tasks_task_running_holder_idx", condition=Q(status="RUNNING")),
            # Dashboard lists and counts by state, newest first.
            models.Index(fields=["status", "-id"], name="tasks_task_status_idx"),
            models.Index(
                fields=["finished_at"], name="tasks_task_finished_idx", condition=Q(finished_at__isnull=False)
            ),
            # The repair sweep looks for leases left live on rows that are not running: normally none.
            models.Index(
                fields=["id"],
                name="tasks_task_stray_lease_idx",
                condition=Q(released_at__isnull=True, expires_at__isnull=False) & ~Q(status="RUNNING"),
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["dedup_key"],
                condition=Q(status__in=["READY", "RUNNING"], dedup_key__isnull=False),
                name="tasks_task_dedup_unfinished",
            ),
            models.CheckConstraint(
                condition=Q(priority__gte=-100, priority__lte=100), name="tasks_task_priority_range"
            ),
        ]

    def __str__(self) -> str:
        return f"task {self.pk} {self.task_path} [{self.status}]"

    @property
    def is_stuck(self) -> bool:
        if self.status != TaskStatus.RUNNING:
            return False
        return self.expires_at is None or self.holder is None or self.expires_at <= dt.datetime.now(dt.UTC)


class Worker(models.Model):
    """A worker process, as it last reported itself (registered at start, seen at each heartbeat)."""

    id = models.CharField(max_length=200, primary_key=True)
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    queues = models.JSONField(default=list)
    concurrency = models.PositiveIntegerField()
    started_at = models.DateTimeField(db_default=Now())
    last_seen_at = models.DateTimeField(db_default=Now())
    stopped_at = models.DateTimeField(null=True, blank=True)
    running = models.PositiveIntegerField(default=0, help_text="Tasks held at the last heartbeat.")
    stats = models.JSONField(default=dict, blank=True, help_text="Counters: succeeded, failed, rejected, lost.")

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return self.id


class GeneratorState(FencedModel):
    """The demo generator, shared by every replica through the database.

    ``running``, ``rate`` and ``max_sleep`` are the desired state: any replica may change them.
    The ``leader*`` fields, ``ticks``, ``observed_running`` and ``generated`` are written only by
    the instance that holds the generator lease, through a fenced update, so a deposed leader
    cannot keep generating.
    """

    name = models.CharField(max_length=100, primary_key=True, default="default")
    running = models.BooleanField(default=False)
    rate = models.FloatField(default=2.0, help_text="Tasks per second while running.")
    max_sleep = models.FloatField(default=3.0, help_text="Largest sleep_duration_seconds of a generated task.")
    queue = models.CharField(max_length=100, default="default")
    updated_at = models.DateTimeField(auto_now=True)
    generated = models.BigIntegerField(default=0)
    leader = models.CharField(max_length=200, blank=True, default="")
    leader_seen_at = models.DateTimeField(null=True, blank=True)
    observed_running = models.BooleanField(default=False)
    ticks = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"generator {self.name}: {'running' if self.running else 'stopped'} at {self.rate}/s"
