"""A finish time of ``infinity`` or ``-infinity`` (a hand edit, a restored dump: PostgreSQL takes them,
Python's datetime has no such value) renders on the every-task page, the admin's changelist and the
API's list (issue 56): as no date, not a 500 or a 400. ``tasks_finished`` cannot hold one: its day
partitions are bounded and there is no default partition."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.test import Client

from tasks.maintenance.partitions import create_ahead
from tasks.models import Task
from tests.db.test_finished_partitions import drop_partitions
from tests.helpers.api import TOKEN, Api
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db


def finished_at(value: str, status: str = "SUCCESSFUL") -> int:
    task_id = Task.objects.enqueue(NOOP).id
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET status = %s, finished_at = %s::timestamptz WHERE id = %s", [status, value, task_id]
        )
    return task_id


@pytest.fixture
def endless() -> list[int]:
    return [finished_at("infinity"), finished_at("-infinity", "FAILED"), finished_at("2020-01-01 12:00+00")]


def test_the_every_task_page_lists_them(staff: Client, endless: list[int]) -> None:
    for url in ("/dashboard/tasks/", "/dashboard/tasks/succeeded/", "/dashboard/tasks/failed/"):
        response = staff.get(url)
        assert response.status_code == 200, url
    body = staff.get("/dashboard/tasks/").content.decode()
    for task_id in endless:
        assert f"/dashboard/tasks/{task_id}/" in body


def test_the_admin_changelist_lists_them(staff: Client, endless: list[int]) -> None:
    for query in ("", "?status__exact=SUCCESSFUL", "?status__exact=FAILED"):
        response = staff.get(f"/admin/tasks/task/{query}")
        assert response.status_code == 200, query
    body = staff.get("/admin/tasks/task/").content.decode()
    for task_id in endless:
        assert f"/admin/tasks/task/{task_id}/change/" in body


def test_the_api_lists_them(client: Client, settings: Any, endless: list[int]) -> None:
    settings.LEASING_API_TOKENS = [TOKEN]
    api = Api(client)
    status, body = api.call("GET", "/api/tasks")
    assert status == 200, body
    listed = {row["id"]: row for row in body["tasks"]}
    assert set(endless) <= set(listed)
    assert listed[endless[0]]["finished_at"] is None and listed[endless[1]]["finished_at"] is None
    assert listed[endless[2]]["finished_at"].startswith("2020-01-01")
    for url in ("/api/tasks?status=SUCCESSFUL", "/api/tasks?status=FAILED", "/api/tasks/processed"):
        status, body = api.call("GET", url)
        assert status == 200, (url, body)


@pytest.mark.django_db(transaction=True)
def test_the_finished_table_cannot_hold_them() -> None:
    drop_partitions()
    try:
        create_ahead(1)
        for value in ("infinity", "-infinity"):
            task_id = finished_at(value)
            with (
                pytest.raises(IntegrityError, match="no partition"),
                transaction.atomic(),
                connection.cursor() as cursor,
            ):
                cursor.execute("INSERT INTO tasks_finished SELECT * FROM tasks_task WHERE id = %s", [task_id])
    finally:
        drop_partitions()


def test_their_own_pages_render(staff: Client, client: Client, settings: Any, endless: list[int]) -> None:
    settings.LEASING_API_TOKENS = [TOKEN]
    for task_id in endless:
        assert staff.get(f"/dashboard/tasks/{task_id}/").status_code == 200
        assert staff.get(f"/admin/tasks/task/{task_id}/change/").status_code == 200
        status, body = Api(client).call("GET", f"/api/tasks/{task_id}")
        assert status == 200, body
