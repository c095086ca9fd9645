"""What a worker process imports to start: not sentry_sdk unless the project asks for the Sentry
integration (tasks/worker/sentry.py). Every worker, every ``manage.py`` command paid for it (a sixth of
a worker's import time), with Sentry configured or not."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

PROBE = """
import os, sys
os.environ["DJANGO_SETTINGS_MODULE"] = "project.settings"
import django
django.setup()
import tasks.worker.process
print("sentry_sdk" in sys.modules)
from tasks.worker.sentry import LeasingIntegration
from sentry_sdk.integrations import Integration
print(issubclass(LeasingIntegration, Integration), LeasingIntegration.identifier)
"""


def test_a_worker_imports_sentry_only_when_the_integration_is_asked_for() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")
    assert out[:2] == ["False", "True django_leasing"], out
