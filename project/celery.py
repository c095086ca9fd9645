"""The demo project's Celery app: ``celery -A project worker``.

Configured from Django settings with the CELERY_ prefix, the convention users already have.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # <app>.tasks modules of the installed apps
app.autodiscover_tasks(related_name="celery")  # tasks.celery: recover_expired for beat
