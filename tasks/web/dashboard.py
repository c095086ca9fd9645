"""The dashboard: what is held, by whom, until when; what is stuck; is the system healthy.

Every page is server-rendered (no front-end build); a few lines of JavaScript refresh the marked
parts in place. No page reads more rows when the table grows (tasks/web/queries.py and
tasks/web/listings.py): counts are capped (exact when small), lists are ordered index scans with
keyset pagination on the primary key, search is an exact lookup, and the last-hour chart reads a
per-minute rollup (tasks/lifecycle/activity.py).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from django.contrib import messages
from django.db import transaction
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from leasing.access import (
    CHANGE_GENERATOR,
    CHANGE_TASK,
    VIEW_GENERATOR,
    VIEW_LEASE,
    VIEW_TASK,
    VIEW_WORKER,
    bad_request_page,
    safe_next,
    staff_page,
)
from leasing.routing import selected_database, with_database
from leasing.validation import MAX_BIGINT, InvalidInput, clean_text, parse_number, parse_whole
from leasing.views import TABS as LEASE_TABS
from leasing.views import state_counts as lease_counts
from tasks import demo, redaction
from tasks.conf import get_settings
from tasks.demo import generator
from tasks.exceptions import TaskError
from tasks.lifecycle import activity, concurrency, ratelimits, vocabulary
from tasks.lifecycle.bulk import KIND_STATUSES, KINDS
from tasks.lifecycle.states import with_db_clock
from tasks.lifecycle.storable import is_storable
from tasks.models import Task, TaskEvent, TaskStatus, TaskStep, Worker, Workflow
from tasks.models.finished import archived_ids
from tasks.web import all_tasks, attempts, filter_box, holds, listings, queries, workflows
from tasks.web.queries import RUNNING_ORDER, STATES, Count, state_counts

PAGE_SIZE = 50
#: Statuses whose tasks hold no lease: their lists drop the lease, heartbeat and progress columns.
FINISHED_STATUSES = frozenset({"SUCCESSFUL", "FAILED", "CANCELLED"})
#: The lists that show each task's newest error (class and message).
ERROR_STATES = frozenset({"failed", "cancelled", "retrying"})

#: Dashboard task states: (description, queryset factory); the queries are in tasks/web/queries.py.
TASK_STATES: dict[str, tuple[str, Any]] = {name: (state.description, state.queryset) for name, state in STATES.items()}


def state_label(name: str) -> str:
    """A dashboard list's name (its URL slug is a machine value): the label of the view it is, or of
    its status (``pending`` lists the Ready tasks that are in no view; ``succeeded`` the Successful ones)."""
    return vocabulary.label(name if name in vocabulary.VIEWS else STATES[name].status)


def task_counts() -> dict[str, Count]:
    return state_counts()


def tabs(counts: dict[str, Count]) -> list[dict[str, Any]]:
    """The state tabs and cards: slug, label, count."""
    return [{"name": name, "label": state_label(name), "count": counts[name]} for name in STATES]


def queue_stats() -> list[dict[str, Any]]:
    """Runnable depth (capped) and age of the oldest runnable task per queue (index lookups per queue)."""
    return queries.queue_stats()


def live_workers() -> QuerySet[Worker]:
    horizon = timezone.now() - dt.timedelta(seconds=get_settings().TTL * 2)
    return Worker.objects.filter(stopped_at__isnull=True, last_seen_at__gte=horizon)


def _minutes() -> list[dt.datetime]:
    now = timezone.now().replace(second=0, microsecond=0)
    return [now - dt.timedelta(minutes=59 - i) for i in range(60)]


def activity_last_hour() -> dict[str, list[int]]:
    """Per minute over the last hour: tasks succeeded, failed for good, and recovered (the rollup)."""
    return activity.last_hour()


#: The chart's series (the rollup's column names) as a page names them (task_states.counter_name).
CHART_NAMES = {"succeeded": "successful"}


def chart(series: dict[str, list[int]], *, width: int = 720, height: int = 140) -> dict[str, Any]:
    """Bar geometry for a server-rendered SVG: one group of bars per minute."""
    peak = max([1, *(sum(values) for values in zip(*series.values(), strict=True))])
    slot = width / 60
    colours = {"succeeded": "#16a34a", "failed": "#dc2626", "recovered": "#d97706"}
    bars = []
    minutes = _minutes()
    for i in range(60):
        base = height
        for name, values in series.items():
            value = values[i]
            if not value:
                continue
            bar_height = value / peak * (height - 10)
            base -= bar_height
            bars.append(
                {
                    "x": round(i * slot + 1, 1),
                    "y": round(base, 1),
                    "w": round(slot - 2, 1),
                    "h": round(bar_height, 1),
                    "fill": colours[name],
                    "title": f"{minutes[i]:%H:%M} {CHART_NAMES.get(name, name)}: {value}",
                }
            )
    totals = {name: sum(values) for name, values in series.items()}
    return {"bars": bars, "width": width, "height": height, "peak": peak, "totals": totals, "colours": colours}


# The overview shows tasks, leases, workers and the generator: it needs the view permission of each.
@staff_page(GET=[VIEW_TASK, VIEW_LEASE, VIEW_WORKER, VIEW_GENERATOR])
def overview(request: HttpRequest) -> HttpResponse:
    counts = task_counts()
    keys = concurrency.key_states()
    return render(
        request,
        "tasks/dashboard/overview.html",
        {
            # The lease pages' tabs, one card each: every lease counted once (held, expired, released).
            "lease_cards": [(name, label, leases[name]) for leases in [lease_counts()] for name, label in LEASE_TABS],
            "task_counts": counts,
            "tabs": tabs(counts),
            "states": TASK_STATES,
            "queues": queue_stats(),
            **waiting_holds(counts, keys),
            # Keys at their limit first; at most concurrency.SHOWN_KEYS, each read from its indexes.
            "concurrency_keys": keys,
            # Rate keys started most recently (at most ratelimits.SHOWN_KEYS), those at their limit first.
            "rate_keys": ratelimits.rate_key_states(),
            "workers": list(live_workers()),
            "chart": chart(activity_last_hour()),
            "generator": generator.status() if demo.installed() else None,
        },
    )


def waiting_holds(counts: dict[str, Count], keys: list[concurrency.KeyState]) -> dict[str, Any]:
    """What holds the waiting tasks (tasks/web/holds.py): the Ready count by reason, the concurrency
    keys at their limit with Blocked tasks, and the Awaiting count (a dependency not finished)."""
    return {
        "holds": holds.waiting_holds(),
        "full_keys": [key for key in keys if key.full and key.waiting],
        "awaiting": counts["awaiting"],
    }


def filter_value(request: HttpRequest, name: str, parse: Any) -> Any:
    """A list filter's parsed value; an invalid one is ignored, with a message saying why."""
    value = request.GET.get(name, "").strip()
    if not value:
        return None
    try:
        return parse(value)
    except InvalidInput as exc:
        messages.error(request, f"Filter ignored: {exc.message}.")
        return None


def bulk_kinds(status: str) -> str:
    """The bulk operations that apply to tasks of ``status``, as a task list's hint offers them
    ("Retry", "Cancel or discard"); "" for none (a running task is never a bulk operation's)."""
    return " or ".join(kind for kind in KINDS if status in KIND_STATUSES[kind]).capitalize()


@staff_page(GET=[VIEW_TASK])
def task_list(request: HttpRequest, state: str) -> HttpResponse:
    if state not in TASK_STATES:
        raise Http404(f"unknown task state {state!r}")
    description, _ = TASK_STATES[state]
    status = STATES[state].status
    queue = filter_value(request, "queue", lambda v: clean_text(v, "queue", max_length=100))
    search = filter_value(request, "q", lambda v: clean_text(v, "search", max_length=255))
    before = filter_value(request, "before", lambda v: parse_whole(v, "before", low=1, high=MAX_BIGINT))
    matched_paths: list[str] = []
    try:
        listing = listings.state_listing(state, queue=queue, search=(search or "").strip(), matched_paths=matched_paths)
    except InvalidInput as exc:  # an argument search without its index, or malformed
        messages.error(request, f"Search refused: {exc.message}.")
        listing = listings.Listing(Task.objects.none(), (), lookups=[])
    page = listing.page(limit=PAGE_SIZE, before=before)
    counts = task_counts()
    if status in (TaskStatus.READY, TaskStatus.AWAITING, TaskStatus.BLOCKED):
        # Each waiting row says what holds it (its queue paused, a rate key's line, its run after, a
        # concurrency key, the tasks it depends on): from its own columns.
        context = holds.RowContext.read()
        for task in page.tasks:
            task.held_by = holds.row_reason(task, context)  # type: ignore[attr-defined]
    return render(
        request,
        "tasks/dashboard/task_list.html",
        {
            "state": state,
            "label": state_label(state),
            "description": description,
            "tabs": tabs(counts),
            # The Ready list says what holds the waiting tasks, as the overview does.
            **(waiting_holds(counts, concurrency.key_states()) if state == "pending" else {}),
            # The rows of a state page share its status: the buttons are the actions that fit it.
            "actions": vocabulary.actions_for([status]),
            "tasks": page.tasks,
            "next_before": page.next_before,
            "scanned_to": page.scanned_to,
            "scan_window": listings.SCAN_WINDOW,
            "queue": queue or "",
            "query": search or "",
            "matched_paths": matched_paths,
            "now": timezone.now(),
            # "All matching" goes to the bulk page with this status (and queue) filled in; a running
            # task is never a bulk operation's. A view (Retrying, Snoozed) is no status a bulk filter
            # takes: its hint says the operation takes every task of the status.
            "bulk_status": vocabulary.label(status) if bulk_kinds(status) else "",
            "bulk_kinds": bulk_kinds(status),
            "bulk_view": state in vocabulary.VIEWS,
            # A finished task holds no lease and reports no progress: those columns would be empty.
            "finished": status in FINISHED_STATUSES,
            "show_errors": state in ERROR_STATES,
        },
    )


#: The durable steps a task's page lists (the first ones, in order), and the events sent to it.
STEP_ROWS = 200
EVENT_ROWS = 100


@staff_page(GET=[VIEW_TASK])
def task_detail(request: HttpRequest, task_id: int) -> HttpResponse:
    task = Task.objects.find(task_id) if 0 < task_id <= MAX_BIGINT else None
    if task is None:
        raise Http404(f"no task with id {task_id}")
    # Only a workflow member has edges (an ad hoc depends_on makes a workflow too): a plain task's
    # page reads nothing more.
    member = task.workflow_id is not None
    window = task.unique_window()  # one primary-key probe, only for a task with a dedup key
    # Its durable steps (tasks/steps.py), in the order they ran: a range of the (task, position) index.
    steps = list(TaskStep.objects.filter(task_id=task.pk).order_by("position")[: STEP_ROWS + 1])
    for completed in steps:
        completed.shown = redaction.value(task.task_path, completed.result)
        completed.seconds = max(0.0, (completed.completed_at - completed.started_at).total_seconds())
    # Its events (wait_for_event / send_event): those sent (the (task, name) index), and the waits
    # whose event step has not run: a ``wait:<name>`` step (its deadline) without ``event:<name>``.
    events = list(TaskEvent.objects.filter(task_id=task.pk).order_by("id")[: EVENT_ROWS + 1])
    for event in events:
        event.shown = redaction.value(task.task_path, event.payload)
    final = task.archived or task.status in FINISHED_STATUSES
    resolved = {row.name.removeprefix("event:") for row in steps if row.name.startswith("event:")}
    awaited = [
        (row.name.removeprefix("wait:"), parse_datetime(row.result) if isinstance(row.result, str) else None)
        for row in steps
        if row.name.startswith("wait:") and row.name.removeprefix("wait:") not in resolved and not final
    ]
    return render(
        request,
        "tasks/dashboard/task_detail.html",
        {
            "task": task,
            "history": attempts.history(task),
            "arguments": redaction.arguments(task),
            "tabs": tabs(task_counts()),
            # A task moved to tasks_finished is final: its actions are the rerun (it comes back first).
            "actions": vocabulary.actions_for([task.status]),
            "workflow": Workflow.objects.filter(pk=task.workflow_id).first() if member else None,
            "edges": workflows.edges(task.pk) if member else None,
            "window": window,
            "window_seconds": window.seconds if window else None,
            "steps": steps[:STEP_ROWS],
            # "Re-run from here" on each step, but while an attempt runs (it holds its steps).
            "steps_rerunnable": task.status != "RUNNING",
            "more_steps": len(steps) > STEP_ROWS,
            "events": events[:EVENT_ROWS],
            "more_events": len(events) > EVENT_ROWS,
            "awaited": awaited,
            # An unfinished task takes events (one may be sent before its wait begins).
            "event_sendable": not final,
        },
    )


@staff_page(POST=[CHANGE_TASK])
def task_send_event(request: HttpRequest, task_id: int) -> HttpResponse:
    """The task page's "Send event": ``send_event`` (tasks/steps.py) with the form's name and JSON
    payload, as ``POST /api/tasks/<id>/events`` does. A bad name or payload is a 400 page; a finished
    task, or an event of that name sent before (the first payload stands), a 409 page; nothing changes."""
    from tasks import steps as durable

    page = with_database(reverse("tasks:task-detail", args=[task_id]))
    name = request.POST.get("name", "")
    text = request.POST.get("payload", "").strip() or "null"

    def refuse_constant(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    try:
        payload = json.loads(text, parse_constant=refuse_constant)
    except ValueError as exc:  # json.JSONDecodeError is one
        return bad_request_page(request, f"payload must be JSON (null, a number, a string, a list or an object): {exc}")
    if not is_storable(payload):
        return bad_request_page(request, "payload cannot be stored as JSON (NUL or a lone surrogate)")
    try:
        stored = durable.send_event(task_id, name, payload, using=selected_database())
    except ValueError as exc:  # a name tasks.steps refuses (blank, too long, NUL)
        return bad_request_page(request, str(exc))
    except Task.DoesNotExist:
        raise Http404(f"no task with id {task_id}") from None
    except TaskError as exc:
        return _refused(request, f"{exc}. Nothing changed.", page)
    if not stored:
        before = f"An event {name!r} was sent to task {task_id} before: the first payload stands."
        return _refused(request, f"{before} Nothing changed.", page)
    messages.success(request, f"Event {name!r} sent to task {task_id}.")
    return HttpResponseRedirect(page)


@staff_page(POST=[CHANGE_TASK])
def task_rerun_from_step(request: HttpRequest, task_id: int) -> HttpResponse:
    """The steps table's "Re-run from here": the task's stored steps from that position on are
    discarded and it runs again (tasks/steps.py ``rerun_from_step``); a running task is a 409 page."""
    from tasks import steps as durable

    page = with_database(reverse("tasks:task-detail", args=[task_id]))
    try:
        position = parse_whole(request.POST.get("position", ""), "position", low=0, high=2**31 - 1)
    except InvalidInput as exc:
        return bad_request_page(request, exc.message)
    try:
        discarded = durable.rerun_from_step(task_id, position, using=selected_database())
    except Task.DoesNotExist:
        raise Http404(f"no task with id {task_id}") from None
    except ValueError as exc:
        return bad_request_page(request, str(exc))
    except TaskError as exc:
        return _refused(request, f"{exc}. Nothing changed.", page)
    messages.success(request, f"Task {task_id} runs again from step {position} ({discarded} stored step(s) discarded).")
    return HttpResponseRedirect(page)


@staff_page(POST=[CHANGE_TASK])
def task_action(request: HttpRequest) -> HttpResponse:
    """An action on the selected tasks (tasks/lifecycle/vocabulary.py ``ACTIONS``: run now, retry, run
    again, cancel), each one conditional statement on the statuses the transition table lets it
    leave from. A selected task that is not in one of them refuses the whole request with a 409
    naming it: the request runs in one transaction (``staff_page``) and changes nothing."""
    # One action: a form sends the button pressed; two would leave the one done to the order of fields.
    pressed = request.POST.getlist("action")
    action = vocabulary.ACTIONS.get(pressed[0]) if len(pressed) == 1 else None
    back = safe_next(request, request.POST.get("next"), with_database(reverse("tasks:overview")))
    if action is None:
        return bad_request_page(request, f"action must be one of {', '.join(vocabulary.ACTIONS)}")
    try:
        ids = [parse_whole(value, "ids", low=1, high=MAX_BIGINT) for value in request.POST.getlist("ids")]
    except InvalidInput as exc:
        return bad_request_page(request, exc.message)
    selected = Task.objects.filter(pk__in=ids, status__in=action.statuses)
    try:
        # A savepoint: a selection the action does not fit whole is named as it was before this
        # request's statements (read after the write, a task it had just requeued would read Ready).
        with transaction.atomic(using=selected.db):
            if action.name == "run_now":
                changed = selected.retry_now()
            elif action.name == "cancel":
                changed = selected.cancel()
            else:
                changed = selected.requeue()
                if changed != len(set(ids)) and (restored := Task.objects.using(selected.db).restore(ids)):
                    # Those the mover took to tasks_finished (the requeue found no row: a selection of
                    # tasks in tasks_task only pays nothing more) come back, then are requeued as the
                    # others, in this request's transaction: a refused rerun leaves them where they
                    # were. A row the mover held while the requeue looked waited for its move to
                    # commit: it is in tasks_finished now, restored here too.
                    changed += Task.objects.filter(pk__in=restored, status__in=action.statuses).requeue()
            if changed != len(set(ids)):
                raise _DoesNotFit
    except TaskError as exc:
        return _refused(request, f"{exc} Nothing changed.", back)
    except _DoesNotFit:
        # Each statement is conditional on the action's statuses: a row it left alone is one the
        # action does not fit, has moved, or is gone. Read after the rollback to the savepoint.
        misfits = list(
            Task.objects.filter(pk__in=ids).exclude(status__in=action.statuses).values_list("pk", "status")[:10]
        )
        seen = set(Task.objects.filter(pk__in=ids).values_list("pk", flat=True))
        unseen = [i for i in dict.fromkeys(ids) if i not in seen]
        history = archived_ids(unseen[:10], selected.db)
        # A rerun (retry, run again) brings a moved task of a status it fits back: not the reason.
        reruns = action.name in ("retry", "run_again")
        named = [f"task {pk} is {vocabulary.label(status)}" for pk, status in misfits]
        named += [
            f"task {pk} is {vocabulary.label(st)} history"
            for pk, st in history
            if not (reruns and st in action.statuses)
        ]
        kept = {pk for pk, _ in history}
        named += [f"no task {pk}" for pk in unseen[:10] if pk not in kept]
        fits = ", ".join(vocabulary.label(status) for status in action.statuses)
        reason = f"{action.label} applies to {fits} tasks only: {', '.join(named) or 'no such task'}. Nothing changed."
        return _refused(request, back=back, reason=reason)
    messages.success(request, f"{action.label}: {changed} task(s).")
    return HttpResponseRedirect(back)


class _DoesNotFit(Exception):
    """Raised inside task_action's savepoint: the action changed fewer tasks than selected."""


def _refused(request: HttpRequest, reason: str, back: str) -> HttpResponse:
    """A 409 page saying why; the request's transaction is rolled back."""
    transaction.set_rollback(True, using=selected_database())
    context = {"reason": reason, "title": "Refused", "back": back}
    return render(request, "leasing/bad_request.html", context, status=409)


@staff_page(GET=[VIEW_TASK])
def every_task(request: HttpRequest) -> HttpResponse:
    """Every task, newest first, filtered (tasks/web/all_tasks.py); a bad filter is a 400 page. The
    search box's ``name:value`` tokens are answered with a redirect to their parameters
    (tasks/web/filter_box.py), once they read as the parameters would."""
    matched_paths: list[str] = []
    try:
        lifted = filter_box.lift(request.GET)
        if lifted is not None:
            all_tasks.parse_filters(lifted, lifted.getlist)  # a bad value: the parameter's own 400
            return HttpResponseRedirect(f"{request.path}?{lifted.urlencode()}")
        filters = all_tasks.parse_filters(request.GET, request.GET.getlist)
        text = request.GET.get("before", "").strip()
        before = parse_whole(text, "before", low=1, high=MAX_BIGINT) if text else None
        page = all_tasks.page(
            filters, using=selected_database(), limit=PAGE_SIZE, before=before, matched_paths=matched_paths
        )
    except InvalidInput as exc:
        return bad_request_page(request, exc.message)
    shown = {task.status for task in page.tasks}
    query = request.GET.copy()
    query.pop("before", None)
    selected = filters.status_labels
    return render(
        request,
        "tasks/dashboard/every_task.html",
        {
            "filters": filters,
            "params": request.GET,
            "matched_paths": matched_paths,
            "box": filter_box.box_text(request.GET, selected),
            "status_chips": filter_box.status_chips(
                request.path, request.GET, selected, [s.label for s in vocabulary.STATUSES.values()]
            ),
            "filter_chips": filter_box.filter_chips(request.path, request.GET),
            "tasks": page.tasks,
            "next_before": page.next_before,
            "scanned_to": page.scanned_to,
            "scan_window": listings.SCAN_WINDOW,
            "query": query.urlencode(),
            # Only the actions that fit every row shown (none for a page of mixed statuses).
            "actions": vocabulary.actions_for(shown),
            "show_errors": any(task.errors for task in page.tasks),
            "tabs": tabs(task_counts()),
        },
    )


@staff_page(GET=[VIEW_WORKER, VIEW_TASK])
def workers(request: HttpRequest) -> HttpResponse:
    alive = list(live_workers())
    held: dict[str, list[Task]] = {}
    # In the running index's order (lease expiry, as every read of the running set: RUNNING_ORDER), then
    # by id for the page: ordered by id, the planner may walk the primary key from the oldest task
    # looking for the running rows, which have the newest ids (no index has them by holder).
    running = Task.objects.running().filter(holder__in=[w.id for w in alive]).order_by(*RUNNING_ORDER)[:1000]
    for task in sorted(running, key=lambda task: task.pk):
        held.setdefault(task.holder or "", []).append(task)
    now = timezone.now()
    since = now - dt.timedelta(seconds=WORKERS_FOLD_AFTER)
    alive_ids = [w.id for w in alive]
    # The last WORKERS_FOLD_AFTER seconds only, each through its partial index (stopped, or silent:
    # not stopped, no longer heartbeating); older ones keep their pages and the admin's list.
    stopped = Worker.objects.filter(stopped_at__gte=since).order_by("-stopped_at")[: RECENT_LIMIT + 1]
    silent = (
        Worker.objects.filter(stopped_at__isnull=True, last_seen_at__gte=since)
        .exclude(pk__in=alive_ids)
        .order_by("-last_seen_at")[: RECENT_LIMIT + 1]
    )
    recent = sorted([*stopped, *silent], key=lambda w: w.last_seen_at, reverse=True)
    dead = sum(1 for w in recent[:RECENT_LIMIT] if w.stopped_at is None or "presumed dead" in w.stop_reason)
    return render(
        request,
        "tasks/dashboard/workers.html",
        {
            "workers": [{"worker": w, "tasks": held.get(w.id, [])} for w in alive],
            "recent": recent[:RECENT_LIMIT],
            "recent_more": len(recent) > RECENT_LIMIT,
            "recent_count": len(recent),
            "recent_dead": dead,
            "fold_minutes": WORKERS_FOLD_AFTER // 60,
            "now": now,
            "ttl": get_settings().TTL,
        },
    )


#: Seconds a stopped or silent worker stays listed on the workers page (folded under a summary).
WORKERS_FOLD_AFTER = 600
RECENT_LIMIT = 20


#: The counters the workers list shows as columns; the rest are on each worker's own page.
WORKER_COLUMNS = ("succeeded", "failed", "rejected", "lost")
HELD_LIMIT = 200


@staff_page(GET=[VIEW_WORKER, VIEW_TASK])
def worker_detail(request: HttpRequest, worker_id: str) -> HttpResponse:
    worker = get_object_or_404(Worker, pk=worker_id)
    # What this worker holds now, live or stuck (judged at this read, on the database's clock:
    # Task.is_stuck): read from the running set in its index's order, shown by id (the workers page says
    # why not ordered by id).
    running = with_db_clock(Task.objects.running().filter(holder=worker.id)).order_by(*RUNNING_ORDER)
    held = sorted(running[: HELD_LIMIT + 1], key=lambda task: task.pk)
    stats = worker.stats or {}
    counters = [(key, stats.get(key, 0)) for key in WORKER_COLUMNS]
    counters += sorted((key, value) for key, value in stats.items() if key not in WORKER_COLUMNS)
    return render(
        request,
        "tasks/dashboard/worker_detail.html",
        {
            "worker": worker,
            "alive": live_workers().filter(pk=worker.pk).exists(),
            "counters": counters,
            "held": held[:HELD_LIMIT],
            "held_more": len(held) > HELD_LIMIT,
            "ttl": get_settings().TTL,
        },
    )


@staff_page(GET=[VIEW_GENERATOR], POST=[CHANGE_GENERATOR])
def generator_page(request: HttpRequest) -> HttpResponse:
    if not demo.installed():
        raise Http404("the demo app (tasks.demo) is not installed")
    if request.method == "POST":
        action = request.POST.get("action", "")
        try:
            if action not in ("start", "stop", "rate"):
                raise InvalidInput("unknown action")
            text = request.POST.get("rate", "").strip()
            rate = parse_number(text, "rate", low=0, high=10_000) if text else None
            generator.set_state(running={"start": True, "stop": False}.get(action), rate=rate)
            messages.success(request, "Generator state saved; the leader applies it at its next tick.")
        except ValueError as exc:
            transaction.set_rollback(True)
            messages.error(request, exc.message if isinstance(exc, InvalidInput) else str(exc))
        return HttpResponseRedirect(reverse("tasks:generator"))
    return render(request, "tasks/dashboard/generator.html", {"generator": generator.status()})
