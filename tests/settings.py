"""Test settings: the demo settings on a throwaway embedded PostgreSQL.

When ``DATABASE_URL`` is unset, a server is started once per test session in a temporary
directory (fsync off) and stopped when the session ends. ``DATABASE_URL`` is exported so that
worker processes the tests start reach the same server.
"""

from __future__ import annotations

import atexit
import os
import sys

if "DATABASE_URL" not in os.environ and "mypy" in sys.modules:
    # The mypy Django plugin (django-stubs) imports these settings to read the models and connects to
    # nothing; mypy ends with os._exit, so a server started here would outlive it (atexit never ran).
    os.environ["DATABASE_URL"] = "postgres://unused@localhost/unused"
elif "DATABASE_URL" not in os.environ:
    from leasing.embedded import discard, temporary_server

    _server = temporary_server()
    _owner = os.getpid()
    os.environ["DATABASE_URL"] = _server.url()

    def _stop_server() -> None:
        if os.getpid() == _owner:
            discard(_server)

    atexit.register(_stop_server)

from project.settings import *  # noqa: F403

DATABASES["default"]["CONN_MAX_AGE"] = 0  # noqa: F405
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # noqa: F405
# Processes started by a test of a project of your own get no demo app (tests/db/test_demo_app.py).
if os.environ.get("LEASING_TEST_WITHOUT_DEMO"):
    INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "tasks.demo"]

# A second database on the same server, for the several-databases tests. pytest-django creates
# (and migrates) its test database only when a collected test asks for it with
# ``django_db(databases=[..., "second"])``; no other test touches it. Processes those tests start
# get its test database's name through the environment (tests/helpers: child_env).
DATABASES["second"] = {  # noqa: F405
    **DATABASES["default"],  # noqa: F405
    "NAME": os.environ.get("LEASING_TEST_SECOND_DATABASE", "leasing_second"),
}

# Processes started by a test get any other LEASING_TASKS setting through the environment (JSON).
if os.environ.get("LEASING_TEST_TASKS"):
    import json

    LEASING_TASKS = {**LEASING_TASKS, **json.loads(os.environ["LEASING_TEST_TASKS"])}  # noqa: F405
# Processes started by the scheduler tests get their schedules through the environment.
if os.environ.get("LEASING_TEST_SCHEDULES"):
    import json

    LEASING_TASKS = {**LEASING_TASKS, "SCHEDULES": json.loads(os.environ["LEASING_TEST_SCHEDULES"])}
# ... and the task paths a stored schedule may name (tests/concurrency/test_stored_schedule_processes.py).
if os.environ.get("LEASING_TEST_API_TASKS"):
    LEASING_TASKS = {**LEASING_TASKS, "API_TASKS": tuple(os.environ["LEASING_TEST_API_TASKS"].split(","))}
# ... and their queue routes (tests/db/test_several_databases.py).
if os.environ.get("LEASING_TEST_QUEUE_DATABASES"):
    import json

    LEASING_TASKS = {**LEASING_TASKS, "QUEUE_DATABASES": json.loads(os.environ["LEASING_TEST_QUEUE_DATABASES"])}

# ... and their fair queues (tests/concurrency/test_fair_queue_processes.py).
if os.environ.get("LEASING_TEST_FAIR_QUEUES"):
    LEASING_TASKS = {**LEASING_TASKS, "FAIR_QUEUES": os.environ["LEASING_TEST_FAIR_QUEUES"].split(",")}

# Worker processes started by the async executor tests get a short event-loop block limit this way.
if os.environ.get("TASKS_ASYNC_BLOCK_LIMIT"):
    LEASING_TASKS = {**LEASING_TASKS, "ASYNC_BLOCK_LIMIT": float(os.environ["TASKS_ASYNC_BLOCK_LIMIT"])}

# Worker processes started by the structured-log tests get the LOGGING of docs/howto/production.md.
if os.environ.get("LEASING_TEST_LOGGING"):
    import json

    LOGGING = json.loads(os.environ["LEASING_TEST_LOGGING"])

# ... or none: a `django-admin startproject` project has no LOGGING, Django's DEFAULT_LOGGING alone
# (tests/concurrency/test_worker_log_lines.py).
if os.environ.get("LEASING_TEST_NO_LOGGING"):
    LOGGING = {}

# ... and the bulk tests a small batch (tests/concurrency/test_bulk_processes.py).
if os.environ.get("LEASING_TEST_BULK_BATCH_SIZE"):
    LEASING_TASKS = {**LEASING_TASKS, "BULK_BATCH_SIZE": int(os.environ["LEASING_TEST_BULK_BATCH_SIZE"])}
