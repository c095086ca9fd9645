"""The admin of the tasks (``TaskAdmin``): its list read as the dashboard's listings are
(tasks/web/listings.py), its actions the operator's transitions; the filters beyond the status are in
``task_filters.py``."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.actions import delete_selected as django_delete_selected
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.views.main import SEARCH_VAR, ChangeList
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import DEFAULT_DB_ALIAS, transaction
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from leasing.admin import CheckedInputAdmin
from leasing.templatetags.leasing_tags import stamp
from leasing.validation import MAX_BIGINT, InvalidInput, parse_whole
from tasks import redaction
from tasks.admin.task_filters import QueueFilter, StuckFilter, WorkflowFilter, workflow_param
from tasks.exceptions import TaskError, TaskNotFinished, TaskRunAgain
from tasks.lifecycle import vocabulary
from tasks.lifecycle.bulk import BulkFilterError
from tasks.lifecycle.states import UNFINISHED
from tasks.models import BulkOperation, Task
from tasks.models.finished import archived_ids
from tasks.web import listings, queries
from tasks.web.attempts import history

_UNSEARCHED = "_tasks_unsearched_queryset"
_UNFINISHED_DELETE = "_tasks_unfinished_delete"
_SELECTED_ACROSS = "_tasks_selected_across"


class TaskChangeList(ChangeList):
    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        if isinstance(self.result_list, QuerySet):
            # A result that fits one page (or "show all"): Django would read the filtered queryset
            # whole and sort it; read it from the listing's index scans like any other page.
            listing = self.paginator.listing
            self.result_list = listing.rows(listing.ids(0, self.result_count))


def _refuse_if_run_again(tasks: QuerySet[Task], ids: list[int]) -> None:
    """After a delete that found some of ``ids`` in neither table where it looked: a rerun brought
    them back meanwhile. :class:`TaskNotFinished` for those unfinished now; :class:`TaskRunAgain`
    for those that finished again within the delete's window (in tasks_task, or already moved back
    to tasks_finished): their new run's result is not deleted unseen. One deleted by someone else
    meanwhile is gone either way."""
    back = list(tasks.filter(pk__in=ids).order_by("pk").values_list("pk", "status"))
    if unfinished := [(pk, status) for pk, status in back if status in UNFINISHED]:
        raise TaskNotFinished(unfinished)
    if again := sorted(back + archived_ids(ids, tasks.db)):
        raise TaskRunAgain(again)


@admin.register(Task)
class TaskAdmin(CheckedInputAdmin):
    # Pages are newest first, always: each is read from ordered index scans (ListingPaginator), and
    # an order on another column would sort every match. No header offers a sort it would ignore.
    sortable_by = ()
    list_display = (
        "id",
        "task_path",
        "queue",
        "status_display",
        "attempts_display",
        "holder",
        "lease_expiry",
        "renewed_at",
        "progress",
        "enqueued_at",
        "workflow",
    )
    list_filter = ("status", QueueFilter, StuckFilter, WorkflowFilter)
    # Search is exact on indexed columns (get_search_results): no LIKE '%…%' over the table.
    search_fields = ("=id", "=dedup_key", "=holder", "=task_path")
    search_help_text = (
        "Exact id, dedup key, worker id (holder) or task path, whole or its last part (send_email finds"
        ' app.tasks.send_email); kwargs:{"customer": 7} or args:[7] searches the arguments (with the opt-in'
        " index: manage.py tasks_search_index create). Nothing matches a part of a word."
    )
    show_full_result_count = False  # no full-table COUNT on a large queue
    show_facets = admin.ShowFacets.NEVER  # facet counts would COUNT every filter choice over the table
    actions = (
        "delete_selected",
        "requeue",
        "retry_now",
        "cancel",
        "retry_all_matching",
        "cancel_all_matching",
        "discard_all_matching",
    )
    # The arguments are shown redacted (tasks/redaction.py), as JSON, in place of the columns.
    readonly_fields = [
        "arguments_display" if field.name == "args" else field.name
        for field in Task._meta.get_fields()
        if field.concrete and field.name not in ("errors", "kwargs")
    ] + ["errors_display", "unique_window_display"]
    exclude = ("errors", "args", "kwargs")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # enqueue through the API or Task.objects.enqueue

    # A task the mover took to tasks_finished (issue 43) is listed among the others and opens as a page
    # of its own, read-only; it may be deleted from there. Selected, it is requeued (brought back
    # first); a delete of a selection holding one is refused, naming it.

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        found = super().get_object(request, object_id, from_field)
        if found is not None or from_field is not None:
            return found
        try:
            task_id = parse_whole(object_id, "id", low=1, high=MAX_BIGINT)
        except InvalidInput:
            return None
        return Task.objects.using(self.get_queryset(request).db).find(task_id)

    def has_change_permission(self, request: HttpRequest, obj: Task | None = None) -> bool:
        if obj is not None and obj.archived:
            return False  # shown with the view permission, every field read-only, no action
        return super().has_change_permission(request, obj)

    def _selected_ids(self, request: HttpRequest) -> list[int]:
        """The ids the operator selected: those ticked (none for a malformed one: Django's own action
        refuses it), or with "select all N" every task the list counts, in both tables (the action's
        queryset reads tasks_task only). Past COUNT_CAP the list's tasks are not enumerated: a
        TaskError points to the background operation of every matching task."""
        if request.POST.get("select_across") == "1":
            # Once per request: the requeue asks twice (before and after its update).
            if (cached := getattr(request, _SELECTED_ACROSS, None)) is not None:
                return list(cached)
            paginator = self.get_changelist_instance(request).paginator
            if not isinstance(paginator, listings.ListingPaginator) or paginator.capped:
                raise TaskError(
                    f"more than {listings.COUNT_CAP:,} tasks selected: use the actions on ALL matching tasks"
                    " (background) or narrow the filters"
                )
            selected = list(paginator.listing.counted or [])
            setattr(request, _SELECTED_ACROSS, selected)
            return list(selected)
        try:
            return [parse_whole(v, "id", low=1, high=MAX_BIGINT) for v in request.POST.getlist(ACTION_CHECKBOX_NAME)]
        except InvalidInput:
            return []

    def _archived_selected(self, request: HttpRequest, queryset: QuerySet[Task]) -> list[int]:
        """The selected ids kept in tasks_finished (the action's queryset reads tasks_task only)."""
        ids = self._selected_ids(request)
        present = set(Task.objects.using(queryset.db).filter(pk__in=ids).values_list("pk", flat=True))
        return [
            pk for pk, _status in archived_ids([i for i in ids if i not in present][: listings.COUNT_CAP], queryset.db)
        ]

    # Only a finished task is deleted (the "delete" transition, tasks/lifecycle/transitions.py). A
    # running attempt deleted would leave its worker renewing nothing and its key slot unaccounted; a
    # waiting workflow member's dependants would wait for it forever. Cancel first: the cancel is a
    # transition every one of them knows. Each delete is one conditional statement
    # (TaskQuerySet.delete_finished), so a task requeued while the operator confirmed is not deleted
    # either, and a refused request leaves no row and no "deleted" log entry behind (invariant 12).

    def has_delete_permission(self, request: HttpRequest, obj: Task | None = None) -> bool:
        if obj is not None and obj.status in UNFINISHED:
            setattr(request, _UNFINISHED_DELETE, obj)  # delete_view says why instead of a bare 403
            return False
        return super().has_delete_permission(request, obj)

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None) -> Any:
        try:
            return super().delete_view(request, object_id, extra_context)
        except PermissionDenied:
            refused = getattr(request, _UNFINISHED_DELETE, None)
            if refused is None:
                raise  # no delete permission at all
            error: TaskError = TaskNotFinished([(refused.pk, refused.status)])
        except (TaskNotFinished, TaskRunAgain) as exc:  # run again before the confirmation: rolled back
            error = exc
        self.message_user(request, f"Nothing deleted: {error}.", messages.ERROR)
        url = reverse("admin:tasks_task_change", args=[object_id])
        return HttpResponseRedirect(f"{url}?{request.GET.urlencode()}" if request.GET else url)

    # A delete confirmed for a task the mover took meanwhile (its batch held the row while the
    # delete waited; the delete found it gone) deletes it from tasks_finished, where it is now:
    # what the operator confirmed is what is deleted, and Django's "deleted" message stays true. A
    # task found in neither table was run again meanwhile (a rerun restored it to tasks_task):
    # the delete is refused whole, its log entries rolled back with it, whether the new run is
    # unfinished or already finished again (its result is not deleted unseen).

    def delete_model(self, request: HttpRequest, obj: Task) -> None:
        tasks = Task.objects.using(obj._state.db)
        # Read from tasks_finished (archived): deleted from its day there; else the mover may have it.
        if (obj.archived or not tasks.filter(pk=obj.pk).delete_finished()) and not tasks.delete_archived([obj.pk]):
            _refuse_if_run_again(tasks, [obj.pk])

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        # The tasks Django read, logged and counted in its message (its queryset's cache): a task the
        # mover took since is deleted from tasks_finished below, not left there.
        ids = [task.pk for task in queryset]
        tasks = Task.objects.using(queryset.db)
        deleted = tasks.filter(pk__in=ids).delete_finished()
        if deleted < len(ids) and deleted + tasks.delete_archived(ids) < len(ids):
            _refuse_if_run_again(tasks, ids)

    @admin.action(permissions=["delete"], description="Delete selected finished tasks")
    def delete_selected(self, request: HttpRequest, queryset: QuerySet[Task]) -> Any:
        """Django's delete (its confirmation page, then the delete) of a selection whose every task is
        finished. A selection with an unfinished task is refused whole, naming the unfinished ones:
        what the operator confirms is what is deleted, and a retry after cancelling them is one
        click, where a partial delete would leave them to work out which rows went."""
        unfinished = list(queryset.filter(status__in=UNFINISHED).order_by("pk").values_list("pk", "status")[:11])
        if unfinished:
            self.message_user(request, f"Nothing deleted: {TaskNotFinished(unfinished)}.", messages.ERROR)
            return None
        try:
            history = self._archived_selected(request, queryset)
        except TaskError as exc:  # "select all" past the cap
            self.message_user(request, f"Nothing deleted: {exc}.", messages.ERROR)
            return None
        if history:  # its confirmation page would not list them: refused whole, as an unfinished one
            named = ", ".join(str(pk) for pk in history[:10])
            self.message_user(
                request,
                f"Nothing deleted: task(s) {named} are kept in the finished history; delete each from its page.",
                messages.ERROR,
            )
            return None
        try:
            # The "deleted" log entries (the default database) and the delete go together.
            with transaction.atomic(using=DEFAULT_DB_ALIAS), transaction.atomic(using=queryset.db):
                return django_delete_selected(self, request, queryset)
        except (TaskNotFinished, TaskRunAgain) as exc:  # one was run again while the operator confirmed
            self.message_user(request, f"Nothing deleted: {exc}.", messages.ERROR)
            return None

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return TaskChangeList

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Task], search_term: str
    ) -> tuple[QuerySet[Task], bool]:
        if not search_term.strip():
            return queryset, False
        # The paginator reads one branch per lookup from the queryset as it was before the search:
        # inside a branch the OR of every lookup would only mislead the planner.
        setattr(request, _UNSEARCHED, queryset)
        try:
            lookups = queries.search_lookups(search_term)
        except InvalidInput as exc:  # an argument search without its index, or malformed
            self.message_user(request, f"Search refused: {exc.message}.", messages.ERROR)
            lookups = []
        return (queryset.filter(queries.any_of(lookups)) if lookups else queryset.none()), False

    def get_paginator(
        self,
        request: HttpRequest,
        queryset: QuerySet[Task],
        per_page: int,
        orphans: int = 0,
        allow_empty_first_page: bool = True,
    ) -> Paginator:
        if queryset.model is not Task:
            # The history page paginates the task's log entries with this too (Django 5.1+).
            return super().get_paginator(request, queryset, per_page, orphans, allow_empty_first_page)
        # Pages read as ordered index scans, one per status (and per search lookup), merged: a
        # filter on a queue or a search never sorts every match. Branches whose status contradicts
        # a status filter cost nothing (the planner folds them to false).
        search = request.GET.get(SEARCH_VAR, "")
        lookups, base = None, queryset
        if (workflow := workflow_param(request)) is not None:
            # A workflow's members: the workflow drives every branch (tasks_task_workflow_idx) and a
            # search is checked among them; the cost is the workflow's, not the history's.
            lookups = [Q(workflow_id=workflow)]
        elif search.strip():
            try:
                lookups = queries.search_lookups(search)
            except InvalidInput:  # said by get_search_results
                lookups = []
            base = getattr(request, _UNSEARCHED, queryset)
        listing = listings.Listing(base, listings.ALL_STATUSES, lookups=lookups)
        return listings.ListingPaginator(listing, per_page, orphans, allow_empty_first_page)

    @admin.display(description="status", ordering="status")
    def status_display(self, obj: Task) -> str:
        return vocabulary.state_of(obj).label  # the dashboard's one name for the task's state

    @admin.display(description="workflow")
    def workflow(self, obj: Task) -> str:
        if obj.workflow_id is None:
            return "-"
        url = reverse("admin:tasks_task_changelist") + f"?workflow_id={obj.workflow_id}"
        waiting = f" (waiting on {obj.parents_left})" if obj.status == "AWAITING" else ""
        return format_html('<a href="{}">{}</a>{}', url, obj.workflow_id, waiting)

    @admin.display(description="attempts")
    def attempts_display(self, obj: Task) -> str:
        return f"{obj.attempts}/{obj.max_attempts}"

    @admin.display(description="lease expires", ordering="expires_at")
    def lease_expiry(self, obj: Task) -> str:
        if obj.status != "RUNNING" or obj.expires_at is None:
            return "-"
        remaining = obj.expires_at - timezone.now()
        if remaining <= dt.timedelta(0):
            return f"expired {-remaining.total_seconds():.0f} s ago"
        return f"in {remaining.total_seconds():.1f} s"

    @admin.display(description="unique window")
    def unique_window_display(self, obj: Task) -> str:
        window = obj.unique_window()  # one primary-key probe, only for a task with a dedup key
        if window is None:
            return "-"
        return f"{window.key}: unique until {window.expires_at:%Y-%m-%d %H:%M:%S} ({window.seconds:g} s window)"

    @admin.display(description="arguments")
    def arguments_display(self, obj: Task) -> str:
        shown = redaction.arguments(obj)
        return format_html(
            "<pre>args = {}\nkwargs = {}</pre>",
            json.dumps(shown["args"], ensure_ascii=False, indent=2, default=str),
            json.dumps(shown["kwargs"], ensure_ascii=False, indent=2, default=str),
        )

    @admin.display(description="attempts and errors")
    def errors_display(self, obj: Task) -> str:
        """Every attempt once, in order, and the events that were no attempt (tasks/web/attempts.py)."""
        if not obj.errors and not obj.worker_ids:
            return "-"
        shown = history(obj)
        dropped = (
            format_html("<p>{} error entries dropped between the first and the newest</p>", obj.errors_dropped)
            if obj.errors_dropped
            else ""
        )
        rows = format_html_join(
            "",
            "<div style='margin-bottom:1em'><strong>attempt {} · {}</strong> by {}, {} to {}{}</div>",
            (
                (
                    attempt.number,
                    attempt.outcome,
                    attempt.worker,
                    stamp(attempt.started_at) or "-",
                    stamp(attempt.ended_at) or "-",
                    _error_html(attempt.error),
                )
                for attempt in shown.attempts
            ),
        )
        events = format_html_join(
            "",
            "<div style='margin-bottom:1em'><strong>{}</strong> at {}{}</div>",
            (
                (event.get("kind") or "error", stamp(event.get("at")) or "-", _error_html(event))
                for event in shown.events
            ),
        )
        return format_html("{}{}{}", dropped, rows, events)

    @admin.action(permissions=["change"], description="Requeue finished tasks (fresh attempts)")
    def requeue(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        try:
            with transaction.atomic(using=queryset.db):
                # Those the mover took to tasks_finished come back first, in the requeue's transaction.
                history = Task.objects.using(queryset.db).restore(self._archived_selected(request, queryset))
                chosen = (
                    Q(pk__in=queryset.values("pk")) | Q(pk__in=history) if history else Q(pk__in=queryset.values("pk"))
                )
                count = Task.objects.filter(chosen).requeue()
                # The mover held a selected row when the history was read (its move not committed:
                # nothing to bring back yet); the requeue waited for it and found it gone. It is in
                # tasks_finished now: back, then requeued as the others (tasks/web/dashboard.py too).
                late = Task.objects.using(queryset.db).restore(self._selected_ids(request))
                if late:
                    count += Task.objects.filter(pk__in=late).requeue()
        except TaskError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        self.message_user(request, f"Requeued {count} finished task(s).", messages.SUCCESS)

    @admin.action(permissions=["change"], description="Retry waiting tasks now")
    def retry_now(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        count = Task.objects.filter(pk__in=queryset.values("pk")).retry_now()
        self.message_user(request, f"{count} waiting task(s) will run now.", messages.SUCCESS)

    @admin.action(permissions=["change"], description="Cancel unfinished tasks")
    def cancel(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        count = Task.objects.filter(pk__in=queryset.values("pk")).cancel()
        self.message_user(request, f"Cancelled {count} unfinished task(s).", messages.SUCCESS)

    # "… all matching": a bulk operation (tasks/lifecycle/bulk.py) on the list's filters (status, queue,
    # workflow), whatever is selected or shown, run in the background by the recovery leader; the
    # request only inserts it. A filter a bulk operation cannot express (the lease filter, a search)
    # is refused rather than widened.
    def _request_bulk(self, request: HttpRequest, kind: str) -> None:
        unsupported = sorted(name for name in (StuckFilter.parameter_name, SEARCH_VAR) if request.GET.get(name))
        if unsupported:
            self.message_user(
                request,
                f"Nothing requested: a bulk {kind} takes the status, queue and workflow filters,"
                f" not {', '.join(unsupported)} (the dashboard's bulk page has every filter).",
                messages.ERROR,
            )
            return
        data: dict[str, Any] = {}
        if status := request.GET.get("status__exact"):
            data["status"] = status
        if queue := request.GET.get(QueueFilter.parameter_name):
            data["queue"] = queue
        if (workflow := workflow_param(request)) is not None:
            data["workflow_id"] = workflow
        try:
            operation = BulkOperation.objects.request(kind, data, requested_by=request.user.get_username())
        except BulkFilterError as exc:
            self.message_user(request, f"Nothing requested: {exc}.", messages.ERROR)
            return
        url = reverse("tasks:bulk-detail", args=[operation.pk])
        self.message_user(
            request,
            format_html(
                'Bulk {} <a href="{}">#{}</a> requested for every task matching {}: it runs in the background.',
                kind,
                url,
                operation.pk,
                ", ".join(f"{k}={v}" for k, v in operation.filter.items()),
            ),
            messages.SUCCESS,
        )

    @admin.action(
        permissions=["change"], description="Retry ALL failed/cancelled tasks matching the filters (background)"
    )
    def retry_all_matching(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        self._request_bulk(request, "retry")

    @admin.action(permissions=["change"], description="Cancel ALL waiting tasks matching the filters (background)")
    def cancel_all_matching(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        self._request_bulk(request, "cancel")

    @admin.action(permissions=["change"], description="Discard ALL waiting tasks matching the filters (background)")
    def discard_all_matching(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        self._request_bulk(request, "discard")


def _error_html(entry: dict[str, Any] | None) -> str:
    if not entry:
        return ""
    return format_html(
        "<br>{}: {}<pre>{}</pre>",
        entry.get("exception_class_path") or entry.get("type") or "error",
        entry.get("message") or "",
        entry.get("traceback") or json.dumps({k: v for k, v in entry.items() if k != "traceback"}, default=str),
    )
