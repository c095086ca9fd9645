"""JSON API of periodic tasks (read-only: schedules live in settings): every schedule with its last
and next run, and one schedule's runs with their tasks, newest first."""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import urlencode

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.urls import path

from leasing.access import VIEW_SCHEDULE
from leasing.http import ApiError, api_view, iso
from tasks.maintenance.scheduler import schedule_status
from tasks.maintenance.schedules import load_schedules
from tasks.models import ScheduleRun, Task


def schedule_json(entry: dict[str, Any], last_status: str | None) -> dict[str, Any]:
    return {
        "name": entry["name"],
        "declared": entry["declared"],
        "enabled": entry["enabled"],
        "definition": entry["definition"],
        "description": entry["explain"],
        "last_run": {"slot": iso(entry["last_slot"]), "task_id": entry["last_task_id"], "task_status": last_status}
        if entry["last_task_id"] is not None
        else None,
        "last_enqueued_at": iso(entry["last_enqueued_at"]),
        "next_run": iso(entry["next_run"]),
        "enqueued": entry["enqueued"],
        "skipped": entry["skipped"],
    }


def _entries() -> tuple[list[dict[str, Any]], str | None]:
    """The schedules, and the settings error if they are invalid (then only the stored rows are
    listed; ``manage.py check`` reports the error as tasks.E101 too)."""
    try:
        return schedule_status(load_schedules()), None
    except ImproperlyConfigured as exc:
        return schedule_status({}), str(exc)


def _statuses(ids: list[int]) -> dict[int, str]:
    return dict(Task.objects.filter(pk__in=ids).values_list("pk", "status"))


@api_view(GET=[VIEW_SCHEDULE])
def schedules(request: HttpRequest) -> tuple[int, Any]:
    entries, error = _entries()
    statuses = _statuses([e["last_task_id"] for e in entries if e["last_task_id"] is not None])
    return 200, {
        "scheduler": {"leader": entries[0]["leader"] if entries else None},
        "schedules": [schedule_json(e, statuses.get(e["last_task_id"])) for e in entries],
        "settings_error": error,
    }


@api_view(GET=[VIEW_SCHEDULE])
def schedule_detail(request: HttpRequest, name: str) -> tuple[int, Any]:
    entry = next((e for e in _entries()[0] if e["name"] == name), None)
    if entry is None:
        raise ApiError(404, f"no schedule named {name!r}")
    try:
        limit = int(request.GET.get("limit", 50))
    except ValueError:
        raise ApiError(400, "limit must be a whole number", "limit") from None
    if not 1 <= limit <= 500:
        raise ApiError(400, "limit must be from 1 to 500", "limit")
    runs = ScheduleRun.objects.filter(schedule=name)
    if before := request.GET.get("before"):
        try:
            moment = dt.datetime.fromisoformat(before)
        except ValueError:
            raise ApiError(400, "before must be an ISO 8601 time (a run's slot)", "before") from None
        runs = runs.filter(slot__lt=moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC))
    page = list(runs.order_by("-slot")[: limit + 1])
    more, page = len(page) > limit, page[:limit]
    statuses = _statuses([r.task_id for r in page] + ([entry["last_task_id"]] if entry["last_task_id"] else []))
    return 200, {
        "schedule": schedule_json(entry, statuses.get(entry["last_task_id"])),
        "runs": [
            {
                "slot": iso(r.slot),
                "task_id": r.task_id,
                "task_status": statuses.get(r.task_id),  # null: the task was pruned
                "enqueued_at": iso(r.enqueued_at),
                "token": r.token,
            }
            for r in page
        ],
        "next": "?" + urlencode({"limit": limit, "before": page[-1].slot.isoformat()}) if more else None,
    }


urlpatterns = [
    path("schedules", schedules, name="api-schedules"),
    path("schedules/<str:name>", schedule_detail, name="api-schedule-detail"),
]
