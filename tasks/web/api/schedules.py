"""JSON API of periodic tasks: every schedule with its last and next run, and one schedule's runs with
their tasks, newest first; and the schedules stored at runtime, created, replaced (PUT), patched
(PATCH: a JSON merge patch of the entry, null removes a key), paused, resumed and deleted here.

A stored schedule's body is a settings entry (``task``, ``cron`` or ``interval``, ``args``, ...) plus
``paused``, validated by the settings' own validator (``stored_spec``); a schedule declared in
settings is read-only (409), and a stored one may not take its name. PUT and PATCH take an optional
``revision``: the write happens only if the schedule is still at it (409 otherwise)."""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import urlencode

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.urls import path

from leasing.access import ADD_SCHEDULE, CHANGE_SCHEDULE, DELETE_SCHEDULE, VIEW_SCHEDULE
from leasing.http import ApiError, Body, api_view, iso
from leasing.routing import selected_database
from leasing.validation import parse_iso_datetime
from tasks import redaction
from tasks.conf import get_settings
from tasks.lifecycle.routing import queue_database
from tasks.maintenance.schedule_specs import InvalidSchedule, ScheduleSpec, load_schedules, stored_spec
from tasks.maintenance.scheduler import schedule_status
from tasks.models import ScheduleRun, StoredRow, StoredSchedule
from tasks.models import finished as finished_storage


def schedule_json(entry: dict[str, Any], last_status: str | None) -> dict[str, Any]:
    return {
        "name": entry["name"],
        "declared": entry["declared"],
        "kind": entry["kind"],
        "paused": entry["paused"],
        "revision": entry["revision"],
        "error": entry["error"],
        "enabled": entry["enabled"],
        "definition": redaction.definition(entry["definition"]),
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
    return finished_storage.statuses(ids)  # a run's task moved to tasks_finished keeps its status


# -- stored schedules --------------------------------------------------------------------------

#: The keys a stored schedule's body may hold besides the entry's own.
_CONTROL_KEYS = ("name", "paused", "revision")


def _caller(request: HttpRequest) -> str:
    caller = getattr(request, "api_caller", None)
    return str(caller.name) if caller is not None else ""


def _not_declared(name: str) -> None:
    if name in get_settings().SCHEDULES:
        raise ApiError(
            409,
            f"schedule {name!r} is declared in settings and read-only here: change LEASING_TASKS['SCHEDULES']"
            " and deploy (a stored schedule may not take its name)",
            "name",
        )


def _validated(name: str, entry: dict[str, Any], paused: bool) -> ScheduleSpec:
    """The one validator (settings' rules, the API allow-list); a 400 naming the field otherwise."""
    if redaction.active():
        for key in ("args", "kwargs"):
            if redaction.holds_placeholder(entry.get(key)):
                # An entry read back from this API with its secrets hidden: stored, the task would get
                # the placeholder in place of the secret.
                raise ApiError(
                    400,
                    f"{key} holds {redaction.REDACTED!r}, what this API shows in place of a hidden argument"
                    " (REDACT_ARGUMENTS): send the real value, or PATCH without it to keep the stored one",
                    key,
                )
    try:
        spec = stored_spec(name, entry, paused=paused)
    except InvalidSchedule as exc:
        raise ApiError(400, exc.reason, exc.key) from None
    if queue_database(spec.queue) != selected_database():
        raise ApiError(400, f"queue {spec.queue!r} is routed to another database: store the schedule there", "queue")
    return spec


def _still_hidden(stored: dict[str, Any], entry: dict[str, Any], given: dict[str, Any]) -> None:
    """A 400 when a PATCH keeps stored arguments that this API hid and the patched entry would show
    (a redactor that hides by task path, the task patched): the client never read them, and the
    answer, or any later read, would show them."""
    if not redaction.active():
        return
    shown = redaction.definition(stored)
    for key in ("args", "kwargs"):
        if key in given or key not in entry or not redaction.holds_placeholder(shown.get(key)):
            continue
        try:
            redaction.keep_hidden(shown[key], entry, key)
        except ValueError:
            raise ApiError(
                400,
                f"{key} holds values this API hides (REDACT_ARGUMENTS) that the patched schedule would show:"
                f" send {key} with the real values to change the task",
                key,
            ) from None


def _paused(body: Body, default: bool) -> bool:
    value = body.data.get("paused", default)
    if not isinstance(value, bool):
        raise ApiError(400, "paused must be true or false", "paused")
    return value


def _revision(body: Body) -> int | None:
    if body.data.get("revision") is None:
        return None
    result: int = body.whole("revision", low=1, high=2**63 - 1)
    return result


def stored_json(row: StoredRow, spec: ScheduleSpec | None = None) -> dict[str, Any]:
    return {
        "name": row.name,
        "kind": "stored",
        "paused": row.paused,
        "revision": row.revision,
        "entry": redaction.definition(row.entry),
        "definition": redaction.definition(spec.definition()) if spec is not None else None,
        "effective_from": iso(row.effective_from),
        "created_at": iso(row.created_at),
        "updated_at": iso(row.updated_at),
    }


def create_schedule(request: HttpRequest) -> tuple[int, Any]:
    body = Body(request)
    name = body.text("name", max_length=100)
    _not_declared(name)
    entry = {k: v for k, v in body.data.items() if k not in _CONTROL_KEYS}
    if "revision" in body.data:
        raise ApiError(400, "revision is not given on create (the create sets it)", "revision")
    paused = _paused(body, False)
    spec = _validated(name, entry, paused)
    row = StoredSchedule.objects.create_stored(name, entry, paused=paused, by=_caller(request))
    if row is None:
        raise ApiError(409, f"a stored schedule named {name!r} exists: PUT or PATCH /api/schedules/{name}", "name")
    return 201, stored_json(row, spec)


def _current(name: str) -> StoredSchedule:
    _not_declared(name)
    # FOR UPDATE: the validation below and the write see the same row (the write is a
    # compare-and-set on its revision all the same).
    found = StoredSchedule.objects.select_for_update().filter(name=name).first()
    if found is None:
        raise ApiError(404, f"no stored schedule named {name!r}")
    return found


def change_schedule(request: HttpRequest, name: str) -> tuple[int, Any]:
    body = Body(request)
    if "name" in body.data and body.data["name"] != name:
        raise ApiError(400, "a schedule cannot be renamed: create the new name and delete this one", "name")
    current = _current(name)
    expected = _revision(body)
    if expected is not None and expected != current.revision:
        raise ApiError(409, f"schedule {name!r} is at revision {current.revision}, not {expected}", "revision")
    given = {k: v for k, v in body.data.items() if k not in _CONTROL_KEYS}
    if request.method == "PATCH":  # a JSON merge patch (RFC 7396) of the entry: null removes a key
        entry = {**current.entry, **given}
        entry = {k: v for k, v in entry.items() if v is not None}
        _still_hidden(current.entry, entry, given)
    else:
        entry = given
    paused = _paused(body, current.paused)
    spec = _validated(name, entry, paused)
    row = StoredSchedule.objects.replace_stored(
        name, entry, paused=paused, revision=current.revision, by=_caller(request)
    )
    if row is None:  # pragma: no cover (the row is locked above)
        raise ApiError(409, f"schedule {name!r} changed meanwhile: read it and try again")
    return 200, stored_json(row, spec)


def delete_schedule(request: HttpRequest, name: str) -> tuple[int, Any]:
    _not_declared(name)
    row = StoredSchedule.objects.delete_stored(name)
    if row is None:
        raise ApiError(404, f"no stored schedule named {name!r}")
    return 200, {"deleted": row.name, "revision": row.revision}


def _toggle(request: HttpRequest, name: str, *, pause: bool) -> tuple[int, Any]:
    current = _current(name)
    operation = StoredSchedule.objects.pause_stored if pause else StoredSchedule.objects.resume_stored
    row = operation(name, by=_caller(request))
    if row is None:  # paused (or running) already: nothing to do, nothing written
        row = StoredRow(
            current.name,
            current.entry,
            current.paused,
            current.revision,
            current.effective_from,
            current.created_at,
            current.updated_at,
        )
    try:
        spec = stored_spec(name, row.entry, paused=row.paused)
    except InvalidSchedule:
        spec = None
    return 200, stored_json(row, spec)


@api_view(POST=[CHANGE_SCHEDULE])
def pause_schedule(request: HttpRequest, name: str) -> tuple[int, Any]:
    return _toggle(request, name, pause=True)


@api_view(POST=[CHANGE_SCHEDULE])
def resume_schedule(request: HttpRequest, name: str) -> tuple[int, Any]:
    return _toggle(request, name, pause=False)


@api_view(GET=[VIEW_SCHEDULE], POST=[ADD_SCHEDULE])
def schedules(request: HttpRequest) -> tuple[int, Any]:
    if request.method == "POST":
        return create_schedule(request)
    entries, error = _entries()
    statuses = _statuses([e["last_task_id"] for e in entries if e["last_task_id"] is not None])
    return 200, {
        "scheduler": {"leader": entries[0]["leader"] if entries else None},
        "schedules": [schedule_json(e, statuses.get(e["last_task_id"])) for e in entries],
        "settings_error": error,
    }


@api_view(GET=[VIEW_SCHEDULE], PUT=[CHANGE_SCHEDULE], PATCH=[CHANGE_SCHEDULE], DELETE=[DELETE_SCHEDULE])
def schedule_detail(request: HttpRequest, name: str) -> tuple[int, Any]:
    if request.method in ("PUT", "PATCH"):
        return change_schedule(request, name)
    if request.method == "DELETE":
        return delete_schedule(request, name)
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
            moment = parse_iso_datetime(before)
        except ValueError:
            raise ApiError(400, "before must be an ISO 8601 time (a run's slot)", "before") from None
        runs = runs.filter(slot__lt=moment if moment.tzinfo else moment.replace(tzinfo=dt.timezone.utc))
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
    path("schedules/<str:name>/pause", pause_schedule, name="api-schedule-pause"),
    path("schedules/<str:name>/resume", resume_schedule, name="api-schedule-resume"),
]
