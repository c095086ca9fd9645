"""Celery tasks for the tests (found by autodiscovery: tests.testapp is installed in tests.settings)."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task

from leasing.celery import LeasedTask
from leasing.fencing import fenced_update


class RecordingLeasedTask(LeasedTask):
    abstract = True

    def on_lease_held(self, resource: str, holder: str | None, action: str) -> None:
        from tests.testapp.models import Effect

        super().on_lease_held(resource, holder, action)
        phase = "held:done" if action.startswith("already done") else f"held:{action.split()[0]}"
        Effect.objects.create(task_id=0, token=0, attempt=self.request.retries, phase=phase[:20], pid=os.getpid())


def _effect(task: Any, phase: str) -> None:
    from tests.testapp.models import Effect

    Effect.objects.create(
        task_id=0, token=task.request.lease_token, attempt=task.request.retries, phase=phase, pid=os.getpid()
    )


@shared_task(
    base=RecordingLeasedTask, bind=True, acks_late=True, lease_key="job", lease_ttl=2.0, lease_retry_countdown=1.0
)
def long_job(self: Any, job: str, seconds: float, record_key: str | None = None, check: bool = True) -> str:
    from tests.testapp.models import FencedRecord

    _effect(self, "started")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check:
            self.request.lease.check()
        time.sleep(0.05)
    if record_key:
        fenced_update(FencedRecord.objects.filter(key=record_key), self.request.lease_token, value=f"pid {os.getpid()}")
    _effect(self, "finished")
    return job


@shared_task(base=RecordingLeasedTask, bind=True, acks_late=True, lease_key="job", lease_ttl=2.0, lease_on_held="skip")
def skipping_job(self: Any, job: str, seconds: float) -> str:
    _effect(self, "started")
    time.sleep(seconds)
    _effect(self, "finished")
    return job
