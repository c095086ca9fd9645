"""Periodic tasks in the dashboard, the JSON API and the admin: last and next runs, links to tasks."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from leasing.models import Lease
from tasks.maintenance.schedule_specs import load_schedules
from tasks.maintenance.scheduler import SCHEDULER_LEASE, SlotWriter, database_now
from tasks.models import Schedule, ScheduleRun, Task
from tests.helpers.api import check_answer
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db

TOKEN = "schedule-token"


@pytest.fixture(autouse=True)
def schedules(settings: Any) -> None:
    settings.LEASING_API_TOKENS = [TOKEN]
    settings.LEASING_TASKS = {
        "SCHEDULES": {
            "reports": {"task": NOOP, "cron": "30 2 * * *", "timezone": "Europe/Paris", "kwargs": {"day": "today"}},
            "tick": {"task": NOOP, "interval": 60, "catch_up": "all", "queue": "cron"},
            "paused": {"task": NOOP, "interval": 5, "enabled": False},
        }
    }


def run_slots(count: int) -> list[int]:
    """The scheduler leads and enqueues ``count`` slots of "tick"; the first task is then pruned."""
    specs = load_schedules()
    grant = Lease.objects.acquire(SCHEDULER_LEASE, "sched-1", 60)
    assert grant is not None
    writer = SlotWriter(holder="sched-1", token=grant.token)
    now = database_now()
    for spec in specs.values():
        writer.sync(spec, now)
    tick = specs["tick"]
    slot = now - dt.timedelta(hours=1)
    ids = []
    for _ in range(count):
        slot = tick.next_slot(slot)
        task_id = writer.enqueue(tick, slot)
        assert task_id is not None
        ids.append(task_id)
    Task.objects.filter(pk=ids[0]).delete()  # pruned since
    return ids


@pytest.mark.parametrize("url", ["/dashboard/schedules/", "/dashboard/schedules/tick/"])
def test_pages_are_staff_only(client: Client, url: str) -> None:
    assert client.get(url).status_code == 302
    client.force_login(get_user_model().objects.create_user("plain", password="pw"))
    assert client.get(url).status_code == 302


def test_the_schedules_page_lists_every_schedule_with_last_and_next_run(staff: Client) -> None:
    ids = run_slots(3)
    Schedule.objects.create(name="retired", baseline_at=database_now(), definition={"task": "old.job"})
    page = staff.get("/dashboard/schedules/").content.decode()
    assert "sched-1" in page  # the scheduler holding the lease
    for name in ("reports", "tick", "paused", "retired"):
        assert f'data-schedule="{name}"' in page
    assert "30 2 * * * (Europe/Paris)" in page and "every 60 s" in page
    assert f'href="/dashboard/tasks/{ids[-1]}/">task {ids[-1]}</a>' in page  # the last run links to its task
    assert "not in settings" in page and "disabled" in page
    assert 'href="/dashboard/schedules/tick/"' in page
    assert 'href="/dashboard/schedules/"' in staff.get("/dashboard/").content.decode()  # in the navigation


def test_the_schedule_page_lists_runs_with_their_tasks(staff: Client) -> None:
    ids = run_slots(3)
    page = staff.get("/dashboard/schedules/tick/").content.decode()
    for task_id in ids:
        assert f'href="/dashboard/tasks/{task_id}/">{task_id}</a>' in page
    assert page.count("pruned") == 1 and page.count("status-READY") == 2
    assert staff.get("/dashboard/schedules/nope/").status_code == 404
    assert staff.get("/dashboard/schedules/tick/?before=yesterday").status_code == 404
    older = staff.get(
        "/dashboard/schedules/tick/", {"before": ScheduleRun.objects.order_by("slot")[1].slot.isoformat()}
    )
    assert older.status_code == 200 and older.content.decode().split('id="runs"')[1].count("/dashboard/tasks/") == 1


def api_get(client: Client, url: str) -> tuple[int, Any]:
    response = client.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
    check_answer(response)
    return response.status_code, json.loads(response.content)


def test_the_api_lists_schedules_and_runs(client: Client) -> None:
    ids = run_slots(3)
    status, body = api_get(client, "/api/schedules")
    assert status == 200 and body["scheduler"]["leader"] == "sched-1" and body["settings_error"] is None
    by_name = {s["name"]: s for s in body["schedules"]}
    assert set(by_name) == {"reports", "tick", "paused"}
    tick = by_name["tick"]
    assert tick["last_run"]["task_id"] == ids[-1] and tick["last_run"]["task_status"] == "READY"
    assert tick["enqueued"] == 3 and tick["definition"]["queue"] == "cron" and tick["next_run"]
    assert by_name["paused"]["enabled"] is False and by_name["paused"]["next_run"] is None
    assert by_name["reports"]["last_run"] is None and by_name["reports"]["definition"]["kwargs"] == {"day": "today"}

    status, body = api_get(client, "/api/schedules/tick?limit=2")
    assert status == 200
    assert [r["task_id"] for r in body["runs"]] == ids[:0:-1]
    assert body["next"]
    status, rest = api_get(client, "/api/schedules/tick" + body["next"])
    assert [r["task_id"] for r in rest["runs"]] == [ids[0]] and rest["runs"][0]["task_status"] is None  # pruned
    assert rest["next"] is None


@pytest.mark.parametrize(
    ("url", "status"),
    [
        ("/api/schedules/nope", 404),
        ("/api/schedules/tick?limit=0", 400),
        ("/api/schedules/tick?limit=x", 400),
        ("/api/schedules/tick?before=soon", 400),
    ],
)
def test_the_api_refuses_bad_requests(client: Client, url: str, status: int) -> None:
    got, body = api_get(client, url)
    assert got == status and body["error"]


def test_the_api_needs_credentials(client: Client) -> None:
    assert client.get("/api/schedules").status_code == 401


def test_an_invalid_setting_still_lists_the_stored_rows(client: Client, settings: Any) -> None:
    run_slots(1)
    settings.LEASING_TASKS = {"SCHEDULES": {"tick": {"task": NOOP, "cron": "not cron"}}}
    status, body = api_get(client, "/api/schedules")
    assert status == 200 and "invalid cron expression" in body["settings_error"]
    assert [s["name"] for s in body["schedules"]] == ["paused", "reports", "tick"]


def test_the_admin_shows_schedules_and_runs_read_only(staff: Client) -> None:
    ids = run_slots(2)
    page = staff.get("/admin/tasks/schedule/").content.decode()
    assert "every 60 s" in page and f"/admin/tasks/task/{ids[-1]}/change/" in page
    runs = staff.get("/admin/tasks/schedulerun/?schedule=tick").content.decode()
    assert f"/admin/tasks/task/{ids[1]}/change/" in runs
    assert staff.get("/admin/tasks/schedule/add/").status_code == 403
    assert staff.get("/admin/tasks/schedulerun/add/").status_code == 403
