"""Settings of the conformance worker process: the test settings, plus the recorder of its
django.tasks signals and logs, and fast retries (as the thread mode's override). With
``CONFORMANCE_OTHER_DATABASE``, a second database ("other") and a LeaseBackend on it ("elsewhere")."""

import os
from typing import Any

from tests.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.conformance.apps.ConformanceRecorderConfig"]  # noqa: F405
LEASING_TASKS = {**LEASING_TASKS, "BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05}  # noqa: F405

if os.environ.get("CONFORMANCE_OTHER_DATABASE"):
    DATABASES["other"] = {**DATABASES["default"], "NAME": os.environ["CONFORMANCE_OTHER_DATABASE"]}  # noqa: F405
    ELSEWHERE: dict[str, Any] = {
        "BACKEND": "tasks.backends.LeaseBackend",
        "QUEUES": ["elsewhere"],
        "OPTIONS": {"database": "other"},
    }
    TASKS = {**TASKS, "elsewhere": ELSEWHERE}  # noqa: F405
