from __future__ import annotations

from django.apps import AppConfig


class TasksConfig(AppConfig):
    name = "tasks"
    verbose_name = "Tasks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from leasing.metrics import DATABASE_COLLECTORS
        from leasing.routing import DATABASE_SOURCES
        from tasks import checks  # noqa: F401  (registers the system checks)
        from tasks.backends.placement import routed_databases
        from tasks.lifecycle.routing import queue_routes
        from tasks.web.metrics import task_metrics

        if task_metrics not in DATABASE_COLLECTORS:
            DATABASE_COLLECTORS.append(task_metrics)
        if routed_databases not in DATABASE_SOURCES:
            DATABASE_SOURCES.append(routed_databases)
        queue_routes()  # an unknown alias is an ImproperlyConfigured error at startup, not at the first enqueue
