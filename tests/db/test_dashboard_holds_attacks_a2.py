"""Attacks on the holds breakdown (tasks/web/holds.py): a part that stopped at its cap with nothing
counted still makes "scheduled" unknown, and hostile queue and rate key names render escaped."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from django.utils.html import escape

from tasks.models import QueueControl, Task
from tasks.web import holds
from tests.db.test_dashboard_holds import hold_rows
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db


def test_a_rate_line_capped_by_its_blocked_rows_leaves_scheduled_not_counted() -> None:
    """A rate key's line reads its Blocked rows too (in run_after order): cap + 1 of them due first
    fill its window, so its Ready rows waiting in the line behind them are not seen (0 held). The
    window stopped at its cap: "scheduled" is not known. Before, the line was left out for its 0 and
    its Ready rows were counted "scheduled" (the row itself says "held by rate key k")."""
    cap = 3
    ids = list(
        Task.objects.bulk_enqueue(
            NOOP,
            [{}] * (cap + 2),
            queue="kq",
            rate_key="k",
            rate_limit=(1, 3600),
            concurrency_key="ck",
            concurrency_limit=1,
        )
    )
    blocked, held = ids[:-1], ids[-1]
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET status = 'BLOCKED', run_after = now() + interval '1 hour' WHERE id = ANY(%s)",
            [blocked],
        )
        cursor.execute(
            "UPDATE tasks_task SET status = 'READY', rate_refusals = 1, run_after = now() + interval '2 hours'"
            " WHERE id = %s",
            [held],
        )
    found = holds.waiting_holds(cap=cap)
    assert found.ready.value == 1 and not found.ready.capped
    shown = {hold.reason: (hold.count.value, hold.count.capped) for hold in found.holds}
    assert shown.get("scheduled") != (1, False), found.holds  # it is the rate key's, not scheduled
    assert shown.get("scheduled", (0, True))[1], found.holds


HOSTILE = ["q'\"<b>x</b>", "50%_off\\", "ä-ü-€-日本", "<script>alert(1)</script>", "a" * 100]


def test_hostile_queue_and_rate_key_names_render_escaped(staff: Client) -> None:
    for name in HOSTILE:
        Task.objects.enqueue(NOOP, queue=name[:100])
        Task.objects.enqueue(NOOP, queue="rq", rate_key=name, rate_limit=(1, 3600))
    QueueControl.objects.pause(HOSTILE[0], by="test")
    QueueControl.objects.pause(HOSTILE[3], by="test")
    for url in ("/dashboard/", "/dashboard/tasks/pending/", "/dashboard/queues/"):
        response = staff.get(url)
        assert response.status_code == 200, url
        body = response.content.decode()
        assert "<script>alert(1)</script>" not in body and "<b>x</b>" not in body, url
    rows = hold_rows(staff.get("/dashboard/").content.decode())
    paused = " ".join(rows["paused"])
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in paused and "q&#x27;&quot;&lt;b&gt;x&lt;/b&gt;" in paused, rows
    queues = staff.get("/dashboard/queues/").content.decode()
    for name in HOSTILE:
        assert escape(name) in queues, name
