"""Celery beat entries: run the task queue's recovery (and retention) from periodic Celery tasks.

    CELERY_BEAT_SCHEDULE = {"recover-expired-tasks": {"task": "tasks.recover_expired", "schedule": 5.0},
                            "prune-retained": {"task": "tasks.prune_retained", "schedule": 300.0}}

An alternative to the recovery loop inside workers (``run_worker --no-recovery``) or
``manage.py recover_tasks``. Each round's statements are safe to run concurrently (SKIP LOCKED),
so an overlapping beat (two beat schedulers by mistake) does no harm.
"""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

from tasks.conf import get_settings
from tasks.maintenance.recovery import maintain_once
from tasks.maintenance.retention import AutoPruner


@shared_task(name="tasks.recover_expired", ignore_result=True)
def recover_expired(max_seconds: float = 30.0) -> dict[str, Any]:
    """Every duty of the recovery leader but retention (``tasks.prune_retained``, paced, does that):
    a recovery round with its repairs, then bulk operations' batches and the history hours due, within
    ``max_seconds`` (tasks/maintenance/recovery.py, ``maintain_once``)."""
    done = maintain_once(budget=max_seconds, prune=False)
    report = done.recovery
    return {
        "requeued": len(report.requeued),
        "failed": len(report.failed),
        "orphans_expired": len(report.orphans_expired),
        "stray_leases_released": len(report.stray_leases_released),
        "repaired": len(report.repairs.dependants) + len(report.repairs.workflows),
        "bulk_changed": done.bulk_changed,
        "history_hours": len(done.history.counted) if done.history else 0,
        "keyless_adopted": done.keyless_adopted,
        "archived": done.archived,
        # the duties that failed ("name: error", logged; the others ran)
        "errors": done.errors,
    }


@shared_task(name="tasks.prune_retained", ignore_result=True)
def prune_retained(max_seconds: float = 60.0) -> dict[str, int]:
    """One retention pass (``LEASING_TASKS["RETENTION"]``), what the recovery leader does between
    its rounds: paced at ``RETENTION_BUSY_FRACTION``, and ended after ``max_seconds`` (the next beat
    goes on). Rows deleted per kind."""
    pruner = AutoPruner(interval=0.0)
    busy = get_settings().RETENTION_BUSY_FRACTION
    deadline = time.monotonic() + max_seconds
    while True:
        started = time.monotonic()
        pruner.run_for(0.5)
        if pruner.idle or time.monotonic() >= deadline:
            return pruner.deleted
        time.sleep((time.monotonic() - started) * (1 / busy - 1))
