"""JSON API for the task queue: enqueue, and the worker protocol for clients in any language
(claim ``next``, ``heartbeat``, ``complete``, ``fail``), plus listings and administration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

from django.db import transaction
from django.db.models import Q, QuerySet
from django.http import HttpRequest, JsonResponse
from django.urls import path, re_path

from leasing import metrics
from leasing.access import ADD_TASK, CHANGE_GENERATOR, CHANGE_TASK, VIEW_GENERATOR, VIEW_TASK
from leasing.http import ApiError, Body, api_view, iso, page_args, query_id, query_text, routed
from tasks import redaction
from tasks.backends import allowlist
from tasks.conf import get_settings
from tasks.demo import generator
from tasks.exceptions import TaskError, TaskPathRefused
from tasks.lifecycle.ratelimits import RateKeyState, parse_rate, queue_rate, rate_key_states
from tasks.lifecycle.routing import queue_database, queues_by_database
from tasks.lifecycle.storable import is_storable
from tasks.lifecycle.values import fair_after_claim
from tasks.lifecycle.windows import MAX_WINDOW_SECONDS, WindowError, validate_windows
from tasks.models import (
    FINISHED,
    MAX_CONCURRENCY_LIMIT,
    ClaimedTask,
    Failure,
    SharedFairCursor,
    Started,
    Task,
    TaskStatus,
)
from tasks.models.task_attempts import is_fair_claim
from tasks.web import history as history_views
from tasks.web import queue_pages as queue_views
from tasks.web.api import bulk as bulk_api
from tasks.web.api import schedules as schedule_api
from tasks.web.api import workflows as workflow_api
from tasks.web.api.events import event_body
from tasks.web.listings import ALL_STATUSES, Listing

MAX_TTL = 86_400.0
#: name -> (queryset, the statuses it can hold): a listing is read one status at a time (tasks/web/listings.py).
LISTINGS = {
    "processed": (lambda: Task.objects.finished(), FINISHED),
    "started": (lambda: Task.objects.running(), (TaskStatus.RUNNING,)),
    "stuck": (lambda: Task.objects.stuck(), (TaskStatus.RUNNING,)),
}
_MAX_TOKEN = 2**63 - 1


#: Characters of a traceback that a list shows (its end: where it failed); the task's own URL has it whole.
LIST_TRACEBACK = 500


def task_summary_json(task: Task) -> dict[str, Any]:
    """A task as lists show it: each error's traceback cut to its last LIST_TRACEBACK characters
    (a list of 500 tasks must not carry 500 error histories whole); ``GET /api/tasks/<id>`` has it all."""
    data = task_json(task)
    errors = []
    for error in task.errors:
        text = error.get("traceback") or ""
        if len(text) > LIST_TRACEBACK:
            error = {**error, "traceback": "…" + text[-LIST_TRACEBACK:], "traceback_truncated": True}
        errors.append(error)
    data["errors"] = errors
    return data


def task_json(task: Task, *, window: bool = False, redact: bool = True) -> dict[str, Any]:
    """A task as JSON; with ``window`` also its unique_for window (one primary-key probe of
    tasks_uniquekey, only for a task with a dedup key): the task's own URL and the enqueue show it.
    Its arguments are redacted (tasks/redaction.py) unless ``redact`` is False: a client that claimed
    the task to run it gets the real ones."""
    args, kwargs = redaction.redact(task.task_path, task.args, task.kwargs) if redact else (task.args, task.kwargs)
    return {
        "id": task.pk,
        "task_path": task.task_path,
        "queue": task.queue,
        "priority": task.priority,
        "status": task.status,
        "stuck": task.is_stuck,
        # moved to tasks_finished by the mover (ARCHIVE_AFTER): history, every action answers 409
        "archived": task.archived,
        "args": args,
        "kwargs": kwargs,
        "attempts": task.attempts,
        "max_attempts": task.max_attempts,
        "timeout": task.timeout,
        "dedup_key": task.dedup_key,
        **({"unique_window": unique_window_json(task)} if window else {}),
        "debounce_key": task.debounce_key,
        "debounce_until": iso(task.debounce_until),
        "debounces": task.debounces,
        "concurrency_key": task.concurrency_key,
        "fair_key": task.fair_key,
        "concurrency_limit": task.concurrency_limit,
        "rate_key": task.rate_key,
        "rate_limit": None if task.rate_limit is None else [task.rate_limit, task.rate_period],
        "rate_refusals": task.rate_refusals,
        "run_after": iso(task.run_after),
        "enqueued_at": iso(task.enqueued_at),
        "started_at": iso(task.started_at),
        "last_attempted_at": iso(task.last_attempted_at),
        "finished_at": iso(task.finished_at),
        "holder": task.holder,
        "token": task.token,
        "expires_at": iso(task.expires_at),
        "renewed_at": iso(task.renewed_at),
        "progress": task.progress,
        "output": task.return_value,
        "errors": task.errors,
        "errors_dropped": task.errors_dropped,
        "snoozes": task.snoozes,
        "snoozed": task.is_snoozed,
        "wakes_at": iso(task.run_after) if task.is_snoozed else None,
        "cancel_reason": task.cancel_reason,
        "retry_policy": task.retry_policy,
        "worker_ids": task.worker_ids,
        "workflow_id": task.workflow_id,
        "waiting_on": task.parents_left if task.status == "AWAITING" else task.waiting_on,
    }


def unique_window_json(task: Task) -> dict[str, Any] | None:
    """The unique_for window this task opened, while it lasts (None: none, or it passed)."""
    window = task.unique_window()
    if window is None:
        return None
    return {"key": window.key, "accepted_at": iso(window.accepted_at), "expires_at": iso(window.expires_at)}


def _found_or_404(task_id: int) -> Task:
    """The task wherever it lives: in tasks_task, or moved to tasks_finished once finished."""
    task = Task.objects.find(task_id) if 0 < task_id <= _MAX_TOKEN else None
    if task is None:
        raise ApiError(404, f"no task with id {task_id}")
    return task


def _task_or_404(task_id: int) -> Task:
    """A task an action may change: a task moved to tasks_finished is history (409)."""
    task = _found_or_404(task_id)
    if task.archived:
        raise ApiError(
            409,
            f"task is {task.status.lower()} and kept in the finished history: nothing changes it",
            status=task.status,
        )
    return task


def _listing(request: HttpRequest, queryset: QuerySet[Task], statuses: Sequence[str] = ALL_STATUSES) -> tuple[int, Any]:
    status = request.GET.get("status")
    if status is not None:
        if status not in TaskStatus.values:
            raise ApiError(400, f"status must be one of {', '.join(TaskStatus.values)}", "status")
        queryset = queryset.filter(status=status)
        statuses = [s for s in statuses if s == status]
    lookups = None
    if queue := query_text(request, "queue", max_length=100):
        lookups = [Q(queue=queue)]
    if (workflow := query_id(request, "workflow_id")) is not None:
        # A workflow's members, through tasks_task_workflow_idx (tasks/web/workflows.py): the
        # workflow drives each branch and a queue is checked among its members.
        queryset = queryset.filter(*(lookups or ()))
        lookups = [Q(workflow_id=workflow)]
    # One ordered index scan per status (and queue), each stopping after the page: no sort of
    # every task of a queue.
    limit, before = page_args(request)
    page = Listing(queryset, statuses, lookups=lookups).page(limit=limit, before=before)
    # The next page keeps the filters of this one.
    kept = {name: request.GET[name] for name in ("status", "queue", "workflow_id") if request.GET.get(name)}
    return 200, {
        "tasks": [task_summary_json(task) for task in page.tasks],
        "next": "?" + urlencode({"limit": limit, "before": page.next_before, **kept})
        if page.next_before is not None
        else None,
    }


def _worker_and_token(body: Body) -> tuple[str, int]:
    return body.text("worker", max_length=200), body.whole("token", low=1, high=_MAX_TOKEN)


def _rejected(task: Task, action: str) -> ApiError:
    metrics.fencing_rejections.inc()
    if task.status in FINISHED:
        reason = f"task is already {task.status.lower()}"
    elif task.status in (TaskStatus.AWAITING, TaskStatus.BLOCKED, TaskStatus.READY):
        reason = "task was requeued: your claim expired"
    else:
        reason = "your claim is gone: wrong worker or token, or the lease expired"
    return ApiError(409, f"{action} rejected: {reason}", status=task.status)


@api_view(GET=[VIEW_TASK], POST=[ADD_TASK])
def tasks(request: HttpRequest) -> tuple[int, Any]:
    if request.method == "GET":
        return _listing(request, Task.objects.all())
    body = Body(request)
    body.only(
        "task_path",
        "args",
        "kwargs",
        "payload",
        "queue",
        "priority",
        "run_after",
        "max_attempts",
        "timeout",
        "dedup_key",
        "concurrency_key",
        "concurrency_limit",
        "rate_key",
        "rate_limit",
        "unique_for",
        "debounce",
        "max_wait",
        "fair_key",
    )
    task_path = body.text("task_path")
    reason = allowlist.refusal(task_path)
    if reason is not None:
        raise ApiError(400, reason, "task_path")
    try:
        allowlist.resolve(task_path)
    except TaskPathRefused as exc:
        raise ApiError(400, str(exc), "task_path") from None
    except Exception as exc:  # the module does not import: it could not run either
        raise ApiError(400, f"task_path cannot be imported: {type(exc).__name__}", "task_path") from None
    kwargs = body.mapping("kwargs")
    payload = body.mapping("payload")
    if kwargs is not None and payload is not None:
        raise ApiError(400, "give kwargs or payload (the same thing), not both", "payload")
    options: dict[str, Any] = {
        "args": body.array("args") or [],
        "kwargs": kwargs if kwargs is not None else payload,
        "queue": body.text("queue", required=False, max_length=100, default="default"),
        "priority": body.whole("priority", required=False, low=-100, high=100, default=0),
        "run_after": body.when("run_after"),
        "max_attempts": body.whole("max_attempts", required=False, low=1, high=1000),
        "timeout": body.number("timeout", required=False, low=0, high=MAX_TTL),
        "dedup_key": body.text("dedup_key", required=False),
        "concurrency_key": body.text("concurrency_key", required=False),
        "concurrency_limit": body.whole("concurrency_limit", required=False, low=1, high=MAX_CONCURRENCY_LIMIT),
        "unique_for": body.number("unique_for", required=False, low=0, high=MAX_WINDOW_SECONDS),
        "debounce": body.number("debounce", required=False, low=0, high=MAX_WINDOW_SECONDS),
        "max_wait": body.number("max_wait", required=False, low=0, high=MAX_WINDOW_SECONDS),
        "fair_key": body.text("fair_key", required=False),
    }
    if (options["concurrency_key"] is None) != (options["concurrency_limit"] is None):
        missing = "concurrency_limit" if options["concurrency_limit"] is None else "concurrency_key"
        raise ApiError(400, "concurrency_key and concurrency_limit go together: give both or neither", missing)
    options["rate_key"] = body.text("rate_key", required=False)
    options["rate_limit"] = body.data.get("rate_limit")
    if (options["rate_key"] is None) != (options["rate_limit"] is None):
        missing = "rate_limit" if options["rate_limit"] is None else "rate_key"
        raise ApiError(400, "rate_key and rate_limit go together: give both or neither", missing)
    if options["rate_limit"] is not None:
        try:
            parse_rate(options["rate_limit"])
        except ValueError as exc:
            raise ApiError(400, str(exc), "rate_limit") from None
    try:
        validate_windows(
            **{name: options[name] for name in ("dedup_key", "unique_for", "debounce", "max_wait", "run_after")}
        )
    except WindowError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    queue = options["queue"]
    with routed(request, queue_database(queue), f"queue {queue!r}"):
        try:
            enqueued = Task.objects.enqueue(task_path, **options)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if enqueued.created:
            # Same transaction as the insert (the request's): no worker can claim the row before it is
            # marked, and a worker re-checks the path of every marked row before importing it.
            Task.objects.filter(pk=enqueued.id).update(api_origin=True)
        # A unique_for window outlives its task's stay in tasks_task (the mover) and may outlive its
        # row (retention pruned it first: the id alone).
        task = Task.objects.find(enqueued.id)
        found = task_json(task, window=True) if task is not None else None
        return (201 if enqueued.created else 200), {"task": found, "task_id": enqueued.id, "created": enqueued.created}


#: Where this process's API claims' turns go on, per (database, fair queue): the queue's shared cursor
#: (tasks/models/fair_cursor.py), read at the process's first claim of the queue and written back at
#: most once a second. Bounded by the fair queues named in settings (only a fair claim makes one).
_fair_cursors: dict[tuple[str, str], SharedFairCursor] = {}


@api_view(POST=[CHANGE_TASK])
def next_task(request: HttpRequest) -> tuple[int, Any]:
    body = Body(request)
    body.only("worker", "queues", "ttl", "limit", "fair_after")
    worker = body.text("worker", max_length=200)
    queues = body.names("queues", default=["default"])
    # From a fair queue, the turns start after the client's own cursor (the last key it served) or,
    # without one, after the last key this process's claims of the queue served, and at its first
    # claim of the queue where the database's claimers left them (the shared cursor): a client
    # claiming one at a time still goes round the keys, across restarts and replicas of the web tier.
    fair_after = body.text("fair_after", required=False)
    homes = queues_by_database(queues)
    if len(homes) > 1:
        spread = "; ".join(f"{alias}: {', '.join(names)}" for alias, names in homes.items())
        raise ApiError(400, f"queues live in several databases ({spread}): claim from one at a time", "queues")
    limit = body.whole("limit", required=False, low=1, high=100, default=1)
    ttl = body.number("ttl", required=False, low=0, high=MAX_TTL, default=get_settings().TTL)
    fair = is_fair_claim(queues, limit)
    alias = next(iter(homes))
    shared = _fair_cursors.setdefault((alias, queues[0]), SharedFairCursor(queues[0], alias)) if fair else None
    with routed(request, alias, f"queue {queues[0]!r}"):
        start_after = fair_after if fair_after is not None or shared is None else shared.current()
        # An HTTP client runs what it claims: the attempt begins (and is charged) now. A rate-limited
        # one (a rate key of its own, or its queue's) begins only if its key grants the start now;
        # one refused went back to the queue uncharged and is not returned.
        queue_wide = any(queue_rate(name) is not None for name in queues)
        claimed = Task.objects.claim(
            worker,
            limit=limit,
            queues=queues,
            ttl=ttl,
            start=not queue_wide,
            fair_after=start_after,
        )
        reply: dict[str, Any] = {}
        if shared is not None:
            # where this claim's last turn went (not the key of the last task returned: a key with
            # nothing due took its turn too): the cursor a client sends back as its next fair_after
            cursor = fair_after_claim(claimed, start_after)
            shared.advance(cursor)
            shared.sync()
            reply["fair_after"] = cursor
        claimed = [c for c in claimed if _started_now(c, worker, queue_wide)]
        rows = {task.pk: task for task in Task.objects.filter(pk__in=[c.id for c in claimed])}
        # The claimer runs these tasks: it gets their real arguments.
        found = [task_json(rows[c.id], redact=False) for c in claimed if c.id in rows]
        return 200, {"task": found[0] if found else None, "tasks": found, **reply}


def _started_now(claimed: ClaimedTask, worker: str, queue_wide: bool) -> bool:
    """An API claim's attempt has begun: started by the claim, or granted by its rate key now."""
    if claimed.rate_key is None and (not queue_wide or queue_rate(claimed.queue) is None):
        if queue_wide:  # claimed unstarted beside rate-limited queues: it begins now
            return Task.objects.start(claimed.id, worker, claimed.token) is not None
        return True
    started = Task.objects.rate_start(claimed.id, worker, claimed.token, queue=claimed.queue)
    return isinstance(started, Started)


@api_view(PUT=[CHANGE_TASK])
def heartbeat(request: HttpRequest, task_id: int) -> tuple[int, Any]:
    task = _task_or_404(task_id)
    body = Body(request)
    body.only("worker", "token", "ttl", "progress")
    worker, token = _worker_and_token(body)
    ttl = body.number("ttl", required=False, low=0, high=MAX_TTL, default=get_settings().TTL)
    progress = body.data.get("progress")
    if "progress" in body.data and not is_storable(progress):
        # Checked before anything is written: a rejected request changes nothing.
        raise ApiError(400, "progress cannot be stored as JSON (NaN, infinity, NUL or a lone surrogate)", "progress")
    if Task.objects.heartbeat(worker, [(task_id, token)], ttl=ttl):
        raise _rejected(Task.objects.find(task.pk) or task, "heartbeat")
    if "progress" in body.data and not Task.objects.checkpoint(task_id, worker, token, progress):
        raise _rejected(Task.objects.find(task.pk) or task, "checkpoint")
    task.refresh_from_db()
    return 200, {"task": task_json(task)}


@api_view(PUT=[CHANGE_TASK])
def complete(request: HttpRequest, task_id: int) -> tuple[int, Any]:
    task = _task_or_404(task_id)
    body = Body(request)
    body.only("worker", "token", "output")
    worker, token = _worker_and_token(body)
    if not is_storable(body.data.get("output")):
        raise ApiError(400, "output cannot be stored as JSON (NaN, infinity, NUL or a lone surrogate)", "output")
    if not Task.objects.complete(task_id, worker, token, body.data.get("output")):
        raise _rejected(Task.objects.find(task.pk) or task, "completion")
    task.refresh_from_db()
    return 200, {"task": task_json(task)}


@api_view(PUT=[CHANGE_TASK])
def fail(request: HttpRequest, task_id: int) -> tuple[int, Any]:
    task = _task_or_404(task_id)
    body = Body(request)
    body.only("worker", "token", "error", "retry")
    worker, token = _worker_and_token(body)
    error = body.mapping("error") or {}
    for key in ("type", "message", "traceback"):
        if key in error and not isinstance(error[key], str):
            raise ApiError(400, f"error.{key} must be a string", f"error.{key}")
    unknown = sorted(set(error) - {"type", "message", "traceback"})
    if unknown:
        raise ApiError(400, f"unknown field(s) in error: {', '.join(unknown)}", "error")
    failure = Failure(
        task_id,
        token,
        error.get("type", "api.Error")[:255],
        error.get("message", "")[:10_000],
        error.get("traceback", "")[:100_000],
        retry=body.flag("retry", default=True),
    )
    outcome = Task.objects.fail(failure, worker)
    if outcome is None:
        raise _rejected(Task.objects.find(task.pk) or task, "failure report")
    task.refresh_from_db()
    return 200, {"task": task_json(task), "retrying": outcome.retried}


@api_view(GET=[VIEW_TASK])
def task_detail(request: HttpRequest, task_id: int) -> tuple[int, Any]:
    return 200, {"task": task_json(_found_or_404(task_id), window=True)}


@api_view(POST=[CHANGE_TASK])
def cancel(request: HttpRequest, task_id: int) -> tuple[int, Any]:
    task = _task_or_404(task_id)
    if not Task.objects.filter(pk=task_id).cancel():
        raise ApiError(409, f"task is already {task.status.lower()}", status=task.status)
    task.refresh_from_db()
    return 200, {"task": task_json(task)}


@api_view(POST=[CHANGE_TASK])
def requeue(request: HttpRequest, task_id: int) -> tuple[int, Any]:
    task = _found_or_404(task_id)
    try:
        with transaction.atomic(using=Task.objects.db):
            if task.archived:  # back from tasks_finished first, in the requeue's transaction
                Task.objects.restore([task_id])
            changed = Task.objects.filter(pk=task_id).requeue() or Task.objects.filter(pk=task_id).retry_now()
            if not changed and Task.objects.restore([task_id]):
                # Read in tasks_task, then taken by the mover before the requeue (which waited for the
                # move and found the row gone): back from tasks_finished, and requeued.
                changed = Task.objects.filter(pk=task_id).requeue()
    except TaskError as exc:
        raise ApiError(409, str(exc)) from None
    if not changed:
        raise ApiError(409, "only finished or waiting tasks can be requeued; this one is running", status=task.status)
    task.archived = False  # it changed in tasks_task (brought back by this request or another)
    task.refresh_from_db()
    return 200, {"task": task_json(task)}


@api_view(POST=[CHANGE_TASK])
def send_event(request: HttpRequest, task_id: int) -> tuple[int, Any]:
    """An event for a task's ``wait_for_event`` (tasks/steps.py): 201 when stored, 409 when one of the
    name was sent before (the first payload stands) or the task is finished, 404 for no task."""
    from tasks import steps

    task = _task_or_404(task_id)
    name, payload = event_body(request)
    try:
        stored = steps.send_event(task_id, name, payload)
    except ValueError as exc:  # a name tasks.steps refuses (blank)
        raise ApiError(400, str(exc), "name") from None
    except Task.DoesNotExist:
        raise ApiError(404, f"no task with id {task_id}") from None
    except TaskError as exc:
        raise ApiError(409, str(exc), status=task.status) from None
    if not stored:
        raise ApiError(409, f"an event {name!r} was sent to task {task_id} before: the first payload stands", "name")
    return 201, {"task_id": task_id, "event": name}


@api_view(POST=[CHANGE_TASK])
def rerun_from_step(request: HttpRequest, task_id: int) -> tuple[int, Any]:
    """Discard the task's stored steps from ``position`` on and run it again (tasks/steps.py)."""
    from tasks import steps

    _found_or_404(task_id)
    body = Body(request)
    body.only("position")
    position = body.whole("position", low=0, high=2**31 - 1)
    try:
        discarded = steps.rerun_from_step(task_id, position)
    except Task.DoesNotExist:
        raise ApiError(404, f"no task with id {task_id}") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "position") from None
    except TaskError as exc:
        raise ApiError(409, str(exc)) from None
    task = Task.objects.get(pk=task_id)
    return 200, {"task": task_json(task), "discarded": discarded}


def rate_key_json(state: RateKeyState) -> dict[str, Any]:
    return {
        "key": state.key,
        "limit": [state.count, state.period],
        "starts_in_window": state.in_window,
        "full": state.full,
        "granted": state.grants,
        "refused": state.refusals,
        "last_refused_until": iso(state.retry_at),
        "last_decided_at": iso(state.decided_at),
    }


@api_view(GET=[VIEW_TASK])
def rate_keys(request: HttpRequest) -> tuple[int, Any]:
    return 200, {"rate_keys": [rate_key_json(s) for s in rate_key_states()]}


def _listing_view(name: str) -> Any:
    @api_view(GET=[VIEW_TASK])
    def view(request: HttpRequest) -> tuple[int, Any]:
        queryset, statuses = LISTINGS[name]
        return _listing(request, queryset(), statuses)

    view.__name__ = f"tasks_{name}"
    return view


def generator_json(name: str = "default") -> dict[str, Any]:
    state = generator.status(name)
    return {
        "name": state.name,
        "running": state.running,
        "rate": state.rate,
        "max_sleep": state.max_sleep,
        "queue": state.queue,
        "generated": state.generated,
        "leader": state.leader,
        "leader_expires_at": iso(state.leader_expires_at),
        "leader_sees_running": state.observed_running,
    }


@api_view(GET=[VIEW_GENERATOR], PUT=[CHANGE_GENERATOR])
def generator_state(request: HttpRequest) -> tuple[int, Any]:
    if request.method == "PUT":
        body = Body(request)
        body.only("running", "rate", "max_sleep")
        running = None if body.data.get("running") is None else body.flag("running", default=False)
        try:
            generator.set_state(
                running=running,
                rate=body.number("rate", required=False, low=0, high=10_000),
                max_sleep=body.number("max_sleep", required=False, low=0, high=3600),
            )
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
    return 200, {"generator": generator_json()}


@api_view(GET=())  # any authenticated caller may read the description of the API
def openapi(request: HttpRequest) -> JsonResponse:
    from tasks.web.api.openapi import document

    # The API is mounted wherever the project includes it: its base is where this document is.
    return JsonResponse(document(request.build_absolute_uri(request.path.removesuffix("/openapi.json"))))


urlpatterns = [
    path("tasks", tasks, name="api-tasks"),
    path("tasks/next", next_task, name="api-task-next"),
    *bulk_api.urlpatterns,
    *[path(f"tasks/{name}", _listing_view(name), name=f"api-tasks-{name}") for name in LISTINGS],
    path("tasks/<int:task_id>", task_detail, name="api-task-detail"),
    path("tasks/<int:task_id>/heartbeat", heartbeat, name="api-task-heartbeat"),
    path("tasks/<int:task_id>/complete", complete, name="api-task-complete"),
    path("tasks/<int:task_id>/fail", fail, name="api-task-fail"),
    path("tasks/<int:task_id>/cancel", cancel, name="api-task-cancel"),
    path("tasks/<int:task_id>/requeue", requeue, name="api-task-requeue"),
    path("tasks/<int:task_id>/events", send_event, name="api-task-events"),
    path("tasks/<int:task_id>/rerun-from-step", rerun_from_step, name="api-task-rerun-from-step"),
    path("generator", generator_state, name="api-generator"),
    path("rate-keys", rate_keys, name="api-rate-keys"),
    *schedule_api.urlpatterns,
    *workflow_api.urlpatterns,
    *queue_views.api_urlpatterns,
    *history_views.api_urlpatterns,
    path("openapi.json", openapi, name="api-openapi"),
]


#: Any authenticated caller may learn that a route does not exist.
@api_view(**dict.fromkeys(("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"), ()))
def not_found(request: HttpRequest, rest: str) -> tuple[int, Any]:
    raise ApiError(404, f"no such API route: {request.path}")


#: Mounted last under /api/: unknown routes answer in JSON too.
# Any path under the API, newlines included (``.`` would not match one, and Django's HTML 404 would answer).
fallback = [re_path(r"^(?P<rest>[\s\S]*)\Z", not_found, name="api-not-found")]
