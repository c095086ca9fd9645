"""Dashboard pages of workflows: every workflow newest first (by status), and one workflow with its
members counted by status and listed newest first, its callback, and a Cancel button. The reads
are in tasks/web/workflows.py; each costs a page or the workflow's own members, never the history."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse

from leasing.access import CHANGE_TASK, VIEW_TASK, staff_page
from leasing.routing import selected_database, with_database
from leasing.validation import MAX_BIGINT, InvalidInput, parse_whole
from tasks.lifecycle.workflows import WorkflowStatus
from tasks.models import Task, Workflow
from tasks.web.dashboard import filter_value
from tasks.web.listings import ALL_STATUSES
from tasks.web.workflows import WORKFLOW_STATUSES, member_counts, member_listing, workflow_counts, workflow_page

PAGE_SIZE = 50


def _one_of(choices: tuple[str, ...], name: str) -> Any:
    def parse(value: str) -> str:
        if value not in choices:
            raise InvalidInput(f"{name} must be one of {', '.join(choices)}", name)
        return value

    return parse


def _before(value: str) -> int:
    return parse_whole(value, "before", low=1, high=MAX_BIGINT)


def _workflow_or_404(workflow_id: int) -> Workflow:
    workflow = Workflow.objects.filter(pk=workflow_id).first() if 0 < workflow_id <= MAX_BIGINT else None
    if workflow is None:
        raise Http404(f"no workflow with id {workflow_id}")
    return workflow


@staff_page(GET=[VIEW_TASK])
def workflow_list(request: HttpRequest) -> HttpResponse:
    status = filter_value(request, "status", _one_of(WORKFLOW_STATUSES, "status"))
    before = filter_value(request, "before", _before)
    page = workflow_page(status, limit=PAGE_SIZE, before=before)
    return render(
        request,
        "tasks/dashboard/workflows.html",
        {
            "workflows": page.workflows,
            "next_before": page.next_before,
            "status": status or "",
            "paged": before is not None,
            "counts": workflow_counts(),
        },
    )


def _detail(request: HttpRequest, workflow: Workflow, *, status: int = 200) -> HttpResponse:
    member_status = filter_value(request, "status", _one_of(ALL_STATUSES, "status"))
    before = filter_value(request, "before", _before)
    counts = member_counts(workflow.pk)
    page = member_listing(workflow.pk, counts, member_status).page(limit=PAGE_SIZE, before=before)
    callback = Task.objects.filter(pk=workflow.callback_id).first() if workflow.callback_id is not None else None
    return render(
        request,
        "tasks/dashboard/workflow_detail.html",
        {
            "workflow": workflow,
            "counts": counts,
            "counted": sum(counts.values()),
            "member_status": member_status or "",
            "tasks": page.tasks,
            "next_before": page.next_before,
            "paged": before is not None,
            "callback": callback,
            "running": workflow.status == WorkflowStatus.RUNNING,
        },
        status=status,
    )


@staff_page(GET=[VIEW_TASK])
def workflow_detail(request: HttpRequest, workflow_id: int) -> HttpResponse:
    return _detail(request, _workflow_or_404(workflow_id))


class _NothingCancelled(Exception):
    """Rolls the cancel's savepoint back."""


@staff_page(POST=[CHANGE_TASK])
def workflow_cancel(request: HttpRequest, workflow_id: int) -> HttpResponse:
    """Cancel every unfinished member (``WorkflowQuerySet.cancel``: the workflow is marked, then its
    members are cancelled, a running one's worker losing its lease). Nothing to cancel (the workflow
    had ended, or another operator cancelled it first): a 409 page, and what the attempt wrote is
    rolled back (to a savepoint in the request's transaction, ``staff_page``: the page is still
    read after it), so a mark that raced the last member's finish is undone too."""
    workflow = _workflow_or_404(workflow_id)
    try:
        with transaction.atomic(using=selected_database()):
            cancelled = Workflow.objects.filter(pk=workflow.pk).cancel()
            if not cancelled:
                raise _NothingCancelled
    except _NothingCancelled:
        workflow.refresh_from_db()
        messages.error(request, f"Nothing changed: workflow {workflow.pk} is already {workflow.status.lower()}.")
        return _detail(request, workflow, status=409)
    messages.success(request, f"Cancelled {cancelled} unfinished task(s) of workflow {workflow.pk}.")
    return HttpResponseRedirect(with_database(reverse("tasks:workflow-detail", args=[workflow.pk])))
