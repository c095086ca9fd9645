from __future__ import annotations

from django.apps import AppConfig


class DemoConfig(AppConfig):
    """The demo (its generator pages on the dashboard); installed by project/settings.py only."""

    name = "tasks.demo"
    label = "tasks_demo"
    verbose_name = "Tasks demo"
