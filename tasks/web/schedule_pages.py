"""Dashboard pages of periodic tasks: every schedule with its last and next run, and one schedule's
runs with links to their tasks. Reads the settings and the schedule rows (a handful), and a page of
runs through the (schedule, slot) unique index."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.contrib import messages
from django.core.exceptions import ImproperlyConfigured
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from leasing.access import VIEW_SCHEDULE, VIEW_TASK, staff_page
from leasing.validation import parse_iso_datetime
from tasks import redaction
from tasks.maintenance.schedule_specs import ScheduleSpec, load_schedules
from tasks.maintenance.scheduler import schedule_status
from tasks.models import ScheduleRun
from tasks.models import finished as finished_storage

RUNS_PAGE = 50


def _declared(request: HttpRequest) -> dict[str, ScheduleSpec]:
    try:
        return load_schedules()
    except ImproperlyConfigured as exc:  # manage.py check reports it too; the page still shows the rows
        messages.error(request, str(exc))
        return {}


def task_statuses(ids: list[int]) -> dict[int, str]:
    """Status per task id (tasks_task, then tasks_finished for the moved); a pruned task is missing."""
    return finished_storage.statuses(ids)  # a run's task moved to tasks_finished keeps its status


def runs_with_tasks(runs: list[ScheduleRun]) -> list[dict[str, Any]]:
    statuses = task_statuses([r.task_id for r in runs])
    return [{"run": run, "status": statuses.get(run.task_id)} for run in runs]


@staff_page(GET=[VIEW_SCHEDULE])
def schedules(request: HttpRequest) -> HttpResponse:
    entries = schedule_status(_declared(request))
    statuses = task_statuses([e["last_task_id"] for e in entries if e["last_task_id"] is not None])
    for entry in entries:
        entry["last_status"] = statuses.get(entry["last_task_id"])
    return render(request, "tasks/dashboard/schedules.html", {"schedules": entries})


@staff_page(GET=[VIEW_SCHEDULE, VIEW_TASK])
def schedule_detail(request: HttpRequest, name: str) -> HttpResponse:
    entry = next((e for e in schedule_status(_declared(request)) if e["name"] == name), None)
    if entry is None:
        raise Http404(f"no schedule named {name!r}")
    runs = ScheduleRun.objects.filter(schedule=name)
    before = request.GET.get("before")
    if before:
        try:
            moment = parse_iso_datetime(before)
        except ValueError:
            raise Http404("before must be an ISO 8601 time") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=dt.timezone.utc)
        runs = runs.filter(slot__lt=moment)
    page = list(runs.order_by("-slot")[: RUNS_PAGE + 1])
    return render(
        request,
        "tasks/dashboard/schedule_detail.html",
        {
            "schedule": entry,
            "arguments": _arguments(entry["definition"]),
            "runs": runs_with_tasks(page[:RUNS_PAGE]),
            "next_before": page[RUNS_PAGE - 1].slot.isoformat() if len(page) > RUNS_PAGE else None,
        },
    )


def _arguments(definition: Any) -> dict[str, Any]:
    """A schedule's arguments as its tasks' pages show them: redacted (tasks/redaction.py)."""
    args, kwargs = redaction.redact(definition.get("task", ""), definition.get("args"), definition.get("kwargs"))
    return {"args": args, "kwargs": kwargs}
