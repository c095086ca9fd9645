"""System checks of the task queue's settings: a bad schedule or retention age fails
``manage.py check`` (and every command) with the reason, not the scheduler thread at run time."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, register
from django.core.exceptions import ImproperlyConfigured


@register()
def check_task_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from tasks.retention import retention_policy
    from tasks.schedules import load_schedules

    errors: list[CheckMessage] = []
    try:
        load_schedules()
    except ImproperlyConfigured as exc:
        errors.append(Error(str(exc), hint="See README, 'Periodic tasks'.", id="tasks.E101"))
    try:
        retention_policy()
    except ValueError as exc:
        errors.append(Error(str(exc), hint="See README, 'Retention'.", id="tasks.E102"))
    return errors
