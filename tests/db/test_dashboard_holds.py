"""The dashboard says what holds a waiting task (issue 56): a Ready count beside "no runnable tasks"
and idle workers read as a stall when a rate key's line held every task. The overview and the Ready
list break the waiting tasks down by reason (tasks/web/holds.py), each row of the list says its own,
a claimed task whose attempt has not begun reads "claimed, starting" (not "0/3"), and the Queues
page lists the declared queues while they are empty."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from tasks.models import QueueControl, RateRefused, Started, Task, TaskStatus, Worker
from tasks.web import holds
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db

W = "holds-worker"


def hold_rows(html: str) -> dict[str, list[str]]:
    """The rows of the "what holds the waiting tasks" table, by reason: each row's text."""
    rows: dict[str, list[str]] = {}
    for reason, body in re.findall(r'<tr data-hold="([a-z]+)">(.*?)</tr>', html, flags=re.S):
        text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body)).strip()
        rows.setdefault(reason, []).append(text)
    return rows


def task_row(html: str, pk: int) -> str:
    match = re.search(rf'<tr data-task="{pk}">(.*?)</tr>', html, flags=re.S)
    assert match, f"task {pk} is not listed"
    return re.sub(r"\s+", " ", match.group(1))


def rate_backlog(n: int) -> tuple[list[int], int]:
    """``n`` tasks of rate key "mail" (one start an hour), claimed and started: one granted, the
    others refused, waiting in the key's line. (The refused ids, the granted one.)"""
    Task.objects.bulk_enqueue(NOOP, [{}] * n, queue="mailq", rate_key="mail", rate_limit=(1, 3600))
    claimed = Task.objects.claim(W, limit=n, ttl=30, queues=["mailq"])
    results = [Task.objects.rate_start(c.id, W, c.token) for c in claimed]
    granted = [r.id for r in results if isinstance(r, Started)]
    refused = [r.id for r in results if isinstance(r, RateRefused)]
    assert len(granted) == 1 and len(refused) == n - 1
    return refused, granted[0]


def test_a_rate_limited_backlog_says_its_key_on_the_overview_and_the_ready_list(staff: Client) -> None:
    refused, _ = rate_backlog(6)
    # A worker alive and idle, as in the issue: nothing runnable, five Ready.
    Worker.objects.create(id="w-idle", hostname="h", pid=1, concurrency=4, running=0, queues=["mailq"])
    overview = staff.get("/dashboard/").content.decode()
    rows = hold_rows(overview)
    assert list(rows) == ["rate"], rows
    assert "rate key mail" in rows["rate"][0] and "5 Ready" in rows["rate"][0]
    assert "next free start" in rows["rate"][0]
    assert "Of 5 Ready: 0 runnable now" in overview
    ready = staff.get("/dashboard/tasks/pending/").content.decode()
    assert hold_rows(ready) == rows
    for pk in refused:
        assert "held by rate key mail" in task_row(ready, pk)


def test_a_paused_queues_waiting_tasks_say_paused(staff: Client) -> None:
    ids = [Task.objects.enqueue(NOOP, queue="frozen").id for _ in range(2)]
    runnable = Task.objects.enqueue(NOOP, queue="thawed").id
    QueueControl.objects.pause("frozen", by="test")
    rows = hold_rows(staff.get("/dashboard/").content.decode())
    assert list(rows) == ["paused"] and "queue frozen paused" in rows["paused"][0] and "2 Ready" in rows["paused"][0]
    ready = staff.get("/dashboard/tasks/pending/").content.decode()
    assert "Of 3 Ready: 1 runnable now" in ready
    for pk in ids:
        assert "its queue is paused" in task_row(ready, pk)
    assert "held" not in task_row(ready, runnable)


def test_a_deferred_task_says_scheduled(staff: Client) -> None:
    later = timezone.now() + dt.timedelta(hours=1)
    pk = Task.objects.enqueue(NOOP, queue="q", run_after=later).id
    Task.objects.enqueue(NOOP, queue="q")
    rows = hold_rows(staff.get("/dashboard/").content.decode())
    assert list(rows) == ["scheduled"] and "1 Ready" in rows["scheduled"][0]
    assert "scheduled: due " in task_row(staff.get("/dashboard/tasks/pending/").content.decode(), pk)


def test_a_dependant_says_it_waits_on_its_parent(staff: Client) -> None:
    parent = Task.objects.enqueue(NOOP, queue="q").id
    child = Task.objects.enqueue(NOOP, queue="q", depends_on=[parent]).id
    assert Task.objects.get(pk=child).status == TaskStatus.AWAITING
    rows = hold_rows(staff.get("/dashboard/").content.decode())
    assert list(rows) == ["dependency"] and "1 Awaiting" in rows["dependency"][0]
    row = task_row(staff.get("/dashboard/tasks/awaiting/").content.decode(), child)
    assert "waiting on 1 task it depends on" in row


def test_a_claimed_task_whose_attempt_has_not_begun_does_not_read_zero_attempts(staff: Client) -> None:
    pk = Task.objects.enqueue(NOOP, queue="q", max_attempts=3).id
    (claimed,) = Task.objects.claim(W, limit=1, ttl=30, queues=["q"])
    assert claimed.id == pk and not Task.objects.get(pk=pk).attempt_started
    Worker.objects.create(id=W, hostname="h", pid=1, concurrency=1, running=1, queues=["q"])
    for url in ("/dashboard/tasks/running/", "/dashboard/tasks/", f"/dashboard/workers/{W}/"):
        row = task_row(staff.get(url).content.decode(), pk)
        assert "claimed, starting" in row and "0/3" not in row, url
    detail = staff.get(f"/dashboard/tasks/{pk}/").content.decode()
    assert "claimed, starting" in detail and "0 of 3" not in detail
    # Once its attempt begins, it counts it.
    Task.objects.filter(pk=pk).update(attempt_started=True, attempts=1)
    assert "1/3" in task_row(staff.get("/dashboard/tasks/running/").content.decode(), pk)


def test_a_declared_but_empty_fair_queue_is_on_the_queues_page(staff: Client, settings: Any) -> None:
    settings.LEASING_TASKS = {
        "FAIR_QUEUES": ["fair-demo"],
        "SCHEDULES": {"nightly": {"task": NOOP, "interval": 3600, "queue": "nightly-q"}},
    }
    Worker.objects.create(id="w-serving", hostname="h", pid=1, concurrency=1, running=0, queues=["served-q"])
    Worker.objects.create(
        id="w-gone", hostname="h", pid=2, concurrency=1, running=0, queues=["gone-q"], stopped_at=timezone.now()
    )
    html = staff.get("/dashboard/queues/").content.decode()
    rows = {
        name: re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body))
        for body in re.findall(r"<tr>(.*?)</tr>", html, flags=re.S)
        for name in re.findall(r'<td class="mono"><a [^>]*>([^<]+)</a>', body)
    }
    assert {"fair-demo", "nightly-q", "served-q"} <= set(rows) and "gone-q" not in rows
    assert "fair: 0 keys" in rows["fair-demo"] and " 0 " in rows["fair-demo"]


def test_the_breakdown_adds_up_to_the_ready_count() -> None:
    rate_backlog(4)
    Task.objects.enqueue(NOOP, queue="frozen")
    QueueControl.objects.pause("frozen", by="test")
    Task.objects.enqueue(NOOP, queue="q", run_after=timezone.now() + dt.timedelta(hours=1))
    Task.objects.enqueue(NOOP, queue="q")
    found = holds.waiting_holds()
    by_reason = {(hold.reason, hold.name): hold.count.value for hold in found.holds}
    assert by_reason == {("paused", "frozen"): 1, ("rate", "mail"): 3, ("scheduled", ""): 1}
    assert found.runnable.value == 1 and found.ready.value == 6 and not found.cut_short


def test_the_breakdown_reads_at_most_its_cap_per_part() -> None:
    """Every part of the breakdown is an ordered index scan that stops at its cap: a backlog of each
    reason thirty times the cap is read no further (EXPLAIN ANALYZE: no node reads more than cap + 1
    rows per loop, no sequential scan), and the counts say they stopped."""
    from django.db import connection

    from tests.helpers.plans import add_rows, explained, rows_read, seq_scans_of_tasks

    cap, n = 100, 3000
    later = "now() + interval '1 hour'"
    for queue in ("mailq", "q", "frozen", "later", "snoozing", "failing"):
        add_rows(queue, "READY", n)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET rate_key = 'mail', rate_limit = 1, rate_period = 3600, rate_refusals = 1,"
            f" run_after = {later} WHERE queue = 'mailq'"
        )
        cursor.execute(f"UPDATE tasks_task SET run_after = {later} WHERE queue = 'later'")
        cursor.execute(f"UPDATE tasks_task SET snoozed_at = now(), run_after = {later} WHERE queue = 'snoozing'")
        cursor.execute(f"UPDATE tasks_task SET failures = 1, run_after = {later} WHERE queue = 'failing'")
        cursor.execute("ANALYZE tasks_task")
    QueueControl.objects.pause("frozen", by="test")
    params = {
        "paused": ["frozen"],
        "rated": [],
        "prefix": "queue:",
        "cap": cap,
        "queues": 100,
        "keys": holds.SHOWN_KEYS,
    }
    plan = explained(holds.HOLDS_SQL, params)
    assert not seq_scans_of_tasks(plan)
    assert [(node, read) for node, read in rows_read(plan) if read > cap + 1] == []
    found = holds.waiting_holds(cap=cap)
    assert found.ready.capped and found.runnable.capped
    assert {hold.reason: hold.count.capped for hold in found.holds} == {
        "paused": True,
        "rate": True,
        "snoozed": True,
        "backoff": True,
        "scheduled": True,  # not known: the parts stopped at their caps
    }


def test_more_rate_keys_than_are_looked_at_leave_scheduled_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holds, "SHOWN_KEYS", 1)
    for key in ("a-key", "b-key"):
        Task.objects.bulk_enqueue(NOOP, [{}] * 3, queue="mailq", rate_key=key, rate_limit=(1, 3600))
    claimed = Task.objects.claim(W, limit=6, ttl=30, queues=["mailq"])
    for c in claimed:
        Task.objects.rate_start(c.id, W, c.token)
    found = holds.waiting_holds()
    assert found.cut_short
    assert [(hold.reason, hold.name, str(hold.count)) for hold in found.holds] == [
        ("rate", "a-key", "2"),
        ("scheduled", "", "0+"),
    ]
