"""Admin of workflows, read-only (the builder writes them, the database's triggers move them): the
list with each one's progress and links to its members, filtered by status, searched by id or
name, and a "cancel" action. The Task admin's workflow filter and column are in ``tasks.py``."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db import connections
from django.db.models import F, QuerySet
from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html

from leasing.access import CHANGE_TASK
from leasing.admin import CheckedInputAdmin
from leasing.pagination import CappedPaginator
from leasing.routing import selected_database
from leasing.validation import MAX_BIGINT
from tasks.lifecycle.workflows import WorkflowStatus
from tasks.models import Workflow
from tasks.web.listings import StatusAmong

#: A name is searched among the newest workflows only: the name has no index, and a search must not
#: read every workflow ever run.
NAME_WINDOW = 10_000

# The newest NAME_WINDOW workflows, read backwards from the primary key, then matched on the name:
# the derived table's LIMIT bounds the read whatever the planner thinks of the name's selectivity.
NAME_SEARCH_SQL = """
SELECT w.id FROM (SELECT id, name FROM tasks_workflow ORDER BY id DESC LIMIT %(window)s) AS w WHERE w.name = %(name)s
"""


class WorkflowStatusFilter(admin.SimpleListFilter):
    """One status, read from tasks_workflow_status_idx in an order only it gives (see
    :func:`tasks.web.workflows.workflow_page`), with the ordering of :meth:`WorkflowAdmin.get_ordering`."""

    title = "status"
    parameter_name = "status__exact"  # the built-in filter's parameter

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(str(value), str(label)) for value, label in WorkflowStatus.choices]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(StatusAmong(F("status"), [value])) if value in WorkflowStatus.values else queryset


@admin.register(Workflow)
class WorkflowAdmin(CheckedInputAdmin):
    list_display = (
        "id",
        "name",
        "kind",
        "status",
        "progress",
        "created_at",
        "finished_at",
        "callback",
        "members",
    )
    list_filter = (WorkflowStatusFilter,)
    search_fields = ("=id", "=name")  # get_search_results: the id, or a name among the newest
    search_help_text = f"Exact id, or exact name among the newest {NAME_WINDOW:,} workflows."
    sortable_by = ()  # every order but the newest first would sort the whole history
    paginator = CappedPaginator  # no COUNT over every workflow: "10000+"
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    actions = ("cancel",)
    readonly_fields = [field.name for field in Workflow._meta.get_fields() if field.concrete]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # enqueue through tasks.workflows

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # retention removes a finished workflow with its members, as one unit

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        # Cancelling a workflow cancels tasks: the permission the task admin's cancel needs.
        return bool(request.user.has_perm(CHANGE_TASK))

    def get_ordering(self, request: HttpRequest) -> tuple[str, ...]:
        if request.GET.get(WorkflowStatusFilter.parameter_name) in WorkflowStatus.values:
            return ("status", "-id")  # with the filter's array: only tasks_workflow_status_idx gives it
        return ("-id",)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Workflow], search_term: str
    ) -> tuple[QuerySet[Workflow], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        if "\x00" in term:
            return queryset.none(), False
        ids = []
        if term.isascii() and term.isdigit() and len(term) <= 19 and 0 < int(term) <= MAX_BIGINT:
            ids.append(int(term))
        if len(term) <= 200:
            with connections[selected_database()].cursor() as cursor:
                cursor.execute(NAME_SEARCH_SQL, {"window": NAME_WINDOW, "name": term})
                ids += [row[0] for row in cursor.fetchall()]
        return queryset.filter(pk__in=ids), False

    @admin.display(description="progress")
    def progress(self, obj: Workflow) -> str:
        return f"{obj.succeeded} successful, {obj.failed} failed, {obj.remaining} remaining of {obj.total}"

    @admin.display(description="callback or last step")
    def callback(self, obj: Workflow) -> str:
        if obj.callback_id is None:
            return "-"
        url = reverse("admin:tasks_task_change", args=[obj.callback_id])
        return format_html('<a href="{}">task {}</a> ({})', url, obj.callback_id, obj.callback_role)

    @admin.display(description="members")
    def members(self, obj: Workflow) -> str:
        tasks = reverse("admin:tasks_task_changelist") + f"?workflow_id={obj.pk}"
        try:
            page = reverse("tasks:workflow-detail", args=[obj.pk])
        except NoReverseMatch:  # the dashboard is not mounted
            return format_html('<a href="{}">tasks</a>', tasks)
        return format_html('<a href="{}">tasks</a> · <a href="{}">dashboard</a>', tasks, page)

    @admin.action(permissions=["cancel"], description="Cancel the selected workflows (their unfinished tasks)")
    def cancel(self, request: HttpRequest, queryset: QuerySet[Workflow]) -> None:
        count = Workflow.objects.filter(pk__in=queryset.values("pk")).cancel()
        self.message_user(request, f"Cancelled {count} unfinished task(s) of the selected workflows.", messages.SUCCESS)
