"""Settings for bench/steady.py: the demo settings, quiet logs, and ``ARCHIVE_AFTER`` from BENCH_ARCHIVE_AFTER
(unset: the mover off), so its recovery leader process runs with or without the mover."""

import os

from project.settings import *  # noqa: F403

LOGGING = {"version": 1, "disable_existing_loggers": False, "root": {"level": "WARNING"}}
if os.environ.get("BENCH_ARCHIVE_AFTER"):
    LEASING_TASKS = {**LEASING_TASKS, "ARCHIVE_AFTER": os.environ["BENCH_ARCHIVE_AFTER"]}  # noqa: F405
