from __future__ import annotations

from django.apps import AppConfig


class TasksConfig(AppConfig):
    name = "tasks"
    verbose_name = "Tasks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from leasing.metrics import DATABASE_COLLECTORS
        from tasks import checks  # noqa: F401  (registers the system checks)
        from tasks.metrics import task_metrics

        if task_metrics not in DATABASE_COLLECTORS:
            DATABASE_COLLECTORS.append(task_metrics)
