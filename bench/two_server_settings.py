"""Settings of bench/two_servers.py: the demo settings plus a second alias on a second server and
one queue routed to it (URLs and routes from the environment, so the workers read the same)."""

from __future__ import annotations

import json
import os

import environ

from project.settings import *  # noqa: F403

DATABASES["second"] = {  # noqa: F405
    **environ.Env.db_url_config(os.environ["LEASING_BENCH_SECOND_URL"]),
    "CONN_MAX_AGE": DATABASES["default"]["CONN_MAX_AGE"],  # noqa: F405
    "CONN_HEALTH_CHECKS": True,
}
LEASING_TASKS = {**LEASING_TASKS, "QUEUE_DATABASES": json.loads(os.environ["LEASING_BENCH_QUEUE_DATABASES"])}  # noqa: F405
