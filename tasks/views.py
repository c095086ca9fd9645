"""The dashboard: what is held, by whom, until when; what is stuck; is the system healthy.

Every page is server-rendered (no front-end build); a few lines of JavaScript refresh the marked
parts in place. Queries stay cheap with a million tasks: counts are bounded (``LIMIT``-capped,
exact when small), lists use keyset pagination on the primary key, and each query matches an index.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.db import connection
from django.db.models import Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from leasing.views import state_counts as lease_counts
from tasks import generator
from tasks.conf import get_settings
from tasks.exceptions import TaskError
from tasks.models import Task, TaskStatus, Worker

COUNT_CAP = 10_000
PAGE_SIZE = 50

#: Dashboard task states: (label, description, queryset factory).
TASK_STATES: dict[str, tuple[str, Any]] = {
    "pending": ("waiting for their first run", lambda: Task.objects.filter(status=TaskStatus.READY, attempts=0)),
    "retrying": (
        "failed at least once, waiting to run again",
        lambda: Task.objects.filter(status="READY", attempts__gt=0),
    ),
    "running": ("held by a worker with a live lease", lambda: Task.objects.running().active()),
    "stuck": ("running, but the lease expired: the worker died or stalled", lambda: Task.objects.stuck()),
    "succeeded": ("finished successfully", lambda: Task.objects.filter(status=TaskStatus.SUCCESSFUL)),
    "failed": ("out of attempts or not retryable (dead)", lambda: Task.objects.filter(status=TaskStatus.FAILED)),
    "cancelled": ("cancelled by an operator", lambda: Task.objects.filter(status=TaskStatus.CANCELLED)),
}


@dataclass(frozen=True)
class Count:
    value: int
    capped: bool

    def __str__(self) -> str:
        return f"{self.value:,}+" if self.capped else f"{self.value:,}"


def bounded_count(queryset: QuerySet[Any], cap: int = COUNT_CAP) -> Count:
    """COUNT over at most ``cap + 1`` rows: exact when small, "10,000+" when not."""
    value = queryset[: cap + 1].count()
    return Count(min(value, cap), value > cap)


def task_counts() -> dict[str, Count]:
    return {name: bounded_count(factory()) for name, (_, factory) in TASK_STATES.items()}


def queue_stats() -> list[dict[str, Any]]:
    """Runnable depth and age of the oldest runnable task per queue (walks the runnable index)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT queue, count(*), EXTRACT(EPOCH FROM statement_timestamp() - min(run_after))"
            " FROM tasks_task WHERE status = 'READY' AND run_after <= statement_timestamp()"
            " GROUP BY queue ORDER BY queue"
        )
        return [{"queue": q, "depth": n, "oldest_age": float(age or 0)} for q, n, age in cursor.fetchall()]


def live_workers() -> QuerySet[Worker]:
    horizon = timezone.now() - dt.timedelta(seconds=get_settings().TTL * 2)
    return Worker.objects.filter(stopped_at__isnull=True, last_seen_at__gte=horizon)


def _minutes() -> list[dt.datetime]:
    now = timezone.now().replace(second=0, microsecond=0)
    return [now - dt.timedelta(minutes=59 - i) for i in range(60)]


def activity_last_hour() -> dict[str, list[int]]:
    """Per minute over the last hour: tasks succeeded, failed for good, and recovered."""
    minutes = _minutes()
    index = {minute: i for i, minute in enumerate(minutes)}
    series = {"succeeded": [0] * 60, "failed": [0] * 60, "recovered": [0] * 60}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT date_trunc('minute', finished_at), status, count(*) FROM tasks_task"
            " WHERE finished_at >= statement_timestamp() - interval '1 hour' GROUP BY 1, 2"
        )
        for minute, status, count in cursor.fetchall():
            key = {"SUCCESSFUL": "succeeded", "FAILED": "failed"}.get(status)
            if key and minute in index:
                series[key][index[minute]] += count
        # A task recovered in the last hour is unfinished now, or finished within the hour.
        cursor.execute(
            "SELECT date_trunc('minute', (e->>'at')::timestamptz), count(*)"
            " FROM tasks_task t, jsonb_array_elements(t.errors) e"
            " WHERE (t.status IN ('READY', 'RUNNING') OR t.finished_at >= statement_timestamp() - interval '1 hour')"
            " AND e->>'exception_class_path' = 'tasks.exceptions.TaskLeaseLost'"
            " AND (e->>'at')::timestamptz >= statement_timestamp() - interval '1 hour' GROUP BY 1"
        )
        for minute, count in cursor.fetchall():
            if minute in index:
                series["recovered"][index[minute]] += count
    return series


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
                    "title": f"{minutes[i]:%H:%M} {name}: {value}",
                }
            )
    totals = {name: sum(values) for name, values in series.items()}
    return {"bars": bars, "width": width, "height": height, "peak": peak, "totals": totals, "colours": colours}


@staff_member_required
def overview(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "leasing/dashboard/overview.html",
        {
            "lease_counts": lease_counts(),
            "task_counts": task_counts(),
            "states": TASK_STATES,
            "queues": queue_stats(),
            "workers": list(live_workers()),
            "chart": chart(activity_last_hour()),
            "generator": generator.status(),
        },
    )


@staff_member_required
def task_list(request: HttpRequest, state: str) -> HttpResponse:
    if state not in TASK_STATES:
        raise Http404(f"unknown task state {state!r}")
    description, factory = TASK_STATES[state]
    queryset = factory()
    if queue := request.GET.get("queue"):
        queryset = queryset.filter(queue=queue)
    if search := request.GET.get("q", "").strip():
        condition = Q(dedup_key=search) | Q(holder=search) | Q(task_path=search)
        if search.isdigit():
            condition |= Q(pk=int(search))
        queryset = queryset.filter(condition)
    before = request.GET.get("before")
    if before and before.isdigit():
        queryset = queryset.filter(pk__lt=int(before))
    rows = list(queryset.order_by("-pk")[: PAGE_SIZE + 1])
    return render(
        request,
        "leasing/dashboard/task_list.html",
        {
            "state": state,
            "description": description,
            "states": TASK_STATES,
            "counts": task_counts(),
            "tasks": rows[:PAGE_SIZE],
            "next_before": rows[PAGE_SIZE - 1].pk if len(rows) > PAGE_SIZE else None,
            "query": search,
            "now": timezone.now(),
        },
    )


def attempts_of(task: Task) -> list[dict[str, Any]]:
    """One entry per attempt: the worker that ran it and how it ended (lease history)."""
    errors = {error.get("attempt"): error for error in task.errors}
    history = []
    for number, worker in enumerate(task.worker_ids, start=1):
        error = errors.get(number)
        if error:
            outcome = error.get("exception_class_path", "error")
        elif number == len(task.worker_ids):
            outcome = task.status.lower()
        else:
            outcome = "handed back"
        history.append({"number": number, "worker": worker, "outcome": outcome, "error": error})
    return history


@staff_member_required
def task_detail(request: HttpRequest, task_id: int) -> HttpResponse:
    task = get_object_or_404(Task, pk=task_id)
    return render(
        request,
        "leasing/dashboard/task_detail.html",
        {"task": task, "attempts": attempts_of(task), "states": TASK_STATES, "counts": task_counts()},
    )


@staff_member_required
@require_POST
def task_action(request: HttpRequest) -> HttpResponse:
    """Bulk (or single) retry / cancel; each a compare-and-set on status, so never racing a worker."""
    action = request.POST.get("action")
    ids = [int(value) for value in request.POST.getlist("ids") if value.isdigit()]
    back = request.POST.get("next") or reverse("tasks:overview")
    if not back.startswith("/"):
        back = reverse("tasks:overview")
    selected = Task.objects.filter(pk__in=ids)
    if action == "cancel":
        messages.success(request, f"Cancelled {selected.cancel()} task(s).")
    elif action == "retry":
        try:
            changed = selected.retry_now() + selected.requeue()  # waiting ones first: not counted twice
        except TaskError as exc:
            messages.error(request, str(exc))
        else:
            messages.success(request, f"Queued {changed} task(s) to run now.")
    else:
        messages.error(request, "Unknown action.")
    return HttpResponseRedirect(back)


@staff_member_required
def workers(request: HttpRequest) -> HttpResponse:
    alive = list(live_workers())
    held: dict[str, list[Task]] = {}
    for task in Task.objects.running().filter(holder__in=[w.id for w in alive]).order_by("pk")[:1000]:
        held.setdefault(task.holder or "", []).append(task)
    recent = Worker.objects.exclude(pk__in=[w.id for w in alive]).order_by("-last_seen_at")[:20]
    return render(
        request,
        "leasing/dashboard/workers.html",
        {
            "workers": [{"worker": w, "tasks": held.get(w.id, [])} for w in alive],
            "recent": recent,
            "now": timezone.now(),
            "ttl": get_settings().TTL,
        },
    )


#: The counters the workers list shows as columns; the rest are on each worker's own page.
WORKER_COLUMNS = ("succeeded", "failed", "rejected", "lost")
HELD_LIMIT = 200


@staff_member_required
def worker_detail(request: HttpRequest, worker_id: str) -> HttpResponse:
    worker = get_object_or_404(Worker, pk=worker_id)
    # Through the running-holder index: what this worker holds now, live or stuck.
    held = list(Task.objects.running().filter(holder=worker.id).order_by("pk")[: HELD_LIMIT + 1])
    stats = worker.stats or {}
    counters = [(key, stats.get(key, 0)) for key in WORKER_COLUMNS]
    counters += sorted((key, value) for key, value in stats.items() if key not in WORKER_COLUMNS)
    return render(
        request,
        "leasing/dashboard/worker_detail.html",
        {
            "worker": worker,
            "alive": live_workers().filter(pk=worker.pk).exists(),
            "counters": counters,
            "held": held[:HELD_LIMIT],
            "held_more": len(held) > HELD_LIMIT,
            "ttl": get_settings().TTL,
        },
    )


@staff_member_required
def generator_page(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        try:
            rate = float(request.POST["rate"]) if request.POST.get("rate") else None
            running = {"start": True, "stop": False}.get(request.POST.get("action", ""))
            generator.set_state(running=running, rate=rate)
            messages.success(request, "Generator state saved; the leader applies it at its next tick.")
        except ValueError as exc:
            messages.error(request, str(exc))
        return HttpResponseRedirect(reverse("tasks:generator"))
    return render(request, "leasing/dashboard/generator.html", {"generator": generator.status()})
