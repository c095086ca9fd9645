"""Workflows: run B after A, a callback once a group is done, any graph of dependencies.

::

    from tasks.workflows import chain, group, step, Workflow

    chain(step(fetch, url), step(parse), step(store)).enqueue()          # each gets the last result
    group([step(resize, n) for n in ids], then=step(notify)).enqueue()   # notify once all are final

    flow = Workflow("report")
    a = flow.add(step("app.jobs.load", "sales"))
    b = flow.add(step("app.jobs.load", "costs"))
    flow.add(step("app.jobs.merge"), after=[a, b], pipe=True)           # merge([sales, costs])
    flow.enqueue()

A step is a django.tasks Task (enqueued through its :class:`~tasks.backends.LeaseBackend`, with its
queue, priority and the backend's options) or the import path of any callable. Everything a
workflow enqueues is written in one transaction (the caller's, if one is open): a workflow enqueued
in a transaction that rolls back leaves nothing. The database then moves it on its own
(tasks/lifecycle/workflows.py): the statement that finishes a member releases or cancels what waits
for it, so a callback runs once, after every member it waits for is final, whatever crashes.

A handler reads its parents' outcomes with :func:`parent_results`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from django.db import connections, transaction

from tasks import tracing
from tasks.backends.backend import LeaseBackend
from tasks.compat import Task as DjangoTask
from tasks.compat import TaskResult, TaskResultStatus, normalize_json, task_enqueued
from tasks.conf import get_settings
from tasks.lifecycle import prepared
from tasks.lifecycle import statements as sql
from tasks.lifecycle import workflows as wf_sql
from tasks.lifecycle.ratelimits import rate_for_enqueue
from tasks.lifecycle.routing import queue_database
from tasks.lifecycle.storable import storable_json
from tasks.lifecycle.values import event_name, fair_key_for, validate_concurrency, validate_enqueue
from tasks.lifecycle.workflows import ON_PARENT_FAILURE, WorkflowError, WorkflowKind, WorkflowStatus
from tasks.models import Workflow as WorkflowRow
from tasks.models.task_enqueue import announce_enqueued
from tasks.runtime import current_task

__all__ = [
    "EnqueuedWorkflow",
    "ParentResult",
    "Step",
    "Workflow",
    "WorkflowError",
    "WorkflowStatus",
    "chain",
    "group",
    "parent_results",
    "step",
]


@dataclass(frozen=True)
class Step:
    """One task of a workflow, not enqueued yet. ``task``: a django.tasks Task or an import path."""

    task: DjangoTask | str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    queue: str | None = None
    priority: int | None = None
    run_after: dt.datetime | None = None
    max_attempts: int | None = None
    timeout: float | None = None
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    rate_key: str | None = None
    rate_limit: Any = None
    fair_key: str | None = None

    def options(self, **changes: Any) -> Step:
        """This step with other options (queue, priority, run_after, max_attempts, timeout,
        concurrency_key, concurrency_limit, rate_key, rate_limit, fair_key)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)} - {"task"}
        if unknown or "task" in changes:
            raise TypeError(f"unknown step options: {', '.join(sorted(unknown | ({'task'} & set(changes))))}")
        return dataclasses.replace(self, **changes)

    def row(
        self, checked: set[tuple[Any, ...]] | None = None, *, defaults: Defaults | None = None
    ) -> tuple[dict[str, Any], str, DjangoTask | None, LeaseBackend | None]:
        """The member's columns, its database and (for a django.tasks Task) the Task and its backend.
        ``checked``: option sets validated already (a group of 10,000 like steps validates once);
        ``defaults``: settings and routes, looked up once per workflow."""
        defaults = defaults or Defaults()
        args: Any
        kwargs: Any
        attempts: int | None
        backend: LeaseBackend | None
        if isinstance(self.task, str):
            # "" is refused below (validate_enqueue), as Task.objects.enqueue refuses it: not taken for "default".
            path, queue = self.task, "default" if self.queue is None else self.queue
            priority = 0 if self.priority is None else self.priority
            args, kwargs = list(self.args), dict(self.kwargs)
            attempts = self.max_attempts
            backend_alias, backend, task, run_after = None, None, None, self.run_after
            key, limit, timeout = self.concurrency_key, self.concurrency_limit, self.timeout
            rate_key, rate_limit = self.rate_key, self.rate_limit
            fair_key = self.fair_key
            database = defaults.database(queue)
        elif isinstance(self.task, DjangoTask):
            task = self.task
            if self.queue is not None:
                task = task.using(queue_name=self.queue)
            if self.priority is not None:
                task = task.using(priority=self.priority)
            if self.run_after is not None:
                task = task.using(run_after=self.run_after)
            chosen = task.get_backend()
            if not isinstance(chosen, LeaseBackend):
                raise WorkflowError(
                    f"{task.module_path} uses backend {task.backend!r}, which is not a LeaseBackend: "
                    "only this queue's tasks can wait for each other"
                )
            backend = chosen
            seen = ("task", task.module_path, task.backend, task.queue_name, task.priority, task.run_after)
            if checked is None or seen not in checked:  # a group of 10,000 like steps validates once
                backend.validate_task(task)
                if checked is not None:
                    checked.add(seen)
            path, queue, priority, run_after = task.module_path, task.queue_name, task.priority, task.run_after
            args, kwargs = normalize_json(list(self.args)), normalize_json(dict(self.kwargs))
            key, limit = self.concurrency_key, self.concurrency_limit
            if key is None:
                key, limit = backend.concurrency_of(task, args, kwargs)
            rate_key, rate_limit = self.rate_key, self.rate_limit
            if rate_key is None and rate_limit is None:
                rate_key, rate_limit = backend.rate_of(task, args, kwargs)
            fair_key = self.fair_key if self.fair_key is not None else backend.fair_key_of(task, args, kwargs)
            attempts = backend.max_attempts if self.max_attempts is None else self.max_attempts
            attempts = None if attempts is None else int(attempts)
            timeout = backend.timeout if self.timeout is None else self.timeout
            backend_alias = backend.alias
            database = backend.using if backend.explicit_database else defaults.database(queue)
        else:
            raise WorkflowError(f"a step runs a django.tasks Task or an import path, not {self.task!r}")
        if attempts is None:
            attempts = defaults.max_attempts
        options = (queue, priority, attempts, timeout, key, limit)
        if checked is None or options not in checked:
            validate_enqueue(queue=queue, priority=priority, max_attempts=attempts, timeout=timeout)
            validate_concurrency(key, limit)
            if checked is not None:
                checked.add(options)
        rated = rate_for_enqueue(rate_key, rate_limit)
        # in a fair queue a member takes its turn like any enqueue: its key, or the shared key ""
        fair = fair_key_for(queue, fair_key, defaults.fair_queues)
        columns: dict[str, Any] = {
            "queue": queue,
            "priority": priority,
            "task_path": path,
            "args": args,
            "kwargs": kwargs,
            "run_after": run_after,
            "max_attempts": attempts,
            "timeout": timeout,
            "backend_alias": backend_alias,
            "concurrency_key": key,
            "concurrency_limit": limit,
            "rate_key": rated[0] if rated else None,
            "rate_limit": rated[1].count if rated else None,
            "rate_period": rated[1].period if rated else None,
            "fair_key": fair,
        }
        return columns, database, task if backend_alias else None, backend


class Defaults:
    """What every step of one workflow looks up alike (MAX_ATTEMPTS, each queue's database): once."""

    def __init__(self) -> None:
        self._databases: dict[str, str] = {}
        self.max_attempts = get_settings().MAX_ATTEMPTS
        self.fair_queues = get_settings().FAIR_QUEUES

    def database(self, queue: str) -> str:
        database = self._databases.get(queue)
        if database is None:
            database = self._databases[queue] = queue_database(queue)
        return database


def step(task: DjangoTask | str, *args: Any, **kwargs: Any) -> Step:
    """A step calling ``task(*args, **kwargs)``; options with :meth:`Step.options`."""
    return Step(task, tuple(args), dict(kwargs))


@dataclass(frozen=True)
class EnqueuedWorkflow:
    """What :meth:`Workflow.enqueue` wrote: the workflow row's id and each step's task id, in the
    order the steps were added."""

    id: int
    task_ids: list[int]
    database: str
    callback_id: int | None = None

    def refresh(self) -> WorkflowRow:
        return WorkflowRow.objects.using(self.database).get(pk=self.id)

    def cancel(self) -> int:
        """Cancel every unfinished member (see :meth:`tasks.models.WorkflowQuerySet.cancel`)."""
        return WorkflowRow.objects.using(self.database).filter(pk=self.id).cancel()

    def send_event(self, name: str, payload: Any = None) -> list[int]:
        """Send an event to every unfinished member (see :func:`send_workflow_event`)."""
        return send_workflow_event(self.id, name, payload, using=self.database)


def send_workflow_event(workflow_id: int, name: str, payload: Any = None, *, using: str | None = None) -> list[int]:
    """Send the event ``name`` with ``payload`` (JSON) to every unfinished member of a workflow, as
    :func:`tasks.steps.send_event` to each: the ids of the members it was stored for, in id order (a
    member that had one of the name keeps its first payload and is not among them; a finished member
    is left out). Members waiting for it are made due at once. Raises
    ``tasks.models.Workflow.DoesNotExist`` for no such workflow. One transaction, whatever the
    number of members; a cancel of the workflow or a finish in flight commits first."""
    event_name(name)
    text = storable_json(payload)
    manager = WorkflowRow.objects.db_manager(using) if using else WorkflowRow.objects
    if not manager.filter(pk=workflow_id).exists():
        raise WorkflowRow.DoesNotExist(f"no workflow with id {workflow_id}")
    with transaction.atomic(using=manager.db), connections[manager.db].cursor() as cursor:
        cursor.execute(sql.WORKFLOW_EVENT_LOCK_SQL, {"workflow": workflow_id})
        members = [member for (member,) in cursor.fetchall()]
        if not members:
            return []
        cursor.execute(sql.EVENT_SEND_SQL, {"ids": members, "name": name, "payload": text})
        return sorted(member for (member,) in cursor.fetchall())


@dataclass
class _Node:
    step: Step
    after: list[int]
    on_failure: str
    pipe: bool


class Workflow:
    """A graph of steps: :meth:`add` each with the steps it waits for, then :meth:`enqueue`."""

    def __init__(self, name: str = "", *, kind: str = WorkflowKind.GRAPH) -> None:
        if len(name) > 200:
            raise WorkflowError("a workflow's name has at most 200 characters")
        self.name = name
        self.kind = kind
        self.callback: int | None = None
        self._nodes: list[_Node] = []

    def __len__(self) -> int:
        return len(self._nodes)

    def add(self, step: Step, *, after: Iterable[int] = (), on_failure: str = "cancel", pipe: bool = False) -> int:
        """Add ``step``, to run once the steps ``after`` (handles :meth:`add` returned) are final.
        ``on_failure``: "cancel" (one of them failed or was cancelled: this one is cancelled, and so
        is what waits for it under "cancel") or "run" (it runs anyway; see :func:`parent_results`).
        ``pipe``: their return values come first among its arguments (one: the value; several: a
        list in the order the steps were added). Returns the step's handle."""
        if not isinstance(step, Step):
            raise WorkflowError(f"add() takes a Step (tasks.workflows.step(...)), not {step!r}")
        if on_failure not in ON_PARENT_FAILURE:
            raise WorkflowError(f"on_failure must be one of {', '.join(ON_PARENT_FAILURE)}, not {on_failure!r}")
        ups = list(dict.fromkeys(after))
        if pipe and not ups:
            raise WorkflowError("pipe needs at least one step to wait for")
        self._nodes.append(_Node(step, ups, on_failure, pipe))
        return len(self._nodes) - 1

    def enqueue(self, *, using: str | None = None) -> EnqueuedWorkflow:
        """Write the workflow and every step in one transaction: the steps that wait for none are
        READY at once (when it commits), the others AWAITING. Raises :class:`WorkflowError` for a
        cycle, an unknown step or steps routed to several databases, and changes nothing then."""
        if not self._nodes:
            raise WorkflowError("a workflow needs at least one step")
        wf_sql.check_graph({i: node.after for i, node in enumerate(self._nodes)}, len(self._nodes))
        checked: set[tuple[Any, ...]] = set()
        defaults = Defaults()
        rows = [node.step.row(checked, defaults=defaults) for node in self._nodes]
        databases = {using} if using is not None else {database for _, database, _, _ in rows}
        if len(databases) != 1:
            raise WorkflowError(
                f"a workflow's steps live in one database; these queues are in {', '.join(sorted(databases))}"
            )
        (database,) = databases
        members = [{**row[0], "waiting_on": len(node.after)} for row, node in zip(rows, self._nodes, strict=True)]
        for member, node in zip(members, self._nodes, strict=True):
            if node.pipe:  # a placeholder the release fills (and a requeue's release fills again)
                member["args"] = [None, *member["args"]]
        grouped = self.kind == WorkflowKind.GROUP and self.callback is not None
        if grouped:
            assert self.callback is not None
            members[self.callback]["waiting_on"] = -1  # counted on the workflow row (lifecycle/workflows.py)
        connection = connections[database]
        tracer = tracing.tracer()
        with (
            nullcontext((None, None))
            if tracer is None
            else tracing.enqueuing(
                tracer,
                f"workflow {self.name or self.kind}",
                None,
                {"leasing.workflow.kind": str(self.kind), "messaging.batch.message_count": len(members)},
            )
        ) as (span, trace_context):
            workflow, ids, callback = self._insert(connection, database, members, rows, grouped, trace_context)
            if span is not None:
                span.set_attribute("leasing.workflow.id", workflow)
        announce_enqueued(database, ids)
        return EnqueuedWorkflow(workflow, ids, database, callback)

    def _insert(
        self,
        connection: Any,
        database: str,
        members: list[dict[str, Any]],
        rows: list[Any],
        grouped: bool,
        trace_context: str | None,
    ) -> tuple[int, list[int], int | None]:
        """The statements of :meth:`enqueue`, in one transaction: (workflow id, step ids, callback id)."""
        with transaction.atomic(using=database):
            # Server-side bound (and prepared where the connection allows: tasks/lifecycle/prepared.py):
            # Django's client-side binding would quote every element of the arrays in Python.
            ids = [row[0] for row in prepared.rows(connection, wf_sql.RESERVE_IDS_SQL, {"n": len(members)})]
            callback = ids[self.callback] if self.callback is not None else None
            ((workflow, created_at),) = prepared.rows(
                connection,
                wf_sql.CREATE_WORKFLOW_SQL,
                {
                    "name": self.name,
                    "kind": str(self.kind),
                    "total": len(members),
                    "callback": callback,
                    "callback_waiting": (
                        len(self._nodes[self.callback].after) if grouped and self.callback is not None else 0
                    ),
                    # The fast path of a group's settle (tasks/lifecycle/workflows.py) reads no edges:
                    # only while the callback is the one step that waits, and waits for every other
                    # (group(...).add() may add others, after a member or after the callback itself).
                    "callback_only": self.kind == WorkflowKind.GROUP
                    and all(not node.after or i == self.callback for i, node in enumerate(self._nodes))
                    and (
                        self.callback is None
                        or set(self._nodes[self.callback].after) == set(range(len(self._nodes))) - {self.callback}
                    ),
                },
            )
            prepared.rows(
                connection, wf_sql.INSERT_MEMBERS_SQL, wf_sql.member_params(workflow, ids, members, trace_context)
            )
            edges = [
                (ids[i], node.on_failure, node.pipe, [ids[up] for up in node.after])
                for i, node in enumerate(self._nodes)
                if node.after
            ]
            if edges:
                prepared.rows(connection, wf_sql.INSERT_EDGES_SQL, wf_sql.edge_params(edges))
            if task_enqueued.has_listeners():
                for task_id, (columns, _, task, backend) in zip(ids, rows, strict=True):
                    if task is not None and backend is not None:
                        _signal_enqueued(task, backend, task_id, database, columns, created_at)
        return workflow, ids, callback


def _signal_enqueued(
    task: DjangoTask, backend: LeaseBackend, task_id: int, database: str, columns: dict[str, Any], at: dt.datetime
) -> None:
    result: TaskResult = TaskResult(
        task=task,
        id=backend.result_id(task_id, database),
        status=TaskResultStatus.READY,
        enqueued_at=at,
        started_at=None,
        finished_at=None,
        last_attempted_at=None,
        args=columns["args"],
        kwargs=columns["kwargs"],
        backend=backend.alias,
        errors=[],
        worker_ids=[],
    )
    task_enqueued.send(type(backend), task_result=result)


def chain(*steps: Step, pipe: bool = True, name: str = "") -> Workflow:
    """Steps one after another: each runs once the one before it SUCCEEDED, and receives its
    return value as its first argument (``pipe=False``: not). A step that fails for good (after its
    retries) or is cancelled cancels the rest, with the reason."""
    if not steps:
        raise WorkflowError("a chain needs at least one step")
    flow = Workflow(name, kind=WorkflowKind.CHAIN)
    previous: int | None = None
    for s in steps:
        previous = flow.add(s) if previous is None else flow.add(s, after=[previous], pipe=pipe)
    flow.callback = previous
    return flow


def group(
    steps: Sequence[Step], *, then: Step | None = None, on_failure: str = "cancel", pipe: bool = False, name: str = ""
) -> Workflow:
    """Steps that run side by side, and optionally a callback ``then`` that runs once, when every
    one of them is final. ``on_failure="cancel"``: a member that failed for good or was cancelled
    cancels the callback (the other members still run); ``"run"``: the callback runs anyway and
    reads the failures with :func:`parent_results`. ``pipe``: the callback receives the list of
    return values (in step order; None for a failed member) as its first argument."""
    if not steps:
        raise WorkflowError("a group needs at least one step")
    flow = Workflow(name, kind=WorkflowKind.GROUP)
    members = [flow.add(s) for s in steps]
    if then is not None:
        flow.callback = flow.add(then, after=members, on_failure=on_failure, pipe=pipe)
    elif pipe:
        raise WorkflowError("pipe needs a callback (then=...)")
    return flow


@dataclass(frozen=True)
class ParentResult:
    """A task the current one depends on, as it ended."""

    id: int
    status: str
    task_path: str
    return_value: Any
    errors: list[dict[str, Any]]
    finished_at: dt.datetime | None

    @property
    def succeeded(self) -> bool:
        return self.status == "SUCCESSFUL"


def parent_results(task_id: int | None = None, *, using: str | None = None) -> list[ParentResult]:
    """The tasks ``task_id`` depends on (default: the running task), in id order, with their
    statuses, return values and errors: a callback's view of its group."""
    if task_id is None:
        run = current_task()
        task_id, using = run.id, using or run.using
    with connections[using or "default"].cursor() as cursor:
        cursor.execute(wf_sql.PARENTS_SQL, {"id": task_id})
        rows = cursor.fetchall()
    return [
        ParentResult(id, status, path, _json(value), _json(errors) or [], finished)
        for id, status, path, value, errors, finished in rows
    ]


def _json(value: Any) -> Any:
    # Django's cursor hands jsonb over as text (its JSONField decodes it; a raw cursor does not).
    return json.loads(value) if isinstance(value, str) else value
