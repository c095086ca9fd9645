"""Hostile input on every route: bodies, query strings, ids, admin filters. Never a 5xx; the API
answers 400 with a JSON reason naming the field, pages show their own error; nothing changes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from leasing.models import Lease
from tasks.models import Task
from tests.factories import StaffFactory
from tests.helpers.api import TOKEN, check_answer
from tests.helpers.db_state import database_state

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("api_token")]

API = {"Authorization": f"Bearer {TOKEN}"}
MARK = '"__HOSTILE__"'

#: JSON fragments jsonb cannot store or Python cannot hold sanely, put in place of a field's value.
HOSTILE_JSON = {
    "overflow": "1e400",
    "negative overflow": "-1e400",
    "NaN": "NaN",
    "Infinity": "Infinity",
    "-Infinity": "-Infinity",
    "lone high surrogate": '"\\ud800"',
    "lone low surrogate": '"x\\udc00"',
    "NUL": '"a\\u0000b"',
    "5000 digits": "1" + "0" * 5000,
    "long float": "1" * 400 + ".5",
    "nested overflow": '{"k": [1e400]}',
    "surrogate key": '{"\\ud800": 1}',
    "NUL key": '{"\\u0000": 1}',
    "nested NUL": '["ok", "\\u0000"]',
}

#: Query-string values (already percent-encoded).
HOSTILE_QUERY = {
    "NUL": "%00",
    "superscript two": "%C2%B2",
    "arabic-indic three": "%D9%A3",
    "fullwidth one": "%EF%BC%91",
    "5000 digits": "9" * 5000,
    "20 digits": "9" * 20,
    "encoded surrogate": "%ED%A0%80",
    "long text": "x" * 5000,
    "negative": "-1",
    "zero": "0",
    "overflow": "1e400",
    "NaN": "NaN",
}


@pytest.fixture
def world() -> dict[str, Any]:
    """A lease, a claimed task and a waiting one, so that every route has something to act on."""
    grant = Lease.objects.acquire("edge", "holder-1", ttl=60)
    assert grant is not None
    claimed_id = Task.objects.enqueue("tasks.demo.sleep", priority=5).id
    claim = Task.objects.claim("w1", limit=1, ttl=60, start=True)[0]
    assert claim.id == claimed_id
    waiting = Task.objects.enqueue("tasks.demo.sleep").id
    return {
        "lease": Lease.objects.get(resource="edge").pk,
        "lease_token": grant.token,
        "task": claimed_id,
        "token": claim.token,
        "waiting": waiting,
    }


def body_routes(w: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """Every route that reads a JSON body, with a body that would be valid."""
    worker = {"worker": "w1", "token": w["token"]}
    return [
        ("post", "/api/leases", {"resource": "r2", "holder": "h", "ttl": 30, "metadata": {"a": 1}}),
        ("put", "/api/leases/renew", {"resource": "edge", "holder": "holder-1", "token": w["lease_token"], "ttl": 30}),
        ("delete", f"/api/leases/{w['lease']}", {"holder": "holder-1", "token": w["lease_token"]}),
        (
            "post",
            "/api/tasks",
            {
                "task_path": "tasks.demo.sleep",
                "args": [],
                "kwargs": {"sleep_duration_seconds": 1},
                "queue": "q",
                "priority": 1,
                "run_after": "2030-01-01T00:00:00+00:00",
                "max_attempts": 3,
                "timeout": 5,
                "dedup_key": "k",
            },
        ),
        ("post", "/api/tasks/next", {"worker": "w2", "queues": ["default"], "ttl": 30, "limit": 1}),
        ("put", f"/api/tasks/{w['task']}/heartbeat", {**worker, "ttl": 30, "progress": {"p": 1}}),
        ("put", f"/api/tasks/{w['task']}/complete", {**worker, "output": {"ok": True}}),
        (
            "put",
            f"/api/tasks/{w['task']}/fail",
            {**worker, "error": {"type": "E", "message": "m", "traceback": "t"}, "retry": True},
        ),
        ("put", "/api/generator", {"running": True, "rate": 2, "max_sleep": 3}),
    ]


def test_hostile_json_in_any_field_of_any_body_is_400_naming_the_field(client: Client, world: dict[str, Any]) -> None:
    client.get("/api/generator", headers=API)  # the generator row exists before the snapshot
    before = database_state()
    checked = 0
    for method, url, base in body_routes(world):
        for field in base:
            for name, fragment in HOSTILE_JSON.items():
                raw = json.dumps({**base, field: "__HOSTILE__"}).replace(MARK, fragment)
                response = getattr(client, method)(url, data=raw, content_type="application/json", headers=API)
                what = (method, url, field, name)
                assert response.status_code == 400, (*what, response.content[:300])
                check_answer(response)
                reason = response.json()
                assert reason["error"], what
                assert reason.get("field", "").split(".")[0].split("[")[0] == field, (*what, reason)
                checked += 1
    assert checked > 400
    assert database_state() == before


@pytest.mark.parametrize(
    "run_after",
    [
        "0001-01-01T00:00:00+15:00",
        "9999-12-31T23:00:00-15:00",
        "9999-12-31T23:59:59+00:00",
        "0001-01-01T00:00:00+00:00",
        "2030-01-01T00:00:00+24:00",
        "2030-02-30T00:00:00Z",
        "2030-01-01T00:00:00",
        "\uff12\uff10\uff13\uff10-01-01T00:00:00Z",
    ],
)
def test_unrepresentable_dates_are_refused_and_insert_nothing(client: Client, run_after: str) -> None:
    raw = json.dumps({"task_path": "tasks.demo.sleep", "run_after": run_after})
    response = client.post("/api/tasks", data=raw, content_type="application/json", headers=API)
    assert response.status_code == 400
    check_answer(response)
    assert response.json()["field"] == "run_after"
    assert not Task.objects.exists()


def test_the_far_edges_of_the_date_range_are_stored_and_every_page_still_reads_them(client: Client) -> None:
    for run_after in ("2999-12-31T23:59:59+00:00", "2999-12-31T10:00:00-13:00", "1970-01-01T15:00:00+14:00"):
        raw = json.dumps({"task_path": "tasks.demo.sleep", "run_after": run_after})
        response = client.post("/api/tasks", data=raw, content_type="application/json", headers=API)
        assert response.status_code == 201, response.content
        check_answer(response)
    task_id = Task.objects.first().pk  # type: ignore[union-attr]
    listed = client.get("/api/tasks", headers=API)
    assert listed.status_code == 200
    check_answer(listed)
    client.force_login(StaffFactory.create())
    for url in (
        "/dashboard/",
        "/dashboard/tasks/pending/",
        f"/dashboard/tasks/{task_id}/",
        "/admin/tasks/task/",
        f"/admin/tasks/task/{task_id}/change/",
    ):
        assert client.get(url).status_code == 200, url
    database_state()  # psycopg reads every stored timestamp back


API_GETS = [
    "/api/leases",
    "/api/leases/active",
    "/api/leases/expired",
    "/api/leases/renewed",
    "/api/leases/released",
    "/api/leases/{lease}",
    "/api/tasks",
    "/api/tasks/processed",
    "/api/tasks/started",
    "/api/tasks/stuck",
    "/api/tasks/{task}",
    "/api/generator",
    "/api/openapi.json",
]
PARAMS = ["queue", "status", "state", "limit", "before", "holder", "token", "q", "page", "other"]


@pytest.mark.parametrize("url", API_GETS)
def test_hostile_query_strings_on_api_reads_are_never_a_server_error(
    client: Client, world: dict[str, Any], url: str
) -> None:
    url = url.format(**world)
    for param in PARAMS:
        for name, value in HOSTILE_QUERY.items():
            response = client.get(f"{url}?{param}={value}", headers=API)
            assert response.status_code in (200, 400), (url, param, name, response.status_code)
            check_answer(response)


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("queue=%00", "queue"),
        ("before=%C2%B2", "before"),
        ("before=%D9%A3", "before"),
        ("before=" + "9" * 5000, "before"),
        ("before=" + "9" * 20, "before"),
        ("limit=%EF%BC%91", "limit"),
        ("limit=" + "1" * 5000, "limit"),
        ("status=%00", "status"),
        ("q=%00", "q"),  # not a filter of this route, still never sent anywhere
    ],
)
def test_api_query_filters_are_checked(client: Client, query: str, field: str) -> None:
    response = client.get(f"/api/tasks?{query}", headers=API)
    assert response.status_code == 400
    check_answer(response)
    assert response.json()["field"] == field


def test_release_query_string_is_checked(client: Client, world: dict[str, Any]) -> None:
    before = database_state()
    for query in ("holder=%00&token=1", "holder=h&token=%C2%B2", "holder=h&token=" + "9" * 5000):
        response = client.delete(f"/api/leases/{world['lease']}?{query}", headers=API)
        assert response.status_code == 400, query
        check_answer(response)
    assert database_state() == before


def test_ids_in_paths(client: Client) -> None:
    for url in ("/api/tasks/" + "9" * 5000, "/api/leases/" + "9" * 30, "/api/tasks/%C2%B2", "/api/tasks/%00"):
        response = client.get(url, headers=API)
        assert response.status_code == 404, url
        check_answer(response)


PAGES = [
    "/dashboard/",
    "/dashboard/tasks/pending/",
    "/dashboard/tasks/running/",
    "/dashboard/tasks/{task}/",
    "/dashboard/workers/",
    "/dashboard/generator/",
    "/leases/",
    "/leases/expired/",
    "/metrics",
]


@pytest.mark.parametrize("url", PAGES)
def test_hostile_query_strings_on_pages_are_never_a_server_error(
    client: Client, world: dict[str, Any], url: str
) -> None:
    client.force_login(StaffFactory.create())
    url = url.format(**world)
    for param in PARAMS:
        for name, value in HOSTILE_QUERY.items():
            status = client.get(f"{url}?{param}={value}").status_code
            assert status in (200, 400), (url, param, name, status)


def test_task_list_filters_are_ignored_with_a_message_or_refused_with_a_page(
    client: Client, world: dict[str, Any]
) -> None:
    client.force_login(StaffFactory.create())
    page = client.get("/dashboard/tasks/pending/?before=%C2%B2")
    assert page.status_code == 200
    assert "Filter ignored" in page.content.decode()
    assert [t.pk for t in page.context["tasks"]] == [world["waiting"]]
    page = client.get("/dashboard/tasks/pending/?q=%C2%B2")  # searched as text, not as an id
    assert page.status_code == 200 and page.context["tasks"] == []
    page = client.get(f"/dashboard/tasks/pending/?q={world['waiting']}")
    assert [t.pk for t in page.context["tasks"]] == [world["waiting"]]
    page = client.get("/dashboard/tasks/pending/?q=" + "9" * 30)  # not a bigint: no id lookup, no error
    assert page.status_code == 200 and page.context["tasks"] == []
    refused = client.get("/dashboard/tasks/pending/?queue=%00")
    assert refused.status_code == 400
    assert "NUL" in refused.content.decode()
    assert client.get("/dashboard/tasks/" + "9" * 5000 + "/").status_code == 404


def test_dashboard_actions_refuse_odd_ids_and_numbers_changing_nothing(client: Client, world: dict[str, Any]) -> None:
    client.force_login(StaffFactory.create())
    client.get("/dashboard/generator/")
    before = database_state()
    for ids in (["\u00b2"], ["\u0663"], [str(world["waiting"]), "9" * 5000], ["1\x00"], ["-1"]):
        response = client.post("/dashboard/tasks/action/", {"action": "cancel", "ids": ids}, follow=True)
        assert response.status_code in (200, 400), ids
    for rate in ("nan", "inf", "1e400", "1_0", "\u0661", "9" * 5000, "-1", "\x00"):
        response = client.post("/dashboard/generator/", {"action": "start", "rate": rate}, follow=True)
        assert response.status_code in (200, 400), rate
    assert client.post("/dashboard/generator/", {"action": "explode"}).status_code == 302
    assert database_state() == before


ADMIN_LISTS = ["/admin/tasks/task/", "/admin/leasing/lease/", "/admin/tasks/worker/", "/admin/tasks/generatorstate/"]
ADMIN_PARAMS = [
    "q",
    "queue__exact",
    "status__exact",
    "lease",
    "state",
    "holder",
    "id__exact",
    "run_after__year",
    "run_after__gte",
    "timeout",
    "p",
    "o",
]


@pytest.mark.parametrize("url", ADMIN_LISTS)
def test_admin_filters_and_search_are_never_a_server_error(client: Client, world: dict[str, Any], url: str) -> None:
    client.force_login(StaffFactory.create())
    for param in ADMIN_PARAMS:
        for name, value in {**HOSTILE_QUERY, "far date": "0001-01-01T00:00:00%2B15:00", "year": "99999"}.items():
            status = client.get(f"{url}?{param}={value}").status_code
            assert status in (200, 302, 400), (url, param, name, status)


def test_admin_nul_filter_is_dropped_with_a_message(client: Client, world: dict[str, Any]) -> None:
    client.force_login(StaffFactory.create())
    response = client.get("/admin/tasks/task/?queue__exact=%00&status__exact=READY")
    assert response.status_code == 302
    assert response["Location"] == "/admin/tasks/task/?status__exact=READY"
    page = client.get(response["Location"])
    assert "NUL" in page.content.decode()
    assert [t.pk for t in page.context["cl"].result_list] == [world["waiting"]]


@pytest.mark.parametrize("object_id", ["%00", "%C2%B2", "9" * 5000, "%ED%A0%80", "x" * 2000])
def test_admin_object_ids_are_never_a_server_error(client: Client, object_id: str) -> None:
    client.force_login(StaffFactory.create())
    for model in ("tasks/task", "leasing/lease", "tasks/worker", "tasks/generatorstate"):
        for view in ("change", "history", "delete"):
            status = client.get(f"/admin/{model}/{object_id}/{view}/").status_code
            assert status in (302, 404), (model, view, object_id, status)


def test_admin_actions_refuse_odd_selections_changing_nothing(client: Client, world: dict[str, Any]) -> None:
    client.force_login(StaffFactory.create())
    before = database_state()
    for selected in (["\u00b2"], ["\u0663"], ["9" * 5000], ["1\x00"], [str(world["waiting"]), "x"]):
        response = client.post("/admin/tasks/task/", {"action": "cancel", "_selected_action": selected})
        assert response.status_code == 302, selected
    for selected in (["\x00"], ["x" * 5000]):
        response = client.post("/admin/tasks/worker/", {"action": "delete_selected", "_selected_action": selected})
        assert response.status_code == 302, selected
    assert database_state() == before
