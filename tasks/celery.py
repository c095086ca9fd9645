"""Celery beat entry: run the task queue's recovery from a periodic Celery task.

    CELERY_BEAT_SCHEDULE = {"recover-expired-tasks": {"task": "tasks.recover_expired", "schedule": 5.0}}

An alternative to the recovery loop inside workers (``run_worker --no-recovery``) or
``manage.py recover_tasks``. Each round's statements are safe to run concurrently (SKIP LOCKED),
so an overlapping beat (two beat schedulers by mistake) does no harm.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from tasks.recovery import recover_once


@shared_task(name="tasks.recover_expired", ignore_result=True)
def recover_expired() -> dict[str, Any]:
    report = recover_once()
    return {
        "requeued": len(report.requeued),
        "failed": len(report.failed),
        "orphans_expired": len(report.orphans_expired),
        "stray_leases_released": len(report.stray_leases_released),
    }
