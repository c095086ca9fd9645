"""The task list's filters beyond the status (tasks/admin/tasks.py ``TaskAdmin.list_filter``): the
lease (stuck or live), the queue (found by a loose index scan) and the workflow (its members)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.db.models import F, QuerySet
from django.http import HttpRequest

from leasing.validation import MAX_BIGINT, InvalidInput, parse_whole
from tasks.lifecycle import vocabulary
from tasks.lifecycle.workflows import WorkflowStatus
from tasks.web import queries
from tasks.web.listings import ValueAmong
from tasks.web.workflows import workflow_page


class StuckFilter(admin.SimpleListFilter):
    title = "lease"
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("stuck", f"{vocabulary.label('stuck')} (running, lease expired)"),
            ("live", "Running with a live lease"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "stuck":
            return queryset.stuck()  # type: ignore[attr-defined]
        if self.value() == "live":
            return queryset.running().active()  # type: ignore[attr-defined]
        return queryset


class QueueFilter(admin.SimpleListFilter):
    """The queues, found by a loose index scan (the built-in filter runs SELECT DISTINCT over the table)."""

    title = "queue"
    parameter_name = "queue__exact"  # the built-in filter's parameter: existing links keep working

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # The selected queue is a choice even when tasks_task holds none of its tasks (the mover took
        # them all): a filter with no choices is dropped by the admin, and the list would show every
        # queue's tasks under a URL that names one.
        names = queries.queue_names()
        if (selected := self.value()) and selected not in names:
            names = [*names, selected]
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(queue=value) if value else queryset


class WorkflowFilter(admin.SimpleListFilter):
    """A workflow's members (``?workflow_id=``, the link from the workflow admin), read through
    tasks_task_workflow_idx (:meth:`TaskAdmin.get_paginator`). The choices are the newest running
    workflows and the one selected: never a DISTINCT over the tasks."""

    title = "workflow"
    parameter_name = "workflow_id"
    shown = 20

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        choices = [(str(w.pk), str(w)) for w in workflow_page(WorkflowStatus.RUNNING, limit=self.shown).workflows]
        selected = workflow_param(request)
        if selected is not None and str(selected) not in {value for value, _ in choices}:
            choices.insert(0, (str(selected), f"workflow {selected}"))
        return choices

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if not self.value():
            return queryset
        selected = workflow_param(request)
        if selected is None:
            raise IncorrectLookupParameters(f"workflow_id must be a whole number from 1 to {MAX_BIGINT}")
        # An array, not an equality: with "workflow_id = X" the planner could drop the column from
        # the listing's order and read the pages backwards from the primary key.
        return queryset.filter(ValueAmong(F("workflow_id"), [selected]))


def workflow_param(request: HttpRequest) -> int | None:
    """The workflow selected (``?workflow_id=``): None when absent or not a task id."""
    try:
        return parse_whole(request.GET.get(WorkflowFilter.parameter_name, ""), "workflow_id", low=1, high=MAX_BIGINT)
    except InvalidInput:
        return None
