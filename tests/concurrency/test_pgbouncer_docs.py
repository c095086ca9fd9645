"""docs/howto/pgbouncer.md's pgbouncer.ini, as written, loaded by a real PgBouncer (it refused the
earlier version's inline comments), and a worker draining tasks through it with the settings the
page gives (POOLED_DATABASES, a direct URL for LISTEN)."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from tasks.lifecycle.states import TaskStatus
from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.pgbouncer import pgbouncer
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "howto" / "pgbouncer.md"


def documented_ini() -> str:
    (block,) = re.findall(r"```ini\n(.*?)```", PAGE.read_text(), re.S)
    return block


def test_the_documented_ini_has_no_comment_after_a_value() -> None:
    for line in documented_ini().splitlines():
        if "=" in line and not line.lstrip().startswith((";", "#")):
            assert ";" not in line and "#" not in line, f"PgBouncer would read the comment as the value: {line!r}"


def test_pgbouncer_runs_the_documented_ini_and_a_worker_drains_through_it(workers: Workers) -> None:
    settings = documented_ini().split("[pgbouncer]", 1)[1]  # the section's lines, comments included
    with pgbouncer(connection.settings_dict, settings=settings) as bouncer:
        log = bouncer.log.read_text(errors="replace")
        assert "invalid value" not in log and "syntax error" not in log.lower(), log
        ids = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 200)
        workers.start(
            "docs-pgbouncer",
            "--concurrency",
            "4",
            DATABASE_URL=bouncer.url(connection.settings_dict["NAME"]),
            DATABASE_POOLED="true",
        )
        wait_until(
            lambda: Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL).count() == len(ids),
            60,
            what="the worker to drain through the documented PgBouncer",
        )
        # PgBouncer's own console: the documented values are the ones it runs with.
        with psycopg.connect(bouncer.conninfo("pgbouncer"), autocommit=True) as console:
            config = {row[0]: row[1] for row in console.execute("SHOW CONFIG")}
        expected = dict(re.findall(r"^(\w+) = (\S+)$", settings, re.M))
        assert {key: config[key] for key in expected} == expected
