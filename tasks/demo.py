"""The demo handler for generated tasks, with the seed's failure injection.

``sleep(sleep_duration_seconds)`` sleeps in steps, checkpointing after each, so a retried task
resumes where the last attempt stopped. With ``LEASING_TASKS["DEMO_CRASH_RATE"]`` (about 5 % in
the demo) it kills its own worker process outright, and with ``DEMO_STALL_RATE`` (about 10 %) it
freezes the whole process (SIGSTOP) for longer than the lease TTL, so heartbeats are missed and
another worker takes the task over: the failures the dashboard then shows being recovered.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import time
from typing import Any

from tasks.conf import get_settings
from tasks.runtime import current_task

logger = logging.getLogger("tasks.demo")

STEP = 0.25


def _freeze_process(seconds: float) -> None:
    # A detached helper resumes us; `sh` exits at once so nothing is left to reap.
    subprocess.run(["sh", "-c", f"(sleep {seconds:.2f}; kill -CONT {os.getpid()}) >/dev/null 2>&1 &"], check=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def sleep(sleep_duration_seconds: float = 1.0, **extra: Any) -> dict[str, Any]:
    conf = get_settings()
    run = current_task()
    dice = random.random()
    if dice < conf.DEMO_CRASH_RATE:
        logger.error("task %d: injected crash: killing worker process %d", run.id, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
    elif dice < conf.DEMO_CRASH_RATE + conf.DEMO_STALL_RATE:
        pause = conf.TTL * 1.5
        logger.error("task %d: injected stall: freezing worker process %d for %.1fs", run.id, os.getpid(), pause)
        _freeze_process(pause)
    resumed_from = float((run.progress or {}).get("slept", 0.0))
    slept = resumed_from
    while slept < sleep_duration_seconds:
        run.check()
        step = min(STEP, sleep_duration_seconds - slept)
        time.sleep(step)
        slept += step
        run.checkpoint({"slept": round(slept, 3)})
    return {"slept": sleep_duration_seconds, "resumed_from": resumed_from, "worker_pid": os.getpid()}
