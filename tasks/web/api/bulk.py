"""JSON API of bulk operations: request one (``POST /api/tasks/bulk``: 202 with its id and the URL to
poll), read it, list the newest, cancel it. The work is done by the recovery leader
(tasks/maintenance/bulk.py); the request only validates the filter and inserts the row."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.http import HttpRequest
from django.urls import path, reverse

from leasing.access import CHANGE_TASK, VIEW_TASK
from leasing.http import ApiError, Body, api_view, iso, page_args
from leasing.validation import MAX_BIGINT
from tasks.lifecycle.bulk import BulkFilterError
from tasks.models import BulkOperation


def operation_json(operation: BulkOperation) -> dict[str, Any]:
    return {
        "id": operation.pk,
        "kind": operation.kind,
        "filter": operation.filter,
        "status": operation.status,
        "matched": operation.matched,
        "changed": operation.changed,
        "skipped": operation.skipped,
        "batches": operation.batches,
        "progress": round(operation.progress, 4),
        "cursor": operation.cursor,
        "last_id": operation.last_id,
        "requested_by": operation.requested_by,
        "created_at": iso(operation.created_at),
        "started_at": iso(operation.started_at),
        "updated_at": iso(operation.updated_at),
        "finished_at": iso(operation.finished_at),
        "error": operation.error or None,
        "url": reverse("api-bulk-detail", args=[operation.pk]),
    }


def _operation_or_404(operation_id: int) -> BulkOperation:
    found = BulkOperation.objects.filter(pk=operation_id).first() if 0 < operation_id <= MAX_BIGINT else None
    if found is None:
        raise ApiError(404, f"no bulk operation with id {operation_id}")
    return found


@api_view(GET=[VIEW_TASK], POST=[CHANGE_TASK])
def operations(request: HttpRequest) -> tuple[int, Any]:
    if request.method == "GET":
        limit, before = page_args(request)
        rows = BulkOperation.objects.order_by("-id")
        if before is not None:
            rows = rows.filter(pk__lt=before)
        page = list(rows[: limit + 1])
        following = {"limit": limit, "before": page[limit - 1].pk} if len(page) > limit else None
        return 200, {
            "operations": [operation_json(operation) for operation in page[:limit]],
            "next": "?" + urlencode(following) if following else None,
        }
    body = Body(request)
    body.only("kind", "filter")
    caller = getattr(request, "api_caller", None)
    try:
        operation = BulkOperation.objects.request(
            body.data.get("kind"), body.data.get("filter"), requested_by=caller.name if caller else ""
        )
    except BulkFilterError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    return 202, {"operation": operation_json(operation), "poll": operation_json(operation)["url"]}


@api_view(GET=[VIEW_TASK])
def operation_detail(request: HttpRequest, operation_id: int) -> tuple[int, Any]:
    return 200, {"operation": operation_json(_operation_or_404(operation_id))}


@api_view(POST=[CHANGE_TASK])
def cancel(request: HttpRequest, operation_id: int) -> tuple[int, Any]:
    """Stop an open operation: what it changed stays changed. One that ended already is a 409."""
    Body(request, required=False).only()
    operation = _operation_or_404(operation_id)
    cancelled = BulkOperation.objects.filter(pk=operation.pk).cancel()
    operation.refresh_from_db()
    if not cancelled:
        raise ApiError(409, f"bulk operation is already {operation.status.lower()}", status=operation.status)
    return 200, {"operation": operation_json(operation)}


urlpatterns = [
    path("tasks/bulk", operations, name="api-bulk"),
    path("tasks/bulk/<int:operation_id>", operation_detail, name="api-bulk-detail"),
    path("tasks/bulk/<int:operation_id>/cancel", cancel, name="api-bulk-cancel"),
]
