"""Admin of periodic tasks: the schedules stored at runtime (add, edit, pause, resume, delete), and
the schedule rows (progress of each schedule, declared or stored) and their runs, read-only (the
scheduler alone writes those).

A stored schedule's form holds the settings entry's keys; it is validated by the settings' own
validator (``stored_spec``) and written by the same one-statement operations as the JSON API's
(``StoredScheduleQuerySet``), each bumping the row's revision. Staff with the model's permissions
(``tasks.add_storedschedule``, ``change_``, ``delete_``) may use it."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from leasing.admin import CheckedInputAdmin
from leasing.routing import selected_database
from leasing.validation import InvalidInput, loads
from tasks import redaction
from tasks.lifecycle.routing import queue_database
from tasks.maintenance.schedule_specs import CATCH_UP, InvalidSchedule, load_schedules, stored_spec
from tasks.models import Schedule, ScheduleRun, StoredSchedule


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
    # The definition is shown with its arguments redacted (tasks/redaction.py), in place of the column.
    fields = [
        "definition_display" if field.name == "definition" else field.name
        for field in Schedule._meta.get_fields()
        if field.concrete
    ]
    readonly_fields = ("definition_display",)

    @admin.display(description="task")
    def task(self, obj: Schedule) -> str:
        return str(obj.definition.get("task", ""))

    @admin.display(description="definition")
    def definition_display(self, obj: Schedule) -> str:
        shown = redaction.definition(obj.definition)
        return format_html("<pre>{}</pre>", json.dumps(shown, ensure_ascii=False, indent=2, default=str))

    @admin.display(description="when")
    def every(self, obj: Schedule) -> str:
        try:
            spec = load_schedules().get(obj.name)
        except Exception:  # an invalid setting is reported by `manage.py check`; show the stored one
            spec = None
        if spec is None:
            kept = StoredSchedule.objects.filter(name=obj.name).first()
            if kept is None:
                return "no longer declared"
            try:
                spec = stored_spec(kept.name, kept.entry, paused=kept.paused)
            except InvalidSchedule as exc:
                return f"stored, not run: {exc.reason}"
            return f"{spec.every} (stored{', paused' if kept.paused else ''})"
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


# -- stored schedules ----------------------------------------------------------------------------

#: Form fields holding the entry's keys, in the order shown; JSON ones are parsed.
_ENTRY_FIELDS = (
    "task",
    "cron",
    "interval",
    "timezone",
    "args",
    "kwargs",
    "queue",
    "priority",
    "catch_up",
    "grace",
    "max_attempts",
    "timeout",
    "fair_key",
)
_JSON_FIELDS = ("args", "kwargs")


class StoredScheduleForm(forms.ModelForm):
    task = forms.CharField(
        max_length=255, help_text="Import path of a function or django.tasks Task the API may enqueue."
    )
    cron = forms.CharField(max_length=255, required=False, help_text="A cron expression (or give an interval).")
    interval = forms.FloatField(required=False, help_text="Seconds between slots (or give a cron expression).")
    timezone = forms.CharField(max_length=255, required=False, help_text="Of the cron expression (default TIME_ZONE).")
    args = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}), help_text="A JSON list.")
    kwargs = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}), help_text="A JSON object.")
    queue = forms.CharField(max_length=100, required=False)
    priority = forms.IntegerField(required=False)
    catch_up = forms.ChoiceField(choices=[("", "default (last)")] + [(c, c) for c in CATCH_UP], required=False)
    grace = forms.FloatField(required=False)
    max_attempts = forms.IntegerField(required=False)
    timeout = forms.FloatField(required=False)
    fair_key = forms.CharField(max_length=255, required=False)
    revision = forms.IntegerField(widget=forms.HiddenInput, required=False)

    class Meta:
        model = StoredSchedule
        fields = ("name", "paused")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            # Shown redacted (tasks/redaction.py); clean() puts the hidden values back on save.
            entry = redaction.definition(self.instance.entry)
            for key in _ENTRY_FIELDS:
                if key in entry:
                    self.initial[key] = json.dumps(entry[key]) if key in _JSON_FIELDS else entry[key]
            self.initial["revision"] = self.instance.revision

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        name = self.instance.name if self.instance.pk else data.get("name")
        entry: dict[str, Any] = {}
        kept: dict[str, Any] = {}  # the JSON fields as given, where a placeholder was kept
        for key in _ENTRY_FIELDS:
            value = data.get(key)
            if value in (None, ""):
                continue
            if key in _JSON_FIELDS:
                try:
                    value = loads(value)
                except InvalidInput as exc:
                    self.add_error(key, f"{key} must be JSON: {exc.message}")
                    continue
                if redaction.active() and redaction.holds_placeholder(value):
                    kept[key] = value
                    try:
                        value = self._keep_hidden(key, value)
                    except ValueError as exc:
                        self.add_error(
                            key,
                            f"{exc}: {redaction.REDACTED!r} is what this page shows in place of a hidden argument"
                            " (REDACT_ARGUMENTS); leave it where it was shown to keep the stored value, or type"
                            " the real value",
                        )
                        continue
            entry[key] = value
        for key, given in kept.items():
            if key not in entry:
                continue
            try:
                # A value kept is hidden where it is stored too: under a redactor that hides by task
                # path, the task changed beside it might show it.
                redaction.keep_hidden(given, entry, key)
            except ValueError as exc:
                self.add_error(
                    key,
                    f"{exc} as this schedule would be saved (its task shows what the page hid): type the"
                    f" real values in place of {redaction.REDACTED!r}, or keep the task",
                )
        if self.errors or not name:
            return data
        try:
            spec = stored_spec(name, entry, paused=bool(data.get("paused")))
        except InvalidSchedule as exc:
            field = exc.key if exc.key in self.fields else None
            self.add_error(field, exc.reason)
            return data
        if queue_database(spec.queue) != selected_database():
            self.add_error("queue", f"queue {spec.queue!r} is routed to another database: store the schedule there")
            return data
        if self.instance.pk:
            # The row as it is now, locked until the save commits: refuse an edit made from a stale page.
            current = StoredSchedule.objects.select_for_update().filter(name=name).first()
            if current is None:
                self.add_error(None, "this schedule was deleted meanwhile")
            elif data.get("revision") != current.revision:
                self.add_error(None, f"this schedule was changed meanwhile (revision {current.revision}): reload it")
        elif StoredSchedule.objects.filter(name=name).exists():
            self.add_error("name", "a stored schedule of this name exists")
        self.entry = entry
        return data

    def _keep_hidden(self, key: str, value: Any) -> Any:
        """The stored values back where the page showed "[redacted]": the row read with this request,
        whose revision the save checks under the row lock (a value kept from another revision is
        refused with the edit)."""
        if not self.instance.pk:
            raise ValueError(f"{key} holds {redaction.REDACTED!r} and a new schedule has no hidden value to keep")
        return redaction.keep_hidden(value, self.instance.entry, key)


@admin.register(StoredSchedule)
class StoredScheduleAdmin(CheckedInputAdmin):
    form = StoredScheduleForm
    list_display = ("name", "task", "when", "paused", "revision", "effective_from", "updated_at", "changed_by")
    list_filter = ("paused",)
    search_fields = ("name",)
    actions = ("pause_selected", "resume_selected")
    fieldsets = (
        (None, {"fields": ("name", "task", ("cron", "timezone"), "interval", "paused")}),
        ("Task options", {"fields": ("args", "kwargs", "queue", "priority", "max_attempts", "timeout", "fair_key")}),
        ("Catch-up", {"fields": ("catch_up", "grace")}),
        (None, {"fields": ("revision",)}),
    )

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return ("name",) if obj is not None else ()

    @admin.display(description="task")
    def task(self, obj: StoredSchedule) -> str:
        return str(obj.entry.get("task", ""))

    @admin.display(description="when")
    def when(self, obj: StoredSchedule) -> str:
        if obj.entry.get("cron"):
            return f"{obj.entry['cron']} ({obj.entry.get('timezone') or 'default zone'})"
        return f"every {obj.entry.get('interval')} s"

    def save_model(self, request: HttpRequest, obj: StoredSchedule, form: Any, change: bool) -> None:
        by = request.user.get_username()[:200] if request.user.is_authenticated else ""
        if change:
            row = StoredSchedule.objects.replace_stored(
                obj.name, form.entry, paused=obj.paused, revision=form.cleaned_data["revision"], by=by
            )
        else:
            row = StoredSchedule.objects.create_stored(obj.name, form.entry, paused=obj.paused, by=by)
        if row is None:  # pragma: no cover (the form checked and locked the row)
            raise RuntimeError(f"schedule {obj.name!r} changed meanwhile")
        obj.refresh_from_db()

    @admin.action(
        description="Pause the selected schedules (no slot enqueued, none back-filled)", permissions=["change"]
    )
    def pause_selected(self, request: HttpRequest, queryset: QuerySet[StoredSchedule]) -> None:
        by = request.user.get_username()
        paused = [n for n in queryset.values_list("name", flat=True) if StoredSchedule.objects.pause_stored(n, by=by)]
        self.message_user(request, f"paused {len(paused)} schedule(s)", messages.SUCCESS)

    @admin.action(description="Resume the selected schedules (from their next slot)", permissions=["change"])
    def resume_selected(self, request: HttpRequest, queryset: QuerySet[StoredSchedule]) -> None:
        by = request.user.get_username()
        resumed = [n for n in queryset.values_list("name", flat=True) if StoredSchedule.objects.resume_stored(n, by=by)]
        self.message_user(request, f"resumed {len(resumed)} schedule(s)", messages.SUCCESS)
