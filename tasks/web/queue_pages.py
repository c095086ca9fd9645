"""Queue controls on the dashboard and in the JSON API: list queues, pause, resume."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import path, reverse

from leasing.access import CHANGE_QUEUE, VIEW_QUEUE, staff_page
from leasing.http import ApiError, Body, api_view, iso, routed
from leasing.routing import database_param, selected_database, with_database
from leasing.validation import InvalidInput, clean_text
from tasks.backends.placement import switch_database
from tasks.exceptions import TaskError
from tasks.lifecycle.routing import queue_database
from tasks.lifecycle.values import validate_enqueue
from tasks.models import QueueControl
from tasks.web.queues import queue_overview


def _name(name: str) -> str:
    """A queue name from the path: refused at the edge (NUL, lone surrogates, over 100 characters)."""
    try:
        return clean_text(name, "name", max_length=100)
    except InvalidInput as exc:
        raise ApiError(400, exc.message, field="name") from None


def queue_json(entry: dict[str, Any]) -> dict[str, Any]:
    return {**entry, "changed_at": iso(entry["changed_at"])}


@api_view(GET=[VIEW_QUEUE])
def queues_api(request: HttpRequest) -> tuple[int, Any]:
    return 200, {"queues": [queue_json(entry) for entry in queue_overview()]}


@api_view(POST=[CHANGE_QUEUE])
def pause_api(request: HttpRequest, name: str) -> tuple[int, Any]:
    body = Body(request, required=False)
    reason = body.text("reason", required=False, max_length=500, default="")
    by = f"{request.api_caller.name} (API)"  # type: ignore[attr-defined]
    # A pause is read by the claims of the queue's own database (tasks/lifecycle/routing.py).
    with routed(request, _switch_database(request, _name(name)), f"queue {name!r}"):
        try:
            QueueControl.objects.pause(name, by=by, reason=reason or "")
        except TaskError as exc:
            raise ApiError(409, str(exc)) from None
        return 200, {"queue": _entry(name)}


@api_view(POST=[CHANGE_QUEUE])
def resume_api(request: HttpRequest, name: str) -> tuple[int, Any]:
    with routed(request, _switch_database(request, _name(name)), f"queue {name!r}"):
        QueueControl.objects.resume(name, by=f"{request.api_caller.name} (API)")  # type: ignore[attr-defined]
        return 200, {"queue": _entry(name)}


def _switch_database(request: HttpRequest, name: str) -> str:
    """The database ``?db=`` names when the queue's tasks land there (a LeaseBackend pinned there
    takes it), else the queue's route (a ``?db=`` naming another is then a 400). ``api_view`` has
    checked the ``?db=`` already (one known database)."""
    asked = database_param(request.GET)
    return switch_database(name, asked) if asked else queue_database(name)


def _entry(name: str) -> dict[str, Any]:
    return queue_json(next(e for e in queue_overview() if e["name"] == name))


api_urlpatterns = [
    path("queues", queues_api, name="api-queues"),
    path("queues/<str:name>/pause", pause_api, name="api-queue-pause"),
    path("queues/<str:name>/resume", resume_api, name="api-queue-resume"),
]


@staff_page(GET=[VIEW_QUEUE], POST=[CHANGE_QUEUE])
def queues_page(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        name, action = request.POST.get("name", ""), request.POST.get("action", "")
        by = f"{request.user} (dashboard)"
        try:
            validate_enqueue(queue=name, priority=0, max_attempts=1, timeout=None)
            # In the queue's own database, whose claims read it (tasks/lifecycle/routing.py): the one shown when
            # the queue's tasks land there (a LeaseBackend pinned there takes it), else its route.
            controls = QueueControl.objects.db_manager(switch_database(name, selected_database()))
            if action == "pause":
                controls.pause(name, by=by, reason=request.POST.get("reason", "")[:500])
                messages.success(request, f"Queue {name} paused: no worker claims from it from now on.")
            elif action == "resume":
                controls.resume(name, by=by)
                messages.success(request, f"Queue {name} resumed.")
            else:
                messages.error(request, "Unknown action.")
        except (ValueError, TaskError) as exc:
            messages.error(request, str(exc))
        return HttpResponseRedirect(with_database(reverse("tasks:queues")))
    return render(request, "tasks/dashboard/queues.html", {"queues": queue_overview()})
