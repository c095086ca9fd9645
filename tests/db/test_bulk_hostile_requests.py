"""Bulk operations and the argument search: hostile requests.

- A bulk request whose filter PostgreSQL cannot read must be refused with a 400 and store nothing
  (invariant 12, "a rejected request changes nothing"): Python's ``datetime.fromisoformat`` accepts
  time-zone offsets PostgreSQL refuses (beyond +-15:59, or with fractions of a second), so such a
  request is accepted (202), stored, and only fails later on the recovery leader.
- An argument search must read the index entries of its term, not the whole index: a
  ``jsonb_path_ops`` GIN index has no entry for an empty object or array, so a term made only of
  empty containers is a full index scan and a recheck of every row of the table (invariant 12).
- Hostile bodies (deep nesting, huge numbers) on the bulk API: 400 and nothing stored.


Found by breaker 32 (the bug hunt on issue 25's operations: bulk operations, history, tracing, test helpers)."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client

from leasing.validation import InvalidInput
from tasks.maintenance.bulk import BulkRunner
from tasks.models import BulkOperation, Task
from tasks.web.queries import search_lookups
from tests.helpers.api import TOKEN, check_answer
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("api_token")]


def post(body: Any = None, *, raw: str | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body)
    response = Client().generic(
        "POST",
        "/api/tasks/bulk",
        data,
        content_type="application/json",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    check_answer(response)
    return response.status_code, json.loads(response.content) if response.content else None


def failed(count: int) -> list[int]:
    ids = Task.objects.bulk_enqueue(NOOP, ({"i": i} for i in range(count)))
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET status = 'FAILED', finished_at = clock_timestamp() WHERE id = ANY(%s)", [ids]
        )
    return ids


@pytest.mark.parametrize(
    "when",
    [
        "2026-01-01T00:00:00+23:59",  # PostgreSQL: "time zone displacement out of range"
        "2026-01-01T00:00:00-20:00",
        "2026-01-01T00:00:00+05:30:15.123456",  # an offset with microseconds: invalid input syntax
    ],
)
@pytest.mark.parametrize("field", ["enqueued_after", "finished_before"])
def test_a_filter_time_postgresql_cannot_read_is_refused_and_stores_nothing(field: str, when: str) -> None:
    ids = failed(5)
    status, body = post({"kind": "retry", "filter": {field: when}})
    stored = list(BulkOperation.objects.values_list("status", "error"))
    # What happened: 202, an operation stored PENDING, which the leader then failed (DataError: an
    # offset PostgreSQL cannot read). Now the instant is stored in UTC, which it reads: either a
    # refusal that stores nothing or an operation the leader completes, never one it cannot read.
    BulkRunner().run_until_idle()
    after = list(BulkOperation.objects.values_list("status", "error"))
    if status == 400:
        assert stored == [] and after == []
        assert Task.objects.filter(pk__in=ids, status="FAILED").count() == 5
    else:
        assert status == 202 and after == [("DONE", "")], f"{status} {body}; after a leader round {after}"
        assert body["operation"]["filter"][field].endswith("+00:00")


@pytest.mark.parametrize(
    "raw",
    [
        '{"kind": "retry", "filter": {"args_contains": ' + "[" * 3000 + "]" * 3000 + "}}",
        '{"kind": "retry", "filter": {"kwargs_contains": {"a": ' + "[" * 900 + "1" + "]" * 900 + "}}}",
        '{"kind": "retry", "filter": {"workflow_id": 1e400}}',
        '{"kind": "retry", "filter": {"workflow_id": 9223372036854775808}}',
        '{"kind": "retry", "filter": {"args_contains": [1e400]}}',
        '{"kind": "retry", "filter": {"args_contains": [NaN]}}',
        '{"kind": "retry", "filter": {"args_contains": ["\\ud800"]}}',
        '{"kind": "retry", "filter": {"kwargs_contains": {"\\u0000": 1}}}',
        '{"kind": "retry", "filter": {"queue": "q\\u0000"}}',
        '{"kind": "retry", "filter": {"status": ["FAILED", "RUNNING"]}}',
        '{"kind": "cancel", "filter": {"status": "RUNNING"}}',
        '{"kind": "retry", "filter": {"enqueued_after": "2026-01-01T00:00:00"}}',
        '{"kind": "retry", "filter": {"enqueued_after": 1700000000}}',
        '{"kind": "retry", "filter": []}',
        '{"kind": ["retry"], "filter": {}}',
        '{"kind": "retry", "filter": {"status": []}}',
    ],
)
def test_hostile_bulk_bodies_are_refused_with_400_and_store_nothing(raw: str) -> None:
    failed(3)
    status, body = post(raw=raw)
    assert status == 400, (status, body)
    assert isinstance(body, dict)
    assert not BulkOperation.objects.exists()
    assert Task.objects.filter(status="FAILED").count() == 3


ROWS = 20_000
FILL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, finished_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, errors_dropped)
SELECT 'default', 0, 'app.jobs.x', jsonb_build_array(g %% 500), jsonb_build_object('customer', g %% 1000, 'n', g),
       'FAILED', now(), now(), now(), 1, 1, '[]', '[]', 0, 0, 1, 0, 0, 0, false, false, 0
FROM generate_series(1, %s) AS g
"""


def index(action: str) -> str:
    out = StringIO()
    call_command("tasks_search_index", action, stdout=out)
    return out.getvalue()


@pytest.mark.parametrize("term", ['kwargs:{"customer": {}}', 'kwargs:{"n": []}', "args:[[]]", "args:[{}]"])
def test_an_argument_search_of_empty_containers_does_not_read_the_whole_table(term: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(FILL, [ROWS])
        cursor.execute("VACUUM ANALYZE tasks_task")
    try:
        index("create")

        # What happened: the GIN index yielded every row (no entry for an empty container), each
        # rechecked on the heap: ~ROWS rows read to find nothing. Such a term is now refused.
        with pytest.raises(InvalidInput, match="holding a value"):
            search_lookups(term)
        assert search_lookups(term.replace("{}", '{"x": null}').replace("[]", "[null]"))
    finally:
        index("drop")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("workflow_id", "\u00b2"),  # str.isdigit() is true for a superscript two; int() refuses it
        ("args_contains", "[" * 1500 + "]" * 1500),  # json.loads raises RecursionError, not ValueError
        ("kwargs_contains", '{"a": ' + "[" * 1500 + "]" * 1500 + "}"),
        ("enqueued_after", "2026-01-01T00:00:00"),  # no time zone (a +23:59 offset is read, in UTC: above)
    ],
)
def test_hostile_dashboard_bulk_forms_are_refused_and_store_nothing(field: str, value: str) -> None:
    from tests.factories import StaffFactory

    failed(3)
    client = Client()
    client.force_login(StaffFactory.create(is_superuser=True))
    client.raise_request_exception = False
    response = client.post("/dashboard/tasks/bulk/", {"kind": "retry", field: value})
    stored = list(BulkOperation.objects.values_list("kind", "filter"))
    # What happened: a superscript digit was a 500 (bulk_pages.py filter_from_form: isdigit() then
    # int()).
    assert response.status_code in (200, 400) and stored == [], (response.status_code, stored)
    assert Task.objects.filter(status="FAILED").count() == 3
