"""The dashboard's bulk operations: request a retry / cancel / discard of every task matching a filter,
watch its progress, cancel it. The request only validates and inserts the operation's row (in the
page's one transaction: a refused form writes nothing); the recovery leader does the work in batches
(tasks/maintenance/bulk.py)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse

from leasing.access import CHANGE_TASK, VIEW_TASK, staff_page
from leasing.routing import with_database
from leasing.validation import MAX_BIGINT
from tasks.lifecycle import vocabulary
from tasks.lifecycle.bulk import FILTER_FIELDS, KIND_STATUSES, KINDS, BulkFilterError
from tasks.models import BulkOperation

#: Operations listed, newest first (the table keeps every one: retention does not prune it yet).
SHOWN = 50
_CONTAINS = ("args_contains", "kwargs_contains")


def filter_from_form(data: Any) -> dict[str, Any]:
    """The filter a form (or a task list's "all matching" link) describes: empty fields are absent,
    ``status`` may repeat and takes the pages' labels (``Failed``; the API's ``FAILED`` too),
    containment fields are JSON text. Raises BulkFilterError."""
    result: dict[str, Any] = {}
    # A name that is no status goes on as given: the operation's validation refuses it, naming it.
    statuses = [vocabulary.status_from_label(s) or s for s in data.getlist("status") if s]
    if statuses:
        result["status"] = statuses
    for name in FILTER_FIELDS:
        if name == "status":
            continue
        value = (data.get(name) or "").strip()
        if not value:
            continue
        if name == "workflow_id":
            if not (value.isascii() and value.isdigit()):  # not '²', which int() refuses
                raise BulkFilterError("workflow id must be a positive integer", f"filter.{name}")
            result[name] = int(value)
        elif name in _CONTAINS:
            try:
                result[name] = json.loads(value)
            except ValueError:
                raise BulkFilterError(f'{name.replace("_", " ")} must be JSON, e.g. {{"customer": 7}}', name) from None
        else:
            result[name] = value
    return result


@staff_page(GET=[VIEW_TASK], POST=[CHANGE_TASK])
def bulk_operations(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        try:
            operation = BulkOperation.objects.request(
                request.POST.get("kind"), filter_from_form(request.POST), requested_by=request.user.get_username()
            )
        except BulkFilterError as exc:
            messages.error(request, f"Nothing requested: {exc}.")
        else:
            messages.success(
                request, f"Bulk {operation.kind} #{operation.pk} requested: the recovery leader works through it."
            )
            return HttpResponseRedirect(with_database(reverse("tasks:bulk-detail", args=[operation.pk])))
    initial = request.POST if request.method == "POST" else request.GET
    return render(
        request,
        "tasks/dashboard/bulk.html",
        {
            "operations": list(BulkOperation.objects.order_by("-id")[:SHOWN]),
            "kinds": KINDS,
            "kind_statuses": KIND_STATUSES,
            # The statuses a bulk operation takes (retry's, then cancel's), by label.
            "statuses": [
                vocabulary.STATUSES[s] for s in dict.fromkeys([*KIND_STATUSES["retry"], *KIND_STATUSES["cancel"]])
            ],
            "initial": initial,
            "initial_statuses": [vocabulary.status_from_label(s) for s in initial.getlist("status")],
        },
    )


def _operation_or_404(operation_id: int) -> BulkOperation:
    found = BulkOperation.objects.filter(pk=operation_id).first() if 0 < operation_id <= MAX_BIGINT else None
    if found is None:
        raise Http404(f"no bulk operation with id {operation_id}")
    return found


@staff_page(GET=[VIEW_TASK])
def bulk_detail(request: HttpRequest, operation_id: int) -> HttpResponse:
    operation = _operation_or_404(operation_id)
    return render(request, "tasks/dashboard/bulk_detail.html", {"operation": operation})


@staff_page(POST=[CHANGE_TASK])
def bulk_cancel(request: HttpRequest, operation_id: int) -> HttpResponse:
    operation = _operation_or_404(operation_id)
    if BulkOperation.objects.filter(pk=operation.pk).cancel():
        messages.success(request, f"Bulk {operation.kind} #{operation.pk} cancelled; what it changed stays changed.")
    else:
        operation.refresh_from_db()
        messages.error(request, f"Bulk {operation.kind} #{operation.pk} is already {operation.status.lower()}.")
    return HttpResponseRedirect(with_database(reverse("tasks:bulk-detail", args=[operation.pk])))
