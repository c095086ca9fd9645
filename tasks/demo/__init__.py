"""The demo handler for generated tasks, with the seed's failure injection.

``sleep(sleep_duration_seconds)`` sleeps in steps, checkpointing after each, so a retried task
resumes where the last attempt stopped. Two injected faults, as the seed describes them:

- ``LEASING_TASKS["DEMO_CRASH_RATE"]`` (about 5 % in the demo): the handler kills its own worker
  process outright (SIGKILL), like an unexpected crash. Every attempt that process was running is
  recovered after the lease TTL (charged as crashes: they may have run); claims it had not handed
  to an executor go back uncharged.
- ``DEMO_STALL_RATE`` (about 10 %): a latency spike in *this task only*. The attempt stops being
  heartbeated and blocks for 1.5 x TTL, so its lease expires and another worker takes the task over;
  when it wakes, its check and its late result are refused. The rest of the process carries on.

Why a per-task stall and not a frozen process (SIGSTOP): the seed's worker heartbeats each task on
its own, so a latency spike makes *that* task miss its heartbeats. Freezing the whole process instead
made every task beside it lose its lease too (charged for a crash that was not theirs), and stalls
drawn by several tasks of one process at once chained into freezes of minutes.

The package is also a Django app, ``"tasks.demo"``: the demo project (project/settings.py) installs
it, and the dashboard shows the generator (its menu item, page and overview card) only where it is
installed (:func:`installed`). A project that adds only ``"leasing"`` and ``"tasks"`` never sees it.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from typing import Any

from tasks.conf import get_settings

logger = logging.getLogger("tasks.demo")

STEP = 0.25


def installed() -> bool:
    """Whether the project installs the demo app (and so its generator pages)."""
    from django.apps import apps

    return apps.is_installed("tasks.demo")


def sleep(sleep_duration_seconds: float = 1.0, **extra: Any) -> dict[str, Any]:
    # Imported here: this package is also the demo's Django app (tasks/demo/apps.py), which Django
    # imports before the models are ready.
    from tasks.runtime import current_task

    conf = get_settings()
    run = current_task()
    dice = random.random()
    if dice < conf.DEMO_CRASH_RATE:
        logger.error("task %d: injected crash: killing worker process %d", run.id, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
    elif dice < conf.DEMO_CRASH_RATE + conf.DEMO_STALL_RATE:
        pause = conf.TTL * 1.5
        logger.error("task %d: injected stall: this attempt misses its heartbeats for %.1fs", run.id, pause)
        run.miss_heartbeats(pause)
        time.sleep(pause)  # the latency spike: the handler does nothing, as if blocked on a slow call
    resumed_from = float((run.progress or {}).get("slept", 0.0))
    slept = resumed_from
    while slept < sleep_duration_seconds:
        run.check()
        step = min(STEP, sleep_duration_seconds - slept)
        time.sleep(step)
        slept += step
        run.checkpoint({"slept": round(slept, 3)})
    return {"slept": sleep_duration_seconds, "resumed_from": resumed_from, "worker_pid": os.getpid()}
