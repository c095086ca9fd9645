"""The admin of the workers (read-only: what each runs, a link to the tasks it holds) and of the
queue switches (pause and resume, as the command and the API do)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html

from leasing.admin import CheckedInputAdmin
from leasing.routing import selected_database
from tasks.backends.placement import misrouted, switch_database
from tasks.exceptions import TaskError
from tasks.lifecycle.routing import queue_database
from tasks.models import QueueControl, Worker


@admin.register(Worker)
class WorkerAdmin(CheckedInputAdmin):
    list_display = ("id", "hostname", "pid", "concurrency", "running", "last_seen_at", "stopped_at", "tasks_link")
    search_fields = ("id", "hostname")
    readonly_fields = [field.name for field in Worker._meta.get_fields() if field.concrete]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.display(description="tasks held")
    def tasks_link(self, obj: Worker) -> str:
        url = reverse("admin:tasks_task_changelist") + f"?q={obj.id}&status__exact=RUNNING"
        return format_html('<a href="{}">tasks</a>', url)


@admin.register(QueueControl)
class QueueControlAdmin(CheckedInputAdmin):
    """Pause and resume queues. Saving here goes through the same calls as the command and the API,
    so a resume wakes idle workers at once."""

    list_display = ("name", "paused", "changed_at", "changed_by", "reason")
    list_filter = ("paused",)
    search_fields = ("=name",)
    fields = ("name", "paused", "reason", "changed_at", "changed_by")
    readonly_fields = ("changed_at", "changed_by")
    actions = ("pause", "resume")

    def get_readonly_fields(self, request: HttpRequest, obj: QueueControl | None = None) -> tuple[str, ...]:
        return (*self.readonly_fields, "name") if obj is not None else self.readonly_fields

    def get_form(
        self, request: HttpRequest, obj: QueueControl | None = None, change: bool = False, **kwargs: Any
    ) -> Any:
        """A queue's switch lives in the database its workers claim from (tasks/lifecycle/routing.py): the
        form refuses a queue whose tasks never land in the database the page shows (neither routed
        there nor taken by a LeaseBackend pinned there), rather than saving a switch there that no
        worker of that queue reads."""
        base = super().get_form(request, obj, change, **kwargs)
        shown = selected_database()

        class RoutedForm(base):  # type: ignore[misc, valid-type]
            def clean(self) -> dict[str, Any]:
                data: dict[str, Any] = super().clean()
                name = data.get("name") or (obj.name if obj is not None else None)
                if name and misrouted([name], shown):
                    raise ValidationError(
                        f"Queue {name!r} lives in database {queue_database(name)!r}, not {shown!r}: "
                        "switch the list to that database (?db=) to pause or resume it."
                    )
                return data

        return RoutedForm

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except TaskError as exc:
            # A pause that could not get its lock in time (a long transaction read the switches): the
            # request's transactions are rolled back (no switch, no "added" log entry); say why.
            self.message_user(request, str(exc), messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

    def save_model(self, request: HttpRequest, obj: QueueControl, form: Any, change: bool) -> None:
        by = f"{request.user} (admin)"
        controls = QueueControl.objects.db_manager(switch_database(obj.name, selected_database()))
        if obj.paused:
            controls.pause(obj.name, by=by, reason=obj.reason)
        else:
            controls.resume(obj.name, by=by)

    @admin.action(permissions=["change"], description="Pause the selected queues")
    def pause(self, request: HttpRequest, queryset: QuerySet[QueueControl]) -> None:
        names = list(queryset.values_list("name", flat=True))
        paused = 0
        for name in names:  # in the queue's own database, whose claims read it
            try:
                controls = QueueControl.objects.db_manager(switch_database(name, selected_database()))
                controls.pause(name, by=f"{request.user} (admin)")
            except TaskError as exc:  # its lock did not come in time: this one is left as it was
                self.message_user(request, str(exc), messages.ERROR)
                continue
            paused += 1
        if paused:
            self.message_user(request, f"Paused {paused} queue(s).", messages.SUCCESS)

    @admin.action(permissions=["change"], description="Resume the selected queues")
    def resume(self, request: HttpRequest, queryset: QuerySet[QueueControl]) -> None:
        names = list(queryset.values_list("name", flat=True))
        for name in names:
            QueueControl.objects.db_manager(switch_database(name, selected_database())).resume(
                name, by=f"{request.user} (admin)"
            )
        self.message_user(request, f"Resumed {len(names)} queue(s).", messages.SUCCESS)
