"""The crash soak's handler: one fenced effect per task (see bench/soak.py)."""

from __future__ import annotations

import os
import random
import time

from django.db.models import F

from leasing.exceptions import StaleTokenError
from leasing.fencing import fenced_update
from tasks.runtime import current_task


def effect(key: str) -> str:
    from tests.testapp.models import Effect, FencedRecord

    run = current_task()
    Effect.objects.create(task_id=run.id, token=run.token, attempt=run.attempt, phase="started", pid=os.getpid())
    # Sleep before the write: a worker paused here wakes up to find a newer attempt has written.
    time.sleep(random.uniform(0.001, 0.005))
    try:
        fenced_update(FencedRecord.objects.filter(key=key), run.token, value=run.worker_id, writes=F("writes") + 1)
    except StaleTokenError:
        # A newer attempt already wrote: this one was paused or lost its lease. The fence said no.
        Effect.objects.create(
            task_id=run.id, token=run.token, attempt=run.attempt, phase="stale-rejected", pid=os.getpid()
        )
        raise
    return key
