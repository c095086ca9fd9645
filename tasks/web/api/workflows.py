"""JSON API of workflows: the list (newest first, by status), one workflow with its members counted
by status, cancel, and an event to every unfinished member. A workflow's members are listed by
``GET /api/tasks?workflow_id=<id>`` (tasks/web/api/tasks.py). The reads are in tasks/web/workflows.py."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.http import HttpRequest
from django.urls import path

from leasing.access import CHANGE_TASK, VIEW_TASK
from leasing.http import ApiError, Body, api_view, iso, page_args
from leasing.validation import MAX_BIGINT
from tasks.models import Task, Workflow
from tasks.web.api.events import event_body
from tasks.web.workflows import WORKFLOW_STATUSES, member_counts, workflow_page


def workflow_json(workflow: Workflow) -> dict[str, Any]:
    return {
        "id": workflow.pk,
        "name": workflow.name,
        "kind": workflow.kind,
        "status": workflow.status,
        "total": workflow.total,
        "succeeded": workflow.succeeded,
        "failed": workflow.failed,
        "remaining": workflow.remaining,
        "callback_id": workflow.callback_id,
        "created_at": iso(workflow.created_at),
        "finished_at": iso(workflow.finished_at),
    }


def _workflow_or_404(workflow_id: int) -> Workflow:
    workflow = Workflow.objects.filter(pk=workflow_id).first() if 0 < workflow_id <= MAX_BIGINT else None
    if workflow is None:
        raise ApiError(404, f"no workflow with id {workflow_id}")
    return workflow


def _detail(workflow: Workflow) -> dict[str, Any]:
    callback = None
    if workflow.callback_id is not None:
        status = Task.objects.filter(pk=workflow.callback_id).values_list("status", flat=True).first()
        callback = {"id": workflow.callback_id, "status": status}  # status null: the task was pruned
    return {"workflow": workflow_json(workflow), "members": member_counts(workflow.pk), "callback": callback}


@api_view(GET=[VIEW_TASK])
def workflows(request: HttpRequest) -> tuple[int, Any]:
    status = request.GET.get("status")
    if status is not None and status not in WORKFLOW_STATUSES:
        raise ApiError(400, f"status must be one of {', '.join(WORKFLOW_STATUSES)}", "status")
    limit, before = page_args(request)
    page = workflow_page(status, limit=limit, before=before)
    following = {"limit": limit, "before": page.next_before, **({"status": status} if status else {})}
    return 200, {
        "workflows": [workflow_json(workflow) for workflow in page.workflows],
        "next": "?" + urlencode(following) if page.next_before is not None else None,
    }


@api_view(GET=[VIEW_TASK])
def workflow_detail(request: HttpRequest, workflow_id: int) -> tuple[int, Any]:
    return 200, _detail(_workflow_or_404(workflow_id))


@api_view(POST=[CHANGE_TASK])
def cancel(request: HttpRequest, workflow_id: int) -> tuple[int, Any]:
    """Cancel every unfinished member. Nothing to cancel (the workflow had ended, or another caller
    cancelled it first) is a 409, and ``api_view`` rolls the request's transaction back: a mark that
    raced the last member's finish is undone with it."""
    Body(request, required=False).only()  # no body is needed; anything in one is refused
    workflow = _workflow_or_404(workflow_id)
    cancelled = Workflow.objects.filter(pk=workflow.pk).cancel()
    workflow.refresh_from_db()
    if not cancelled:
        raise ApiError(409, f"workflow is already {workflow.status.lower()}", status=workflow.status)
    return 200, {**_detail(workflow), "cancelled": cancelled}


@api_view(POST=[CHANGE_TASK])
def send_event(request: HttpRequest, workflow_id: int) -> tuple[int, Any]:
    """An event for every unfinished member's ``wait_for_event`` (tasks/steps.py
    ``send_workflow_event``): 201 with the members it was stored for, 409 when it reached none (the
    workflow has ended, or each unfinished member had one of the name: the first payload stands), 404
    for no workflow, 400 for a bad name or payload (nothing stored)."""
    from tasks import steps

    workflow = _workflow_or_404(workflow_id)
    name, payload = event_body(request)
    try:
        stored = steps.send_workflow_event(workflow.pk, name, payload)
    except ValueError as exc:  # a name tasks.steps refuses (blank)
        raise ApiError(400, str(exc), "name") from None
    except Workflow.DoesNotExist:
        raise ApiError(404, f"no workflow with id {workflow_id}") from None
    if not stored:
        workflow.refresh_from_db()
        raise ApiError(
            409,
            f"event {name!r} reached no member of workflow {workflow_id}: it has no unfinished member, or "
            "each had one of the name (the first payload stands)",
            status=workflow.status,
        )
    return 201, {"workflow_id": workflow.pk, "event": name, "task_ids": stored}


urlpatterns = [
    path("workflows", workflows, name="api-workflows"),
    path("workflows/<int:workflow_id>", workflow_detail, name="api-workflow-detail"),
    path("workflows/<int:workflow_id>/cancel", cancel, name="api-workflow-cancel"),
    path("workflows/<int:workflow_id>/events", send_event, name="api-workflow-events"),
]
