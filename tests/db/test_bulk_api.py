"""The bulk routes of the JSON API: request (202 and the URL to poll), read, list, cancel; a refused
request (400, 403, 404, 409) writes nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from tasks.maintenance.bulk import BulkRunner
from tasks.models import BulkOperation, Task
from tests.helpers.api import TOKEN, Api
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("api_token_and_reader")]


def call(method: str, url: str, body: Any = None, *, raw: str | None = None, token: str = TOKEN) -> tuple[int, Any]:
    return Api(Client(), headers={"Authorization": f"Bearer {token}"}).call(method, url, body, raw=raw)


def failed(count: int, queue: str = "default") -> list[int]:
    ids = Task.objects.bulk_enqueue(NOOP, ({"i": i} for i in range(count)), queue=queue)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET status = 'FAILED', finished_at = clock_timestamp() WHERE id = ANY(%s)", [ids]
        )
    return ids


def test_a_request_is_accepted_then_polled_to_its_result() -> None:
    ids = failed(12)
    failed(3, queue="other")
    status, body = call("POST", "/api/tasks/bulk", {"kind": "retry", "filter": {"queue": "default"}})
    assert status == 202, body
    operation = body["operation"]
    assert operation["status"] == "PENDING" and operation["requested_by"] == "token"
    assert operation["filter"] == {"queue": "default", "status": ["CANCELLED", "FAILED"]}
    assert body["poll"] == f"/api/tasks/bulk/{operation['id']}" == operation["url"]
    assert Task.objects.filter(pk__in=ids, status="FAILED").count() == 12  # the request changed no task
    BulkRunner(batch_size=5).run_until_idle()
    status, body = call("GET", f"/api/tasks/bulk/{operation['id']}", token="reader")
    assert status == 200
    assert {k: body["operation"][k] for k in ("status", "matched", "changed", "skipped", "progress")} == {
        "status": "DONE",
        "matched": 12,
        "changed": 12,
        "skipped": 0,
        "progress": 1.0,
    }
    status, body = call("GET", "/api/tasks/bulk?limit=1")
    assert status == 200 and [o["id"] for o in body["operations"]] == [operation["id"]]


def test_cancel_stops_an_open_operation_and_conflicts_after() -> None:
    failed(4)
    status, body = call("POST", "/api/tasks/bulk", {"kind": "retry"})
    url = body["poll"]
    status, body = call("POST", f"{url}/cancel")
    assert status == 200 and body["operation"]["status"] == "CANCELLED"
    assert BulkRunner().run_until_idle() == 0
    status, body = call("POST", f"{url}/cancel")
    assert status == 409 and body["status"] == "CANCELLED"
    assert call("POST", "/api/tasks/bulk/999999/cancel")[0] == 404
    assert call("GET", "/api/tasks/bulk/999999")[0] == 404
    assert call("POST", f"{url}/cancel", {"why": 1})[0] == 400


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"kind": "purge"}, "kind"),
        ({}, "kind"),
        ({"kind": "retry", "filter": {"status": "RUNNING"}}, "filter.status"),
        ({"kind": "cancel", "filter": {"status": ["FAILED"]}}, "filter.status"),
        ({"kind": "retry", "filter": {"queue": 7}}, "filter.queue"),
        ({"kind": "retry", "filter": {"finished_after": "2026-13-01T00:00:00+00:00"}}, "filter.finished_after"),
        ({"kind": "retry", "filter": {"kwargs_contains": {"x": float("nan")}}}, None),
        ({"kind": "retry", "filter": {"colour": "red"}}, "filter"),
        ({"kind": "retry", "filter": [1]}, "filter"),
        ({"kind": "retry", "extra": 1}, None),
    ],
)
def test_a_refused_request_writes_nothing(body: dict[str, Any], field: str | None) -> None:
    failed(2)
    raw = json.dumps(body) if "nan" not in str(body) else '{"kind": "retry", "filter": {"kwargs_contains": {"x": NaN}}}'
    status, answer = call("POST", "/api/tasks/bulk", raw=raw)
    assert status == 400, answer
    if field is not None:
        assert answer["field"] == field
    assert not BulkOperation.objects.exists()


def test_a_reader_cannot_request_one() -> None:
    assert call("POST", "/api/tasks/bulk", {"kind": "retry"}, token="reader")[0] == 403
    assert not BulkOperation.objects.exists()
