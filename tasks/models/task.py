"""The task queue: a task's lease lives on its own row, so claim, heartbeat and finish are each one
statement (see docs/explanation/design.md, "Statement shapes").

Status names follow ``django.tasks.TaskResultStatus`` (READY, RUNNING, SUCCESSFUL, FAILED) plus
CANCELLED. A failed attempt that will be retried goes back to READY with a later ``run_after``;
FAILED is terminal ("dead": out of attempts, or not retryable), with every attempt's error kept.

Why one module of ~650 lines: the model and its queryset (the queue's operations, one statement each)
name each other (the manager is built from the queryset, whose generic parameter is the model); in
two modules they would import each other."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Self

from django.db import IntegrityError, connections, models, transaction
from django.db.models import Q
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now

from leasing.models import LeaseFields, LeaseStateQuerySet, seconds
from leasing.routing import SelectedManager
from tasks import tracing
from tasks.conf import get_settings
from tasks.exceptions import TaskError, TaskNotFinished
from tasks.lifecycle import activity, policy, prepared, ratelimits, windows
from tasks.lifecycle import statements as sql
from tasks.lifecycle import workflows as wf_sql
from tasks.lifecycle.routing import queue_database
from tasks.lifecycle.states import FINISHED, NOT_RUNNING_STATUSES, UNFINISHED, WAITING, TaskStatus
from tasks.lifecycle.storable import storable_json
from tasks.lifecycle.transitions import RERUN_FAIR_QUEUES, RERUN_SET
from tasks.lifecycle.values import (
    AttemptFate,
    ClaimedTask,
    ClaimPosition,
    Enqueued,
    FailOutcome,
    Failure,
    FairPosition,
    FairPositions,
    RateRefused,
    Recovered,
    Started,
    claimed_from_row,
    fair_key_for,
    validate_concurrency,
    validate_enqueue,
    validate_key,
)
from tasks.lifecycle.workflows import ON_PARENT_FAILURE, WorkflowError, WorkflowKind
from tasks.models.bookkeeping import UniqueKey

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper


NOT_RUNNING = Q(status__in=NOT_RUNNING_STATUSES)
#: An attempt of the task failed or its worker died with it: a waiting task so marked is "retrying".
#: These counters change only in statements that also change the status (fail, recover, requeue),
#: never in a start marker, so an index on them costs the start marker nothing.
FAILED_BEFORE = Q(failures__gt=0) | Q(crashes__gt=0) | Q(shared_crashes__gt=0)
NEVER_FAILED = Q(failures=0, crashes=0, shared_crashes=0)

#: What runs once an enqueue has inserted rows, as ``hook(database, task_ids)``: tasks.testing's eager
#: mode sets it (and runs the tasks at once). Unset, an enqueue pays one context-variable read. A
#: context variable, not a module global: only the code that turned the mode on (a test) runs tasks
#: eagerly, never another thread of the process (a live server's, a worker's).
ENQUEUE_HOOK: ContextVar[Callable[[str, list[int]], None] | None] = ContextVar("tasks_enqueue_hook", default=None)


def announce_enqueued(database: str, ids: list[int]) -> None:
    """Tell :data:`ENQUEUE_HOOK` (if set) which rows an enqueue inserted. Every enqueue calls it once
    its rows are written: :meth:`TaskQuerySet.enqueue` and :meth:`~TaskQuerySet.bulk_enqueue`, the
    django.tasks backend (after its ``task_enqueued`` signal) and ``Workflow.enqueue``."""
    hook = ENQUEUE_HOOK.get()
    if hook is not None and ids:
        hook(database, ids)


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

    def snoozed(self) -> Self:
        """Waiting after its handler snoozed it (it wakes at ``run_after``)."""
        return self.filter(status__in=WAITING, snoozed_at__isnull=False)

    def unfinished(self) -> Self:
        return self.filter(status__in=UNFINISHED)

    # -- plumbing -------------------------------------------------------------------------

    @property
    def _connection(self) -> BaseDatabaseWrapper:
        return connections[self.db]

    def _rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        return prepared.rows(self._connection, sql, params)

    def _routed(self, queue: str) -> Self:
        """This queryset on the database holding ``queue``, unless one was chosen explicitly
        (``Task.objects.db_manager(alias)`` / ``.using(alias)``): tasks/lifecycle/routing.py."""
        return self if self._db is not None else self.using(queue_database(queue))  # type: ignore[attr-defined]

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
        backend_alias: str | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        depends_on: Iterable[int | Enqueued | Task] = (),
        on_parent_failure: str = "cancel",
        pipe: bool = False,
        retry_on: Iterable[Any] | None = None,
        backoff: Any = None,
        default_max_attempts: int | None = None,
        retry_policy: dict[str, Any] | None = None,
        rate_key: str | None = None,
        rate_limit: Any = None,
        unique_for: float | dt.timedelta | None = None,
        debounce: float | dt.timedelta | None = None,
        max_wait: float | dt.timedelta | None = None,
        fair_key: str | None = None,
    ) -> Enqueued:
        """Insert one task (one statement). With ``dedup_key``, an unfinished task with the same
        key is returned instead of a new one (``created`` is False).

        Windows over the dedup key (tasks/lifecycle/windows.py), seconds or timedeltas:
        ``unique_for``: no second task of the key within that long of the last one accepted, finished
        or not (a duplicate returns the task that opened the window, ``created`` False).
        ``debounce``: the task starts that long after the key's *last* enqueue: while it waits, a
        later enqueue of the key replaces its arguments and pushes its start (``created`` False),
        never past its first enqueue + ``max_wait``; once claimed, the next enqueue is a new task.

        ``backend_alias``: the django.tasks backend enqueuing it (its worker then runs only a
        django.tasks Task).
        With ``concurrency_key`` and ``concurrency_limit``, at most that many tasks of the key are
        admitted (READY or RUNNING) at once; the rest wait BLOCKED (see tasks/lifecycle/concurrency.py).

        With ``depends_on`` (tasks of the same database), the task waits AWAITING until every one of
        them is final, and joins their workflow (tasks/lifecycle/workflows.py): it runs once they all
        succeeded; one that failed or was cancelled cancels it (``on_parent_failure="cancel"``) or
        counts as done (``"run"``). ``pipe``: their return values come first among its arguments.

        ``max_attempts``, ``retry_on`` (exception classes or their dotted paths) and ``backoff`` (a
        module-level ``f(attempt, exception) -> seconds``, or its dotted path) are this task's retry
        policy: they win over the handler's own and its queue's (tasks/lifecycle/policy.py).
        ``default_max_attempts``: the limit to store when ``max_attempts`` is not given, as a default
        (the handler's own policy still wins over it); ``retry_policy``: a stored policy mapping to
        merge under the explicit arguments (a backend's OPTIONS["retry"]).

        With ``rate_key`` and ``rate_limit`` ("14/s", "100/min", "5/10s" or a (count, seconds) pair), at
        most that many tasks of the key start in any sliding window of the database clock; a start
        the key refuses goes back uncharged to run later (tasks/lifecycle/ratelimits.py).
        ``fair_key`` (a tenant): in a fair queue (LEASING_TASKS["FAIR_QUEUES"]) claims take turns
        between keys; a task of a fair queue enqueued without one gets the shared key ""."""
        explicit = policy.stored(max_attempts=max_attempts, retry_on=retry_on, backoff=backoff)
        if retry_policy:
            problems = policy.policy_problems(retry_policy, paths_only=True)
            if problems:
                raise ValueError("retry_policy " + "; ".join(problems))
            explicit = {**retry_policy, **(explicit or {})}
        attempts = _max_attempts(queue, (explicit or {}).get("max_attempts"), default_max_attempts)
        validate_enqueue(queue=queue, priority=priority, max_attempts=attempts, timeout=timeout)
        validate_concurrency(concurrency_key, concurrency_limit)
        rated = ratelimits.rate_for_enqueue(rate_key, rate_limit)
        unique_seconds = windows.seconds_of("unique_for", unique_for)
        debounce_seconds = windows.seconds_of("debounce", debounce)
        max_wait_seconds = windows.seconds_of("max_wait", max_wait)
        windows.validate_windows(
            dedup_key=dedup_key,
            unique_for=unique_seconds,
            debounce=debounce_seconds,
            max_wait=max_wait_seconds,
            run_after=run_after,
        )
        if unique_seconds is not None or debounce_seconds is not None:
            validate_key("dedup_key", dedup_key)
        fair = fair_key_for(queue, fair_key, get_settings().FAIR_QUEUES)
        params: dict[str, Any] = {
            "queue": queue,
            "priority": priority,
            "task_path": task_path,
            "args": storable_json(list(args)),
            "kwargs": storable_json(kwargs or {}),
            "run_after": run_after,
            "max_attempts": attempts,
            "timeout": timeout,
            "dedup_key": dedup_key,
            "backend_alias": backend_alias,
            "concurrency_key": concurrency_key,
            "concurrency_limit": concurrency_limit,
            "retry_policy": None if explicit is None else json.dumps(explicit),
            **_rate_params(rated),
            "trace_context": None,
            "fair_key": fair,
        }
        routed = self._routed(queue)
        parents = sorted({_task_id(parent) for parent in depends_on})
        if parents:
            if dedup_key is not None:
                raise WorkflowError("a task with depends_on cannot have a dedup_key (nor a window over one)")
            if on_parent_failure not in ON_PARENT_FAILURE:
                raise WorkflowError(f"on_parent_failure must be one of {', '.join(ON_PARENT_FAILURE)}")
        windowed = {"unique_for": unique_seconds, "debounce": debounce_seconds, "max_wait": max_wait_seconds}
        tracer = tracing.tracer()
        if tracer is None:
            enqueued = routed._enqueue_row(params, parents, on_parent_failure, pipe, **windowed)
            return _new_announced(enqueued, backend_alias)
        traced = {"leasing.task.path": task_path}
        if backend_alias is not None:
            traced["leasing.backend"] = backend_alias
        with tracing.enqueuing(tracer, task_path, queue, traced) as (span, context):
            params["trace_context"] = context
            enqueued = routed._enqueue_row(params, parents, on_parent_failure, pipe, **windowed)
            span.set_attributes(
                {
                    "leasing.task.id": enqueued.id,
                    "messaging.message.id": str(enqueued.id),
                    "leasing.task.created": enqueued.created,
                }
            )
        return _new_announced(enqueued, backend_alias)

    def _enqueue_row(
        self,
        params: dict[str, Any],
        parents: list[int],
        on_parent_failure: str,
        pipe: bool,
        *,
        unique_for: float | None = None,
        debounce: float | None = None,
        max_wait: float | None = None,
    ) -> Enqueued:
        """The insert of :meth:`enqueue` (checked arguments in ``params``; the windows in seconds). Not
        ``_insert``: Django's QuerySet has one (bulk_create and save call it)."""
        if parents:
            return self._enqueue_dependant(params, parents, on_parent_failure, pipe)
        dedup_key = params["dedup_key"]
        if dedup_key is None:
            rows = self._rows(sql.ENQUEUE_SQL, params)
            return Enqueued(rows[0][0], True, rows[0][1], self.db)
        # The lookup of an existing task must not go through this queryset's filters (a filtered
        # queryset would never find it and the loop would spin): use the bare table.
        table = self.model._base_manager.db_manager(self.db)
        if unique_for is not None:
            return self._enqueue_unique(table, {**params, "unique_for": unique_for})
        if debounce is not None:
            params = {**params, "dedup_key": None, "debounce_key": dedup_key}
            params.update(debounce=debounce, max_wait=max_wait)
            for _ in range(100):
                rows = self._rows(sql.ENQUEUE_DEBOUNCE_SQL, params)
                if rows:
                    return Enqueued(rows[0][0], rows[0][2], rows[0][1] if rows[0][2] else None, self.db)
                # The compare-and-set on the status refused (the waiting task was claimed under
                # the statement): the next try inserts a new task.
            raise TaskError(f"could not enqueue: the task debounced under {dedup_key!r} kept changing")
        for _ in range(100):
            rows = self._rows(sql.ENQUEUE_DEDUP_SQL, params)
            if rows:
                return Enqueued(rows[0][0], True, rows[0][1], self.db)
            # Only on a duplicate: the unfinished task that holds the key (unless it just finished).
            existing = table.filter(status__in=UNFINISHED, dedup_key=dedup_key).values_list("id", flat=True).first()
            if existing is not None:
                return Enqueued(existing, False, database=self.db)
        raise TaskError(f"could not enqueue: the task holding dedup key {dedup_key!r} kept changing")

    def _enqueue_unique(self, table: models.Manager[Task], params: dict[str, Any]) -> Enqueued:
        """:meth:`enqueue` with ``unique_for`` (ENQUEUE_UNIQUE_SQL, tasks/lifecycle/windows.py)."""
        key = params["dedup_key"]
        for _ in range(100):
            rows = self._rows(sql.ENQUEUE_UNIQUE_SQL, params)
            if rows and rows[0][1] is not None:
                return Enqueued(rows[0][0], True, rows[0][1], self.db)
            with self._connection.cursor() as cursor:
                if rows:  # the window was taken but a plain dedup enqueue of the key won the insert
                    cursor.execute(windows.RELEASE_UNIQUE_KEY_SQL, {"key": key, "task_id": rows[0][0]})
                cursor.execute(windows.OPEN_WINDOW_SQL, {"key": key})
                found = cursor.fetchone()
            if found is not None:
                return Enqueued(found[0], False, database=self.db)
            existing = table.filter(status__in=UNFINISHED, dedup_key=key).values_list("id", flat=True).first()
            if existing is not None:
                return Enqueued(existing, False, database=self.db)
            # The window passed and its holder finished in between: try again.
        raise TaskError(f"could not enqueue: the window of unique key {key!r} kept changing")

    def _enqueue_dependant(self, params: dict[str, Any], parents: list[int], on_failure: str, pipe: bool) -> Enqueued:
        """One task after existing ones (see :meth:`enqueue`): the parents are locked until the
        enqueue commits, so none can finish unseen in between (tasks/lifecycle/workflows.py)."""
        with transaction.atomic(using=self.db), self._connection.cursor() as cursor:
            cursor.execute(wf_sql.LOCK_PARENTS_SQL, {"ids": parents})
            rows = cursor.fetchall()
            missing = sorted(set(parents) - {row[0] for row in rows})
            if missing:
                raise WorkflowError(f"depends_on names tasks not in database {self.db!r}: {missing}")
            flows = sorted({row[2] for row in rows if row[2] is not None})
            if len(flows) > 1:
                raise WorkflowError(f"the tasks it depends on belong to different workflows: {flows}")
            if flows:
                workflow = flows[0]
            else:
                cursor.execute(
                    wf_sql.CREATE_WORKFLOW_SQL,
                    {
                        "name": "",
                        "kind": WorkflowKind.GRAPH,
                        "total": 0,
                        "callback": None,
                        "callback_waiting": 0,
                        "callback_only": False,
                    },
                )
                workflow = cursor.fetchone()[0]
            cursor.execute(wf_sql.ADOPT_SQL, {"workflow": workflow, "ids": parents})
            statuses = {row[0]: row[1] for row in rows}
            unfinished = [i for i in parents if statuses[i] not in FINISHED]
            doomed = on_failure == "cancel" and any(
                statuses[i] in (TaskStatus.FAILED, TaskStatus.CANCELLED) for i in parents
            )
            args = json.loads(params["args"])
            if pipe and not unfinished and not doomed:
                cursor.execute(wf_sql.PARENT_VALUES_SQL, {"ids": parents})
                values = [json.loads(row[0]) if isinstance(row[0], str) else row[0] for row in cursor.fetchall()]
                args = [values[0] if len(values) == 1 else values, *args]
            elif pipe:
                args = [None, *args]  # the placeholder its release fills
            cursor.execute(wf_sql.RESERVE_IDS_SQL, {"n": 1})
            task_id = cursor.fetchone()[0]
            member = {
                **params,
                "args": args,
                "kwargs": json.loads(params["kwargs"]),
                "waiting_on": len(unfinished) or int(doomed),
            }
            cursor.execute(
                wf_sql.INSERT_MEMBERS_SQL, wf_sql.member_params(workflow, [task_id], [member], params["trace_context"])
            )
            cursor.execute(wf_sql.INSERT_EDGES_SQL, wf_sql.edge_params([(task_id, on_failure, pipe, parents)]))
            cursor.execute(wf_sql.JOIN_WORKFLOW_SQL, {"workflow": workflow})
            if doomed:
                # A parent already failed: the task is settled as if it had failed now (its own
                # statement counts it on the workflow).
                cursor.execute(wf_sql.CANCEL_AT_ONCE_SQL, {"id": task_id})
            cursor.execute("SELECT enqueued_at FROM tasks_task WHERE id = %s", [task_id])
            enqueued_at = cursor.fetchone()[0]
        return Enqueued(task_id, True, enqueued_at, self.db)

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
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        retry_on: Iterable[Any] | None = None,
        backoff: Any = None,
        rate_key: str | None = None,
        rate_limit: Any = None,
        fair_key: str | None = None,
    ) -> list[int]:
        """Insert many tasks of one kind: one multi-row statement per ``chunk_size`` tasks (all of
        them under ``concurrency_key``, if given), in the database holding ``queue`` (one queue, so
        one database; each chunk commits on its own unless the caller wraps the call in
        ``transaction.atomic(using=...)``). The retry policy and rate limit arguments and ``fair_key`` (all of
        them under that key) are :meth:`enqueue`'s."""
        routed = self._routed(queue)
        explicit = policy.stored(max_attempts=max_attempts, retry_on=retry_on, backoff=backoff)
        attempts = _max_attempts(queue, max_attempts, None)
        validate_enqueue(queue=queue, priority=priority, max_attempts=attempts, timeout=timeout)
        validate_concurrency(concurrency_key, concurrency_limit)
        rate = _rate_params(ratelimits.rate_for_enqueue(rate_key, rate_limit))
        fair = fair_key_for(queue, fair_key, get_settings().FAIR_QUEUES)
        ids: list[int] = []
        chunk: list[str] = []

        def flush() -> None:
            params = {
                "queue": queue,
                "priority": priority,
                "task_path": task_path,
                "args": "[]",
                "kwargs": chunk,
                "run_after": run_after,
                "max_attempts": attempts,
                "timeout": timeout,
                "concurrency_key": concurrency_key,
                "concurrency_limit": concurrency_limit,
                "retry_policy": None if explicit is None else json.dumps(explicit),
                **rate,
                "trace_context": trace_context,
                "fair_key": fair,
            }
            ids.extend(row[0] for row in routed._rows(sql.BULK_ENQUEUE_SQL, params))
            chunk.clear()

        tracer = tracing.tracer()
        # One span per call, however many rows and chunks: every row carries its context.
        with (
            nullcontext((None, None))
            if tracer is None
            else tracing.enqueuing(tracer, task_path, queue, {"leasing.task.path": task_path})
        ) as (span, trace_context):
            for kwargs in kwargs_list:
                chunk.append(storable_json(kwargs))
                if len(chunk) >= chunk_size:
                    flush()
            if chunk:
                flush()
            if span is not None:
                span.set_attribute("messaging.batch.message_count", len(ids))
        announce_enqueued(routed.db, ids)
        return ids

    # -- the worker's hot path --------------------------------------------------------------

    def claim(
        self,
        worker: str,
        *,
        limit: int = 1,
        queues: Sequence[str] = ("default",),
        ttl: float | None = None,
        start: bool = False,
        take_isolated: bool = True,
        after: Sequence[ClaimPosition] = (),
        fair_after: str | None = None,
        fair_positions: FairPositions | Sequence[FairPosition] = (),
    ) -> list[ClaimedTask]:
        """Claim up to ``limit`` runnable tasks for ``worker`` under a lease of ``ttl`` seconds.

        With ``start`` the attempts begin (and are charged) at once, as for an HTTP client; a
        worker claims without it and sends :meth:`start` when an executor begins the task. With
        ``after`` (positions, at most one per priority; one queue only) the claim resumes after them
        instead of scanning each level from its front (tasks/lifecycle/claim.py, "Resuming
        where the last claims stopped").

        From one fair queue (LEASING_TASKS["FAIR_QUEUES"]) the claim takes turns between the keys,
        starting after ``fair_after`` (the last key the claimer served: ``fair_after_claim``); with
        ``fair_positions`` (at most one per key and priority) each of those keys' turns resumes after
        its position, and the fill of the claim after ``after``."""
        names = list(queues)
        isolate_after = get_settings().ISOLATE_AFTER
        params = {
            "worker": worker,
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "limit": limit,
            "start": start,
            "isolate_after": isolate_after,
            **sql.claim_params(
                names,
                busy=not take_isolated,
                isolate_after=isolate_after,
                after=after,
                fair_after=fair_after,
                fair_positions=fair_positions,
            ),
        }
        statement = sql.CLAIM_SQL[len(names) > 1]
        if is_fair_claim(names, limit):  # the keys' turns resume after ``fair_positions``, the fill after ``after``
            statement = sql.FAIR_CLAIM_SQL
        claimed = [claimed_from_row(row) for row in self._rows(statement, params)]
        claimed.sort(key=lambda task: (-task.priority, task.id))
        return claimed

    def claim_chosen(
        self,
        worker: str,
        ids: Sequence[int],
        *,
        workflows: Sequence[int] = (),
        ttl: float | None = None,
        limit: int = 1,
    ) -> list[ClaimedTask]:
        """Claim up to ``limit`` of the READY tasks among ``ids`` and the members of ``workflows``, due
        or not (tasks.testing's eager mode: CLAIM_CHOSEN_SQL says which it passes over)."""
        params = {
            "worker": worker,
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "limit": limit,
            "start": False,
            "isolate_after": get_settings().ISOLATE_AFTER,
            "ids": list(ids),
            "workflows": list(workflows),
        }
        return [claimed_from_row(row) for row in self._rows(sql.CLAIM_CHOSEN_SQL, params)]

    def start(self, task_id: int, worker: str, token: int, *, isolated: bool = False) -> Started | None:
        """Mark the claimed attempt started now (``isolated``: nothing else runs in its process);
        None when the claim is no longer ours."""
        params = {
            "worker": worker,
            "start_ids": [task_id],
            "start_tokens": [token],
            "start_at": [None],
            "isolated": isolated,
        }
        rows = self._rows(sql.START_SQL, params)
        return Started(*rows[0]) if rows else None

    def rate_start(
        self, task_id: int, worker: str, token: int, *, isolated: bool = False, queue: str | None = None
    ) -> Started | RateRefused | None:
        """Take a start of the attempt's rate key and mark the attempt started (:class:`Started`), or,
        when the key's window is full, hand it back uncharged to run later (:class:`RateRefused`); None
        when the claim is no longer ours (RATE_START_SQL). A task without a rate key of its own uses
        ``queue``'s queue-wide key (LEASING_TASKS["RATE_LIMITS"])."""
        fallback = ratelimits.queue_rate(queue) if queue is not None else None
        params = {
            "worker": worker,
            "id": task_id,
            "token": token,
            "isolated": isolated,
            "key": fallback[0] if fallback else None,
            "limit": fallback[1].count if fallback else None,
            "period": fallback[1].period if fallback else None,
        }
        rows = self._rows(sql.RATE_START_SQL, params)
        if not rows:
            return None
        granted, row_id, row_token, attempt, started_at, at, wait = rows[0]
        if granted:
            return Started(row_id, row_token, attempt, started_at, at)
        return RateRefused(row_id, row_token, at, max(0.0, wait))

    def heartbeat(
        self,
        worker: str,
        held: Iterable[tuple[int, int]],
        *,
        ttl: float | None = None,
        stats: dict[str, Any] | None = None,
    ) -> set[tuple[int, int]]:
        """Renew every attempt in ``held`` ((id, token) pairs) in one statement; return those LOST.

        An attempt is lost when its row no longer has this worker, this token, RUNNING and a live
        lease. The token is compared in SQL: a stale token renews nothing. With ``stats`` (the worker
        process's own beat) the worker's row records it alive; without, only leases are touched.
        """
        attempts = list(held)
        renewed, busy = self.heartbeat_detail(worker, attempts, ttl=ttl, stats=stats, running=len(attempts))
        return set(attempts) - renewed - busy

    def heartbeat_detail(
        self,
        worker: str,
        held: Iterable[tuple[int, int]],
        *,
        ttl: float | None = None,
        stats: dict[str, Any] | None = None,
        running: int = 0,
        live: Iterable[tuple[int, int]] | None = None,
    ) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        """The heartbeat statement: (renewed, busy). Busy attempts are still ours but their rows are
        locked by another session right now: not renewed this beat, not lost either; the rest of
        ``held`` is lost. Only a beat with ``stats`` (the worker process's own) stamps the worker
        row, with ``running`` (attempts running, stuck threads included) for the workers page. With
        ``live`` (the attempts whose handler still runs in the process), the key slots kept for the
        worker's other attempts are given back (tasks/lifecycle/concurrency.py)."""
        attempts = list(held)
        alive = [] if live is None else list(live)
        params = {
            "worker": worker,
            "ids": [a[0] for a in attempts],
            "tokens": [a[1] for a in attempts],
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "running": running,
            "stats": json.dumps(stats or {}),
            "record_worker": stats is not None,  # a client reusing the worker's name must not touch its row
            "reconcile": live is not None,
            "live_ids": [a[0] for a in alive],
            "live_tokens": [a[1] for a in alive],
        }
        renewed: set[tuple[int, int]] = set()
        busy: set[tuple[int, int]] = set()
        for row in self._rows(sql.HEARTBEAT_SQL, params):
            (renewed if row[0] else busy).add((row[1], row[2]))
        return renewed, busy

    def checkpoint(self, task_id: int, worker: str, token: int, progress: Any) -> bool:
        """Store ``progress`` (JSON) as the task's last checkpoint; False if the task is no longer ours.

        Raises :class:`~tasks.exceptions.UnstorableResult` (a ValueError) for progress jsonb cannot hold.
        """
        return self.checkpoint_on(self._connection, task_id, worker, token, progress)

    def checkpoint_on(
        self, connection: BaseDatabaseWrapper, task_id: int, worker: str, token: int, progress: Any
    ) -> bool:
        """:meth:`checkpoint` on a given connection (one outside the handler's transaction)."""
        params: dict[str, Any] = {"id": task_id, "worker": worker, "token": token, "progress": storable_json(progress)}
        with connection.cursor() as cursor:
            cursor.execute(sql.CHECKPOINT_SQL, params)
            return cursor.rowcount == 1

    def complete_many(
        self, worker: str, results: Sequence[tuple[int, int, str] | tuple[int, int, str, float | None]]
    ) -> set[tuple[int, int]]:
        """Finish (id, token, return value as JSON text) triples in one statement; return the
        attempts accepted. The rest were rejected by the compare-and-set: no longer held."""
        if not results:
            return set()
        params = {
            "worker": worker,
            "ids": [r[0] for r in results],
            "tokens": [r[1] for r in results],
            "values": [r[2] for r in results],
            "started": [r[3] if len(r) > 3 else None for r in results],
        }
        return {(row[0], row[1]) for row in self._rows(sql.COMPLETE_SQL, params)}

    def finish_start_claim(
        self,
        worker: str,
        results: Sequence[tuple[int, int, str] | tuple[int, int, str, float | None]],
        starts: Sequence[tuple[int, int, float | None]] = (),
        *,
        limit: int,
        queues: Sequence[str] = ("default",),
        ttl: float | None = None,
        isolate_after: int | None = None,
        take_isolated: bool = True,
        after: Sequence[ClaimPosition] = (),
        fair_after: str | None = None,
        fair_positions: FairPositions | Sequence[FairPosition] = (),
        handed: Sequence[int] | None = None,
        release: int = 0,
        rated_queues: Sequence[str] = (),
    ) -> tuple[set[tuple[int, int]], dict[tuple[int, int], Started], list[ClaimedTask]]:
        """One statement: finish ``results`` (id, token, JSON), mark ``starts`` (id, token, start
        time) begun, claim up to ``limit`` more. Returns (finished, started, claimed); attempts
        missing from the first two were refused by the compare-and-set: no longer ours. From one fair
        queue the claim takes turns between keys after ``fair_after``, resuming each key after its
        ``fair_positions`` (see :meth:`claim`).

        ``handed`` (tokens; None: left as it is) replaces what the worker's row names as handed to
        its executors, followed by the first ``release`` claimed rows whose start is not their own
        (not suspects, no rate key, not of ``rated_queues``) in the order returned here
        (tasks/worker/handoff.py)."""
        names = list(queues)
        if isolate_after is None:
            isolate_after = get_settings().ISOLATE_AFTER
        params: dict[str, Any] = {
            "worker": worker,
            "ids": [r[0] for r in results],
            "tokens": [r[1] for r in results],
            "values": [r[2] for r in results],
            "started": [r[3] if len(r) > 3 else None for r in results],
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "limit": limit,
            "start": False,
            "isolate_after": isolate_after,
            "hand": handed is not None,
            "handed": "{" + ",".join(map(str, handed or ())) + "}",
            "release": release if handed is not None else 0,
            "rated_queues": list(rated_queues),
            **sql.claim_params(
                names,
                busy=not take_isolated,
                isolate_after=isolate_after,
                after=after,
                fair_after=fair_after,
                fair_positions=fair_positions,
            ),
        }
        fair = is_fair_claim(names, limit)  # its keys' turns resume after ``fair_positions``, its fill after ``after``
        statement = sql.FAIR_FINISH_AND_CLAIM_SQL if fair else sql.FINISH_AND_CLAIM_SQL[len(names) > 1]
        if starts:  # the usual round has none: a short task's start rides on its finish
            statement = sql.FAIR_FINISH_START_CLAIM_SQL if fair else sql.FINISH_START_CLAIM_SQL[len(names) > 1]
            params.update(
                start_ids=[s[0] for s in starts], start_tokens=[s[1] for s in starts], start_at=[s[2] for s in starts]
            )
        finished: set[tuple[int, int]] = set()
        started: dict[tuple[int, int], Started] = {}
        claimed: list[ClaimedTask] = []
        for row in self._rows(statement, params):
            if row[0] == "c":
                claimed.append(claimed_from_row(row[1:]))
            elif row[0] == "f":
                finished.add((row[1], row[2]))
            else:
                started[(row[1], row[2])] = Started(row[1], row[2], row[6], row[9], row[13])
        claimed.sort(key=lambda task: (-task.priority, task.id))
        return finished, started, claimed

    def complete(self, task_id: int, worker: str, token: int, return_value: Any = None) -> bool:
        """Finish one attempt. Raises UnstorableResult (a ValueError) for a value jsonb cannot hold."""
        return (task_id, token) in self.complete_many(worker, [(task_id, token, storable_json(return_value))])

    def fail_many(self, worker: str, failures: Sequence[Failure]) -> dict[tuple[int, int], FailOutcome]:
        """Record attempts that ended other than by returning, in one statement: failed (retried later,
        READY, or terminal, FAILED), snoozed (READY later, uncharged) or cancelled (``Failure.kind``)."""
        if not failures:
            return {}
        conf = get_settings()
        params = {
            "worker": worker,
            "ids": [f.id for f in failures],
            "tokens": [f.token for f in failures],
            "errors": [f.as_json() for f in failures],
            "retry": [f.retry for f in failures],
            "kinds": [f.kind for f in failures],
            "delays": [f.delay for f in failures],
            "max_attempts": [f.max_attempts for f in failures],
            "backoff_base": conf.BACKOFF_BASE,
            "backoff_max": conf.BACKOFF_MAX,
        }
        tokens = {f.id: f.token for f in failures}
        return {
            (row[0], tokens[row[0]]): FailOutcome(row[0], row[1], row[2], row[3])
            for row in self._rows(sql.FAIL_SQL, params)
        }

    def fail(self, failure: Failure, worker: str) -> FailOutcome | None:
        return self.fail_many(worker, [failure]).get(failure.key)

    def hand_back(
        self,
        worker: str,
        held: Iterable[tuple[int, int]],
        *,
        reason: str = "interrupted by a worker shutting down; not counted as a failure",
    ) -> set[tuple[int, int]]:
        """Return held attempts to the queue at once, uncharged (shutdown, claims we cannot run).
        An attempt that had started gets an error entry with ``reason``."""
        attempts = list(held)
        if not attempts:
            return set()
        params = {
            "worker": worker,
            "ids": [a[0] for a in attempts],
            "tokens": [a[1] for a in attempts],
            "reason": reason,
        }
        return {(row[0], row[1]) for row in self._rows(sql.HAND_BACK_SQL, params)}

    def held_by_worker(self, worker: str) -> dict[tuple[int, int], bool]:
        """What the database says ``worker`` holds: attempt -> whether it started (reconciliation)."""
        return {(row[0], row[1]): row[2] for row in self._rows(sql.HELD_SQL, {"worker": worker})}

    def attempt_fates(self, ids: Iterable[int]) -> dict[int, AttemptFate]:
        """Where the given tasks stand now, for a worker whose reply to a finish was lost."""
        rows = self._rows(sql.ATTEMPT_FATE_SQL, {"ids": list(ids)})
        return {row[0]: AttemptFate(*row) for row in rows}

    # -- recovery and administration ------------------------------------------------------------

    def recover_expired(self, *, limit: int = 1000, after: dt.datetime | None = None) -> list[Recovered]:
        """Requeue (or fail, after MAX_CRASHES) running tasks whose lease expired, and running rows
        without a lease. Returns what it recovered, with seconds from expiry to requeue. With
        ``after`` (database time), only leases that expired since then, and no repair of running
        rows without one (tasks/lifecycle/recover.py, RECOVER_SINCE_CTES)."""
        conf = get_settings()
        params = {
            "limit": limit,
            "after": after,
            "backoff_base": conf.BACKOFF_BASE,
            "backoff_max": conf.BACKOFF_MAX,
            "max_crashes": conf.MAX_CRASHES,
        }
        # The statement also adds what it recovered to the per-minute activity rollup (same
        # statement, so the chart and /metrics count every recovery once, without scanning errors).
        statement = activity.RECOVER_AND_RECORD_SQL if after is None else activity.RECOVER_SINCE_AND_RECORD_SQL
        rows = self._rows(statement, params)
        return [Recovered(row[0], row[1], row[2], row[3] or "", row[4], row[5], row[6]) for row in rows]

    def expire_orphans(self) -> list[int]:
        """Expire the leases of running tasks whose worker has recorded that it stopped."""
        return [row[0] for row in self._rows(sql.EXPIRE_ORPHANS_SQL, {})]

    def release_stray_leases(self) -> list[int]:
        return [row[0] for row in self._rows(sql.RELEASE_STRAY_LEASES_SQL, {})]

    def cancel(self) -> int:
        """Cancel the unfinished tasks of this queryset. A running task's worker loses it: its
        heartbeat drops the task and its late result is rejected."""
        return self.filter(status__in=UNFINISHED).update(
            status=TaskStatus.CANCELLED,
            finished_at=Now(),
            released_at=models.Case(models.When(status=TaskStatus.RUNNING, then=Now()), default="released_at"),
        )

    def requeue(self) -> int:
        """Run finished (failed, cancelled, successful) tasks again now, with a fresh set of attempts:
        one UPDATE writing RERUN_SET (tasks/lifecycle/transitions.py; the bulk retry writes the same).

        A task whose key another task holds (an unfinished task of its dedup key; a waiting, never
        claimed task of its debounce key, when it was never claimed either) refuses the whole requeue
        with a TaskError naming the key and the task that holds it, and changes nothing. Inside the caller's
        ``transaction.atomic()`` the UPDATE runs under a savepoint, so the transaction goes on."""
        finished = self.filter(status__in=FINISHED)
        # The fragment's one parameter (the fair queues) goes as Django's positional placeholder.
        fair_queues = list(get_settings().FAIR_QUEUES)
        rerun = {
            column: RawSQL(
                expression.replace(RERUN_FAIR_QUEUES, "%s"), [fair_queues] * expression.count(RERUN_FAIR_QUEUES)
            )
            for column, expression in RERUN_SET.items()
        }
        # Outside a transaction the UPDATE is its own: a failed one leaves nothing to roll back, and a
        # savepoint would cost a BEGIN and a COMMIT round trip.
        inside = connections[finished.db].in_atomic_block
        try:
            with transaction.atomic(using=finished.db) if inside else nullcontext():
                return finished.update(**rerun)
        except IntegrityError as exc:
            raise finished._requeue_refused(exc) from exc

    def _requeue_refused(self, exc: IntegrityError) -> TaskError:
        """What a requeue of these finished tasks met (its statement rolled back to its savepoint): the
        key and the task holding it, read from the bare table (a filtered queryset would hide it)."""
        table = self.model._base_manager.db_manager(self.db)
        constraint = getattr(getattr(exc.__cause__, "diag", None), "constraint_name", None)
        if constraint == "tasks_task_debounce_waiting":
            waiting = table.filter(status__in=(TaskStatus.BLOCKED, TaskStatus.READY), transitions=0)
            held = self._key_holder(waiting, ("task_path", "debounce_key"), transitions=0)
            if held is None:
                return TaskError(
                    "two of these tasks share a debounce key and were never claimed: only one of them can wait at a"
                    " time; requeue them one by one"
                )
            held_id, mine, (path, key) = held
            return TaskError(
                f"task {mine} cannot run again: task {held_id} of debounce key {key!r} ({path}) is waiting,"
                " not yet claimed, and a debounce key has one such task at a time (the key's enqueues fold into"
                f" it); cancel task {held_id} or let it be claimed first"
            )
        if constraint == "tasks_task_dedup_unfinished":
            held = self._key_holder(table.filter(status__in=UNFINISHED), ("dedup_key",))
            if held is None:
                return TaskError(
                    "an unfinished task with the same dedup key already exists: two of these tasks share a dedup"
                    " key; requeue them one by one"
                )
            held_id, mine, (key,) = held
            return TaskError(
                f"an unfinished task with the same dedup key already exists: dedup key {key!r} is held by"
                f" task {held_id} (task {mine} cannot run again until it finishes)"
            )
        return TaskError(f"the requeue was refused: {exc}")

    def _key_holder(
        self, holders: models.QuerySet[Task], key: tuple[str, ...], **mine: Any
    ) -> tuple[int, int | None, tuple[Any, ...]] | None:
        """The first of ``holders`` whose ``key`` columns (the last one not NULL) one of these tasks
        (narrowed by ``mine``) shares: its id, the id of the task of ours that shares it, and the key."""
        same = {column: models.OuterRef(column) for column in key}
        found = (
            holders.filter(**{f"{key[-1]}__isnull": False})
            .filter(models.Exists(self.filter(**mine, **same)))
            .order_by("id")
            .values_list("id", *key)
            .first()
        )
        if found is None:
            return None
        held_id, *values = found
        ours = self.filter(**mine, **dict(zip(key, values, strict=True))).values_list("id", flat=True).first()
        return held_id, ours, tuple(values)

    def delete_finished(self) -> int:
        """Delete the tasks of this queryset if every one of them is finished (SUCCESSFUL, FAILED,
        CANCELLED), in one statement (DELETE_FINISHED_SQL); returns how many were deleted. One that
        is not (waiting or running) refuses the whole delete with :class:`TaskNotFinished` naming it,
        and nothing is deleted: cancel it first. Read on this queryset's database."""
        ids = list(self.values_list("pk", flat=True))
        if not ids:
            return 0
        rows = self._rows(sql.DELETE_FINISHED_SQL, {"ids": ids})
        unfinished = sorted((row[1], row[2]) for row in rows if not row[0])
        if unfinished:
            raise TaskNotFinished(unfinished)
        return len(rows)

    def retry_now(self) -> int:
        """Run waiting (READY, backed off or deferred) tasks now. Waiting tasks of a concurrency key
        (BLOCKED) become due and are admitted at once where their key has a free slot (the update's
        own statement trigger admits for every key whose waiting task came due earlier)."""
        return self.filter(status__in=WAITING).update(run_after=Now())


def _rate_params(rated: tuple[str, ratelimits.Rate] | None) -> dict[str, Any]:
    key, rate = rated if rated is not None else (None, None)
    return {
        "rate_key": key,
        "rate_limit": rate.count if rate else None,
        "rate_period": rate.period if rate else None,
    }


def is_fair_claim(queues: Sequence[str], limit: int) -> bool:
    """A claim of rows from one fair queue (LEASING_TASKS["FAIR_QUEUES"]) takes turns between keys.
    A claim from several queues keeps the plain order (each queue's best rows, by priority)."""
    return limit > 0 and len(queues) == 1 and queues[0] in get_settings().FAIR_QUEUES


def _max_attempts(queue: str, explicit: int | None, default: int | None) -> int:
    """The limit a new row stores: the enqueue's own, else the given default, else its queue's
    policy (LEASING_TASKS["RETRY_POLICIES"]), else MAX_ATTEMPTS."""
    if explicit is not None:
        return explicit
    if default is not None:
        return default
    conf = get_settings()
    if conf.RETRY_POLICIES:
        limit = (conf.RETRY_POLICIES.get(queue) or {}).get("max_attempts")
        if limit is not None:
            return int(limit)
    return conf.MAX_ATTEMPTS


def _announced(enqueued: Enqueued, backend_alias: str | None) -> Enqueued:
    """A new task's enqueue, announced (:func:`announce_enqueued`); a django.tasks backend announces
    its own once its ``task_enqueued`` signal is sent, which must come before the task's start."""
    if backend_alias is None:
        announce_enqueued(enqueued.database, [enqueued.id])
    return enqueued


def _new_announced(enqueued: Enqueued, backend_alias: str | None) -> Enqueued:
    """:func:`_announced` for a task created now; an existing one (a dedup key's) was announced already."""
    return _announced(enqueued, backend_alias) if enqueued.created else enqueued


def _task_id(task: int | Enqueued | Task) -> int:
    value = task.id if isinstance(task, Enqueued | Task) else task
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkflowError(f"depends_on takes task ids, Enqueued or Task rows, not {task!r}")
    return value


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
    attempts = models.PositiveIntegerField(default=0, help_text="Attempts that started (charged or not).")
    max_attempts = models.PositiveIntegerField(default=3, help_text="Failed attempts (the handler's own) allowed.")
    failures = models.PositiveIntegerField(default=0, help_text="Attempts that ended in the handler's own failure.")
    crashes = models.PositiveIntegerField(
        default=0, help_text="Started attempts whose worker vanished (lease expired); bounded by MAX_CRASHES."
    )
    shared_crashes = models.PositiveIntegerField(
        default=0, help_text="Started attempts whose worker vanished beside other attempts (not charged)."
    )
    attempt_isolated = models.BooleanField(default=False, help_text="The current attempt runs alone in its process.")
    unstarted_returns = models.PositiveIntegerField(
        default=0, help_text="Claims returned unstarted after their worker vanished (uncharged; makes it a suspect)."
    )
    attempt_started = models.BooleanField(default=False, help_text="The current claim's attempt has begun.")
    timeout = models.FloatField(null=True, blank=True, help_text="Seconds an attempt may run.")
    dedup_key = models.CharField(max_length=255, null=True, blank=True)
    debounce_key = models.CharField(
        max_length=255,
        null=True,
        blank=True,
        help_text="Debounced under this key: a later enqueue of the key replaces its arguments and pushes its "
        "start while it waits (see tasks/lifecycle/windows.py).",
    )
    debounce_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The latest start a debounce may push it to: its first enqueue plus max_wait (empty: no cap).",
    )
    # NULL on a task that is not debounced: a plain row stores nothing for it (a NOT NULL default
    # would widen every row of the queue by 4 bytes).
    debounces = models.PositiveIntegerField(
        null=True, blank=True, help_text="Later enqueues of its debounce key folded into it while it waited."
    )
    return_value = models.JSONField(null=True, blank=True)
    errors = models.JSONField(
        default=list,
        blank=True,
        help_text="How attempts ended (class, message, traceback): the first and the newest, at most ten.",
    )
    errors_dropped = models.IntegerField(
        default=0, db_default=0, help_text="Error entries dropped from the middle of the history to bound it."
    )
    worker_ids = models.JSONField(default=list, blank=True, help_text="The worker of each attempt.")
    progress = models.JSONField(null=True, blank=True, help_text="The last checkpoint.")
    progress_at = models.DateTimeField(null=True, blank=True)
    retry_policy = models.JSONField(
        null=True,
        blank=True,
        help_text="The retry policy given at enqueue (max_attempts, retry_on, backoff as dotted paths).",
    )
    trace_context = models.JSONField(
        null=True,
        blank=True,
        editable=False,
        help_text="The enqueuing span's context (traceparent, tracestate) when tracing was on (tasks/tracing.py).",
    )
    snoozes = models.PositiveIntegerField(
        default=0, db_default=0, help_text="Times its handler snoozed it (uncharged: not counted in attempts)."
    )
    snoozed_at = models.DateTimeField(
        null=True, blank=True, help_text="When it last snoozed (until its next failure); it wakes at run_after."
    )
    backend_alias = models.CharField(
        max_length=100,
        null=True,
        blank=True,
        help_text="The django.tasks backend alias that enqueued it (empty: Task.objects.enqueue, any callable).",
    )
    task_run_after = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The run_after the django.tasks Task was enqueued with (run_after itself moves with retries).",
    )
    api_origin = models.BooleanField(
        default=False,
        db_default=False,
        help_text="Enqueued through the JSON API: workers check its path against the API allow-list first.",
    )
    concurrency_key = models.CharField(
        max_length=255,
        null=True,
        blank=True,
        help_text="Tasks sharing this key run at most concurrency_limit at once (see tasks/lifecycle/concurrency.py).",
    )
    concurrency_limit = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The key's limit as this task was enqueued with it (the latest enqueue sets it).",
    )
    rate_key = models.CharField(
        max_length=255,
        null=True,
        blank=True,
        help_text="Starts of tasks sharing this key are limited per sliding window (tasks/lifecycle/ratelimits.py).",
    )
    rate_limit = models.PositiveIntegerField(
        null=True, blank=True, help_text="Starts of its rate key allowed per rate_period (as enqueued)."
    )
    rate_period = models.FloatField(null=True, blank=True, help_text="The rate limit's window, in seconds.")
    rate_refusals = models.PositiveIntegerField(
        default=0, db_default=0, help_text="Starts its rate key refused (handed back uncharged, run_after pushed)."
    )

    # Collation "C": keys are walked in byte order, which is Python's order of their code points (the
    # worker tells the last key it served by comparing them), whatever the database's collation.
    fair_key = models.CharField(
        max_length=255,
        db_collation="C",
        null=True,
        blank=True,
        help_text="Its key (tenant) in a fair queue: claims take turns between keys (tasks/lifecycle/statements.py).",
    )

    workflow_id = models.BigIntegerField(
        null=True, blank=True, help_text="The workflow this task belongs to (tasks/lifecycle/workflows.py)."
    )
    waiting_on = models.PositiveIntegerField(
        default=0,
        db_default=0,
        help_text="Tasks it depends on that are not final yet (AWAITING until 0); a group's callback is "
        "counted on its workflow instead (see parents_left).",
    )

    # The lease columns' plain index on holder (and its LIKE twin) is replaced by
    # tasks_task_holder_newest_idx below (holder, status, id), which serves the same lookups and also
    # pages of a holder's tasks, newest first: one index write less per claim, heartbeat and finish.
    holder = models.CharField(max_length=200, null=True, blank=True)

    objects = SelectedManager.from_queryset(TaskQuerySet)()

    class Meta:
        ordering = ["-id"]
        indexes = [
            # Exactly the claim's WHERE + ORDER BY, per queue (see PICK_ONE in tasks/lifecycle/claim.py).
            models.Index(
                fields=["queue", "-priority", "run_after", "id", "shared_crashes"],
                name="tasks_task_claim_idx",
                condition=Q(status="READY"),
            ),
            # Fair queues (LEASING_TASKS["FAIR_QUEUES"]): the keys with READY tasks, walked one index probe
            # per key, and each key's tasks in its claim order (PICK_FAIR in tasks/lifecycle/claim.py). Unkeyed
            # rows are not in it: a plain queue's enqueue and claim never write to it.
            models.Index(
                "queue",
                "fair_key",
                models.F("priority").desc(),
                "run_after",
                "id",
                name="tasks_task_fair_idx",
                condition=Q(status="READY", fair_key__isnull=False),
            ),
            # The few READY tasks that crashed beside others: a busy worker's look for one that must run
            # isolated (ISOLATED_WAITING_SQL in tasks/lifecycle/claim.py); tiny whatever the backlog.
            models.Index(
                fields=["queue", "run_after"],
                name="tasks_task_isolation_idx",
                condition=Q(status="READY", shared_crashes__gt=0),
            ),
            # Recovery and the stuck list: running rows by lease expiry.
            models.Index(fields=["expires_at"], name="tasks_task_running_exp_idx", condition=Q(status="RUNNING")),
            models.Index(fields=["holder"], name="tasks_task_running_holder_idx", condition=Q(status="RUNNING")),
            # A rate key's live reservations (RATE_START_SQL: a refusal's place in line is after the
            # latest of them, not after reservations of tasks since cancelled or deleted). Only rows
            # with a rate key of their own, waiting: a plain task never enters it.
            models.Index(
                fields=["rate_key", "run_after"],
                name="tasks_task_rate_line_idx",
                condition=Q(rate_key__isnull=False, status__in=["READY", "BLOCKED"]),
            ),
            # Dashboard lists and counts by state, newest first.
            models.Index(fields=["status", "-id"], name="tasks_task_status_idx"),
            models.Index(
                fields=["finished_at"], name="tasks_task_finished_idx", condition=Q(finished_at__isnull=False)
            ),
            # Retention (tasks/maintenance/retention.py) deletes finished rows of one status oldest first, in
            # batches that resume from the last key: an exact range scan, whatever the other statuses keep.
            models.Index(
                fields=["status", "finished_at", "id"],
                name="tasks_task_prune_idx",
                condition=Q(finished_at__isnull=False),
            ),
            # Pages, newest first, by queue / task path / holder / dedup key within a status (see
            # tasks/web/queries.py): each is an ordered index scan that stops after one page, however
            # many tasks match. The queue and task-path indexes leave RUNNING rows out (a set
            # bounded by the workers, listed from the running indexes), so that claims and
            # heartbeats never write to them.
            models.Index(
                "queue", "status", models.F("id").desc(), name="tasks_task_queue_newest_idx", condition=NOT_RUNNING
            ),
            models.Index(
                "task_path", "status", models.F("id").desc(), name="tasks_task_path_newest_idx", condition=NOT_RUNNING
            ),
            models.Index(
                "holder",
                "status",
                models.F("id").desc(),
                name="tasks_task_holder_newest_idx",
                condition=Q(holder__isnull=False),  # not written when a task is enqueued
            ),
            models.Index(
                "dedup_key",
                "status",
                models.F("id").desc(),
                name="tasks_task_dedup_newest_idx",
                condition=Q(dedup_key__isnull=False),
            ),
            # Waiting tasks that failed before ("retrying"), newest first: few, and written only when
            # a task fails or is recovered. (The rest of the waiting tasks, "pending", are most of
            # them: they are read from tasks_task_status_idx.)
            models.Index(
                models.F("id").desc(), name="tasks_task_retrying_idx", condition=Q(status="READY") & FAILED_BEFORE
            ),
            # Concurrency keys (tasks/lifecycle/concurrency.py): a key's waiting tasks in admission order, and
            # its admitted ones (READY or RUNNING: at most its limit, counted under the key's row
            # lock). Unkeyed rows are in neither, so they cost the claim and the finish nothing.
            models.Index(
                "concurrency_key",
                models.F("priority").desc(),
                "run_after",
                "id",
                name="tasks_task_blocked_idx",
                condition=Q(status="BLOCKED"),
            ),
            models.Index(
                fields=["concurrency_key"],
                name="tasks_task_slot_idx",
                condition=Q(status__in=["READY", "RUNNING"], concurrency_key__isnull=False),
            ),
            # Pages of blocked tasks by queue, newest first (the other page indexes leave BLOCKED out).
            models.Index(
                "queue",
                "status",
                models.F("id").desc(),
                name="tasks_task_blocked_page_idx",
                condition=Q(status="BLOCKED"),
            ),
            # A workflow's members by status, newest first (the workflow page, its cancel, retention of the unit).
            models.Index(
                "workflow_id",
                "status",
                models.F("id").desc(),
                name="tasks_task_workflow_idx",
                condition=Q(workflow_id__isnull=False),
            ),
            # Waiting tasks their handler snoozed, newest first (the dashboard's "snoozed" list and
            # count, as tasks_task_retrying_idx for "retrying"): only those waiting after a snooze. A
            # claim leaves the entry (status leaves the predicate); a failure clears snoozed_at.
            models.Index(
                models.F("id").desc(),
                name="tasks_task_snoozed_idx",
                condition=Q(status="READY", snoozed_at__isnull=False),
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
                condition=Q(status__in=["BLOCKED", "READY", "RUNNING"], dedup_key__isnull=False),
                name="tasks_task_dedup_unfinished",
            ),
            # At most one *waiting, never claimed* task per task path and debounce key: the arbiter of
            # ENQUEUE_DEBOUNCE_SQL's upsert. A claim (the only statement that bumps ``transitions``) takes
            # a task out for good, so the next enqueue of the key inserts a new task, and a claimed task
            # that waits again (a retry, a hand-back, recovery, a requeue) never meets the key's newer one.
            # The task path is part of the key: an enqueue of one path never rewrites the arguments of
            # another's task (a JSON API client could otherwise feed a path it may not enqueue).
            models.UniqueConstraint(
                fields=["task_path", "debounce_key"],
                condition=Q(status__in=["BLOCKED", "READY"], debounce_key__isnull=False, transitions=0),
                name="tasks_task_debounce_waiting",
            ),
            models.CheckConstraint(
                condition=Q(priority__gte=-100, priority__lte=100), name="tasks_task_priority_range"
            ),
        ]

    def __str__(self) -> str:
        return f"task {self.pk} {self.task_path} [{self.status}]"

    @property
    def parents_left(self) -> int:
        """How many of the tasks it depends on are not final yet. A group's callback (AWAITING with
        ``waiting_on`` 0) is counted on its workflow row (``callback_waiting``)."""
        if self.status != TaskStatus.AWAITING:
            return 0
        if self.waiting_on or self.workflow_id is None:
            return self.waiting_on
        with connections[self._state.db or "default"].cursor() as cursor:
            cursor.execute(wf_sql.CALLBACK_WAITING_SQL, {"id": self.workflow_id, "task": self.id})
            row = cursor.fetchone()
        return int(row[0]) if row else 0

    def unique_window(self) -> UniqueKey | None:
        """The unique_for window this task opened, while it is open (tasks/lifecycle/windows.py): one
        primary-key probe, none for a task without a dedup key."""
        if self.dedup_key is None:
            return None
        return (
            UniqueKey.objects.using(self._state.db or "default")
            .filter(key=self.dedup_key, task_id=self.pk, expires_at__gt=Now())
            .first()
        )

    @property
    def is_snoozed(self) -> bool:
        """Waiting after its handler snoozed it; it wakes at ``run_after``."""
        return self.status in WAITING and self.snoozed_at is not None

    @property
    def cancel_reason(self) -> str | None:
        """Why its handler cancelled it (:class:`tasks.exceptions.Cancel`), if it did."""
        last = self.errors[-1] if self.status == TaskStatus.CANCELLED and self.errors else None
        return last.get("message", "") if isinstance(last, dict) and last.get("kind") == "cancel" else None

    @property
    def is_stuck(self) -> bool:
        if self.status != TaskStatus.RUNNING:
            return False
        return self.expires_at is None or self.holder is None or self.expires_at <= dt.datetime.now(dt.UTC)
