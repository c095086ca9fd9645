"""Enqueue (TaskQuerySet.enqueue, bulk_enqueue): the checks, windows, workflow joins and tracing
around the insert statements of tasks/lifecycle/enqueue.py (and windows.py, workflows.py), and the
hook every enqueue announces its rows to."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from contextvars import ContextVar
from typing import Any

from django.db import connections, models, transaction

from tasks import tracing
from tasks.conf import get_settings
from tasks.exceptions import TaskError
from tasks.lifecycle import policy, ratelimits, windows
from tasks.lifecycle import statements as sql
from tasks.lifecycle import workflows as wf_sql
from tasks.lifecycle.states import FINISHED, UNFINISHED, TaskStatus
from tasks.lifecycle.storable import storable_json
from tasks.lifecycle.values import Enqueued, fair_key_for, validate_concurrency, validate_enqueue, validate_key
from tasks.lifecycle.workflows import ON_PARENT_FAILURE, WorkflowError, WorkflowKind
from tasks.models.finished import archived_ids
from tasks.models.task_send import OperationsBase, Tasks, fetch, routed_to


class EnqueueOperations(OperationsBase):
    """Enqueue (``Task.objects.enqueue``, ``bulk_enqueue``).
    A base of TaskQuerySet: its methods are ``Task.objects``'s."""

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
        depends_on: Iterable[int | Enqueued | models.Model] = (),
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
        routed = routed_to(self, queue)
        parents = sorted({_task_id(parent) for parent in depends_on})
        if parents:
            if dedup_key is not None:
                raise WorkflowError("a task with depends_on cannot have a dedup_key (nor a window over one)")
            if on_parent_failure not in ON_PARENT_FAILURE:
                raise WorkflowError(f"on_parent_failure must be one of {', '.join(ON_PARENT_FAILURE)}")
        windowed = {"unique_for": unique_seconds, "debounce": debounce_seconds, "max_wait": max_wait_seconds}
        tracer = tracing.tracer()
        if tracer is None:
            enqueued = _enqueue_row(routed, params, parents, on_parent_failure, pipe, **windowed)
            return _new_announced(enqueued, backend_alias)
        traced = {"leasing.task.path": task_path}
        if backend_alias is not None:
            traced["leasing.backend"] = backend_alias
        with tracing.enqueuing(tracer, task_path, queue, traced) as (span, context):
            params["trace_context"] = context
            enqueued = _enqueue_row(routed, params, parents, on_parent_failure, pipe, **windowed)
            span.set_attributes(
                {
                    "leasing.task.id": enqueued.id,
                    "messaging.message.id": str(enqueued.id),
                    "leasing.task.created": enqueued.created,
                }
            )
        return _new_announced(enqueued, backend_alias)

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
        """Insert many tasks of one kind: one multi-row statement per ``chunk_size`` tasks, or fewer
        where their kwargs' JSON passes :data:`MAX_CHUNK_TEXT` characters (all of
        them under ``concurrency_key``, if given), in the database holding ``queue`` (one queue, so
        one database; each chunk commits on its own unless the caller wraps the call in
        ``transaction.atomic(using=...)``). The retry policy and rate limit arguments and ``fair_key`` (all of
        them under that key) are :meth:`enqueue`'s."""
        routed = routed_to(self, queue)
        explicit = policy.stored(max_attempts=max_attempts, retry_on=retry_on, backoff=backoff)
        attempts = _max_attempts(queue, max_attempts, None)
        validate_enqueue(queue=queue, priority=priority, max_attempts=attempts, timeout=timeout)
        validate_concurrency(concurrency_key, concurrency_limit)
        rate = _rate_params(ratelimits.rate_for_enqueue(rate_key, rate_limit))
        fair = fair_key_for(queue, fair_key, get_settings().FAIR_QUEUES)
        ids: list[int] = []
        chunk: list[str] = []
        chunk_text = 0

        def flush() -> None:
            nonlocal chunk_text
            params = {
                "queue": queue,
                "priority": priority,
                "task_path": task_path,
                "args": "[]",
                "kwargs": "[" + ",".join(chunk) + "]",
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
            ids.extend(row[0] for row in fetch(routed, sql.BULK_ENQUEUE_SQL, params))
            chunk.clear()
            chunk_text = 0

        tracer = tracing.tracer()
        # One span per call, however many rows and chunks: every row carries its context.
        with (
            nullcontext((None, None))
            if tracer is None
            else tracing.enqueuing(tracer, task_path, queue, {"leasing.task.path": task_path})
        ) as (span, trace_context):
            for kwargs in kwargs_list:
                text = storable_json(kwargs)
                if chunk and chunk_text + len(text) > MAX_CHUNK_TEXT:
                    flush()
                chunk.append(text)
                chunk_text += len(text) + 1
                if len(chunk) >= chunk_size:
                    flush()
            if chunk:
                flush()
            if span is not None:
                span.set_attribute("messaging.batch.message_count", len(ids))
        announce_enqueued(routed.db, ids)
        return ids


#: Characters of kwargs JSON one bulk statement carries at most; a value that would pass it starts the
#: next chunk (a longer value goes alone). A chunk travels as one jsonb array, which PostgreSQL caps at
#: 256 MB of elements (JENTRY_OFFLENMASK), and jsonb may take up to six times the text's characters (a
#: one-digit number: 2 characters, a 4-byte entry and an 8-byte numeric): 32 M characters stay under
#: the cap whatever the values (a chunk of 5,000 ordinary kwargs is a few hundred KB).
MAX_CHUNK_TEXT = 32 * 1024 * 1024


#: What runs once an enqueue has inserted rows, as ``hook(database, task_ids)``: tasks.testing's eager
#: mode sets it (and runs the tasks at once). Unset, an enqueue pays one context-variable read. A
#: context variable, not a module global: only the code that turned the mode on (a test) runs tasks
#: eagerly, never another thread of the process (a live server's, a worker's).
ENQUEUE_HOOK: ContextVar[Callable[[str, list[int]], None] | None] = ContextVar("tasks_enqueue_hook", default=None)


def announce_enqueued(database: str, ids: list[int]) -> None:
    """Tell :data:`ENQUEUE_HOOK` (if set) which rows an enqueue inserted. Every enqueue calls it once
    its rows are written: :func:`enqueue` and :func:`bulk_enqueue`, the django.tasks backend (after its
    ``task_enqueued`` signal) and ``Workflow.enqueue``."""
    hook = ENQUEUE_HOOK.get()
    if hook is not None and ids:
        hook(database, ids)


def _enqueue_row(
    tasks: Tasks,
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
        return _enqueue_dependant(tasks, params, parents, on_parent_failure, pipe)
    dedup_key = params["dedup_key"]
    if dedup_key is None:
        rows = fetch(tasks, sql.ENQUEUE_SQL, params)
        return Enqueued(rows[0][0], True, rows[0][1], tasks.db)
    # The lookup of an existing task must not go through this queryset's filters (a filtered
    # queryset would never find it and the loop would spin): use the bare table.
    table = tasks.model._base_manager.db_manager(tasks.db)
    if unique_for is not None:
        return _enqueue_unique(tasks, table, {**params, "unique_for": unique_for})
    if debounce is not None:
        params = {**params, "dedup_key": None, "debounce_key": dedup_key}
        params.update(debounce=debounce, max_wait=max_wait)
        for _ in range(100):
            rows = fetch(tasks, sql.ENQUEUE_DEBOUNCE_SQL, params)
            if rows:
                return Enqueued(rows[0][0], rows[0][2], rows[0][1] if rows[0][2] else None, tasks.db)
            # The compare-and-set on the status refused (the waiting task was claimed under
            # the statement): the next try inserts a new task.
        raise TaskError(f"could not enqueue: the task debounced under {dedup_key!r} kept changing")
    for _ in range(100):
        rows = fetch(tasks, sql.ENQUEUE_DEDUP_SQL, params)
        if rows:
            return Enqueued(rows[0][0], True, rows[0][1], tasks.db)
        # Only on a duplicate: the unfinished task that holds the key (unless it just finished).
        existing = table.filter(status__in=UNFINISHED, dedup_key=dedup_key).values_list("id", flat=True).first()
        if existing is not None:
            return Enqueued(existing, False, database=tasks.db)
    raise TaskError(f"could not enqueue: the task holding dedup key {dedup_key!r} kept changing")


def _enqueue_unique(tasks: Tasks, table: models.Manager[Any], params: dict[str, Any]) -> Enqueued:
    """:meth:`enqueue` with ``unique_for`` (ENQUEUE_UNIQUE_SQL, tasks/lifecycle/windows.py)."""
    key = params["dedup_key"]
    for _ in range(100):
        rows = fetch(tasks, sql.ENQUEUE_UNIQUE_SQL, params)
        if rows and rows[0][1] is not None:
            return Enqueued(rows[0][0], True, rows[0][1], tasks.db)
        with connections[tasks.db].cursor() as cursor:
            if rows:  # the window was taken but a plain dedup enqueue of the key won the insert
                cursor.execute(windows.RELEASE_UNIQUE_KEY_SQL, {"key": key, "task_id": rows[0][0]})
            cursor.execute(windows.OPEN_WINDOW_SQL, {"key": key})
            found = cursor.fetchone()
        if found is not None:
            return Enqueued(found[0], False, database=tasks.db)
        existing = table.filter(status__in=UNFINISHED, dedup_key=key).values_list("id", flat=True).first()
        if existing is not None:
            return Enqueued(existing, False, database=tasks.db)
        # The window passed and its holder finished in between: try again.
    raise TaskError(f"could not enqueue: the window of unique key {key!r} kept changing")


def _enqueue_dependant(
    tasks: Tasks, params: dict[str, Any], parents: list[int], on_failure: str, pipe: bool
) -> Enqueued:
    """One task after existing ones (see :meth:`enqueue`): the parents are locked until the
    enqueue commits, so none can finish unseen in between (tasks/lifecycle/workflows.py)."""
    with transaction.atomic(using=tasks.db), connections[tasks.db].cursor() as cursor:
        cursor.execute(wf_sql.LOCK_PARENTS_SQL, {"ids": parents})
        rows = cursor.fetchall()
        missing = sorted(set(parents) - {row[0] for row in rows})
        if missing:
            raise WorkflowError(_missing_parents(tasks.db, missing))
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
    return Enqueued(task_id, True, enqueued_at, tasks.db)


def _missing_parents(database: str, missing: list[int]) -> str:
    """Why ``depends_on`` named tasks LOCK_PARENTS_SQL did not find: never enqueued (or deleted), or
    finished and moved to tasks_finished by the mover (tasks/maintenance/archive.py), which only
    moves plain tasks and so cannot move one a dependant has made a parent. Read on this error only."""
    moved = dict(archived_ids(missing, database))
    reasons = []
    if moved:
        done = ", ".join(f"{task_id} ({status})" for task_id, status in sorted(moved.items()))
        reasons.append(
            f"depends_on names tasks that finished and were moved to tasks_finished, where no task can"
            f" become a parent: {done}"
        )
    absent = [task_id for task_id in missing if task_id not in moved]
    if absent:
        reasons.append(f"depends_on names tasks not in database {database!r}: {absent}")
    return "; ".join(reasons)


def _rate_params(rated: tuple[str, ratelimits.Rate] | None) -> dict[str, Any]:
    key, rate = rated if rated is not None else (None, None)
    return {
        "rate_key": key,
        "rate_limit": rate.count if rate else None,
        "rate_period": rate.period if rate else None,
    }


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


def _task_id(task: int | Enqueued | models.Model) -> int:
    value = task.id if isinstance(task, Enqueued) else task.pk if isinstance(task, models.Model) else task
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkflowError(f"depends_on takes task ids, Enqueued or Task rows, not {task!r}")
    return value
