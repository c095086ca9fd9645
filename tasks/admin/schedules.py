"""Admin of periodic tasks: the schedule rows (progress of each declared schedule) and their runs,
read-only (schedules are declared in settings; the scheduler alone writes these rows)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from leasing.admin import CheckedInputAdmin
from tasks.maintenance.schedules import load_schedules
from tasks.models import Schedule, ScheduleRun


def _task_link(task_id: int | None) -> str:
    if task_id is None:
        return "-"
    return format_html('<a href="{}">task {}</a>', reverse("admin:tasks_task_change", args=[task_id]), task_id)


class ReadOnly(CheckedInputAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Schedule)
class ScheduleAdmin(ReadOnly):
    list_display = (
        "name",
        "task",
        "every",
        "last_enqueued_slot",
        "last_task",
        "next_slot",
        "enqueued",
        "skipped",
        "leader",
        "fence_token",
    )
    search_fields = ("name",)

    @admin.display(description="task")
    def task(self, obj: Schedule) -> str:
        return str(obj.definition.get("task", ""))

    @admin.display(description="when")
    def every(self, obj: Schedule) -> str:
        try:
            spec = load_schedules().get(obj.name)
        except Exception:  # an invalid setting is reported by `manage.py check`; show the stored one
            spec = None
        if spec is None:
            return "no longer in settings"
        return spec.every if spec.enabled else f"{spec.every} (disabled)"

    @admin.display(description="last task")
    def last_task(self, obj: Schedule) -> str:
        return _task_link(obj.last_task_id)


class ScheduleFilter(admin.SimpleListFilter):
    """Choices from the schedule rows (a handful), not a DISTINCT over every run."""

    title = "schedule"
    parameter_name = "schedule"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in Schedule.objects.values_list("name", flat=True)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(schedule=self.value()) if self.value() else queryset


@admin.register(ScheduleRun)
class ScheduleRunAdmin(ReadOnly):
    list_display = ("schedule", "slot", "task", "token", "enqueued_at")
    list_filter = (ScheduleFilter,)
    search_fields = ("=schedule", "=task_id")
    show_full_result_count = False  # a 1-second schedule keeps a week of runs

    @admin.display(description="task")
    def task(self, obj: ScheduleRun) -> str:
        return _task_link(obj.task_id)
