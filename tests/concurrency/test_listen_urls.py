"""LEASING_TASKS["LISTEN_URLS"] with real worker processes.

Found by a bug hunt (breaker) on issue 19: PgBouncer and separate LISTEN connections."""

from __future__ import annotations

import pytest

from tasks.models import Task, TaskStatus
from tests.helpers import start_manage, stop_process, wait_until
from tests.helpers.workers import FAST, Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SECRET = "s3%ZZcret"  # a password with a stray percent sign, not percent-encoded in the URL


def test_an_unparsable_listen_url_stops_the_worker_at_start_and_never_logs_its_password(
    workers: Workers,
) -> None:
    """libpq's parse error quotes the token it cannot decode: the password. The listener used to log it
    once a second ("listener connection failed: invalid percent-encoded token: ..."); a system check
    refuses the setting before the worker starts, without quoting it."""
    log = workers.logs / "unparsable.log"
    proc = start_manage(
        log,
        "run_worker",
        "--worker-id",
        "unparsable",
        *FAST,
        DIRECT_DATABASE_URL=f"postgres://u:{SECRET}@127.0.0.1:1/x",
    )
    try:
        wait_until(
            lambda: proc.poll() is not None or "listener connection failed" in log.read_text(errors="replace"),
            60,
            what="the worker to exit or to try its listener",
        )
    finally:
        stop_process(proc)
    text = log.read_text(errors="replace")
    assert "ZZcret" not in text
    assert "tasks.E106" in text, text[-3000:]
    assert proc.returncode not in (0, None)


def test_an_unreachable_listen_url_falls_back_to_polling(workers: Workers) -> None:
    """A direct URL that refuses connections: the worker says so and still picks up work by polling."""
    proc = workers.start("unreachable", DIRECT_DATABASE_URL="postgres://postgres@127.0.0.1:1/nosuch")
    wait_until(lambda: "listener connection failed" in workers.log("unreachable"), 30, what="the listener to fail")
    ids = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{"n": n} for n in range(20)])
    wait_until(
        lambda: Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL).count() == len(ids),
        30,
        what="tasks picked up by polling",
    )
    assert proc.poll() is None
    assert "Connection refused" in workers.log("unreachable")
