"""The JSON API: every route, every error code, authentication."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from leasing.models import Lease
from tasks.models import Task
from tests.factories import StaffFactory
from tests.helpers.api import TOKEN, Api

pytestmark = pytest.mark.django_db

DEMO = "tasks.demo.sleep"


@pytest.fixture(autouse=True)
def api_settings(settings: Any) -> None:
    settings.LEASING_API_TOKENS = [TOKEN]
    settings.LEASING_TASKS = {"API_TASK_PATTERNS": ["tasks.demo.*", "tests.testapp.handlers.*"]}


ROUTES = [
    ("GET", "/api/leases"),
    ("POST", "/api/leases"),
    ("PUT", "/api/leases/renew"),
    ("GET", "/api/leases/active"),
    ("GET", "/api/leases/expired"),
    ("GET", "/api/leases/renewed"),
    ("GET", "/api/leases/released"),
    ("GET", "/api/leases/1"),
    ("DELETE", "/api/leases/1"),
    ("GET", "/api/tasks"),
    ("POST", "/api/tasks"),
    ("POST", "/api/tasks/next"),
    ("GET", "/api/tasks/processed"),
    ("GET", "/api/tasks/started"),
    ("GET", "/api/tasks/stuck"),
    ("GET", "/api/tasks/1"),
    ("PUT", "/api/tasks/1/heartbeat"),
    ("PUT", "/api/tasks/1/complete"),
    ("PUT", "/api/tasks/1/fail"),
    ("POST", "/api/tasks/1/cancel"),
    ("POST", "/api/tasks/1/requeue"),
    ("GET", "/api/generator"),
    ("PUT", "/api/generator"),
    ("GET", "/api/history"),
]


@pytest.mark.parametrize(("method", "url"), ROUTES)
def test_every_route_needs_credentials(client: Client, method: str, url: str) -> None:
    status, body = Api(client, headers={}).call(method, url, {})
    assert status == 401
    assert "error" in body
    status, _ = Api(client, headers={"Authorization": "Bearer wrong"}).call(method, url, {})
    assert status == 401
    status, _ = Api(client, headers={"Authorization": "Basic abc"}).call(method, url, {})
    assert status == 401


@pytest.mark.parametrize(("method", "url"), ROUTES)
def test_non_staff_users_are_refused(client: Client, method: str, url: str) -> None:
    client.force_login(get_user_model().objects.create_user("plain", password="pw"))
    assert Api(client, headers={}).call(method, url, {})[0] == 403


def test_staff_session_works_and_unsafe_methods_need_csrf() -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(StaffFactory.create())
    session = Api(client, headers={})
    assert session.call("GET", "/api/leases")[0] == 200
    status, body = session.call("POST", "/api/leases", {"resource": "r", "holder": "h"})
    assert status == 403
    assert "CSRF" in body["error"]
    client.get("/dashboard/generator/")  # a page with a form sets the CSRF cookie
    csrf = client.cookies["csrftoken"].value
    with_csrf = Api(client, headers={"X-CSRFToken": csrf})
    assert with_csrf.call("POST", "/api/leases", {"resource": "r", "holder": "h"})[0] == 201


def test_unknown_api_paths_are_json_404(api: Api) -> None:
    for url in ("/api/nope", "/api/leases/-1", "/api/tasks/18446744073709551616"):
        status, body = api.call("GET", url)
        assert status == 404
        assert body["error"]


def test_wrong_method_is_405_with_allow(api: Api, client: Client) -> None:
    response = client.patch("/api/leases", headers=api.headers)
    assert response.status_code == 405
    assert response["Allow"] == "GET, POST"


# -- leases ---------------------------------------------------------------------------------------


def test_acquire_then_conflict(api: Api) -> None:
    status, body = api.call(
        "POST", "/api/leases", {"resource": "jobs:a", "holder": "w1", "ttl": 30, "metadata": {"x": 1}}
    )
    assert status == 201
    assert body["grant"]["token"] > 0
    assert body["lease"]["state"] == "active"
    status, body = api.call("POST", "/api/leases", {"resource": "jobs:a", "holder": "w2"})
    assert status == 409
    assert body["holder"] == "w1"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ("not json", None),
        ("[1, 2]", None),
        ("", None),
        ('{"holder": "w"}', "resource"),
        ('{"resource": "", "holder": "w"}', "resource"),
        ('{"resource": "r", "holder": 5}', "holder"),
        ('{"resource": "r", "holder": "w", "ttl": -1}', "ttl"),
        ('{"resource": "r", "holder": "w", "ttl": "30"}', "ttl"),
        ('{"resource": "r", "holder": "w", "ttl": true}', "ttl"),
        ('{"resource": "r", "holder": "w", "colour": "red"}', "colour"),
        ('{"resource": "r", "holder": "w", "metadata": [1]}', "metadata"),
        ('{"resource": "' + "x" * 300 + '", "holder": "w"}', "resource"),
    ],
)
def test_invalid_acquire_bodies_are_400_and_create_nothing(api: Api, raw: str, field: str | None) -> None:
    status, body = api.call("POST", "/api/leases", raw=raw)
    assert status == 400
    assert body["error"]
    if field:
        assert body["field"] == field
    assert not Lease.objects.exists()


def test_renew(api: Api) -> None:
    _, body = api.call("POST", "/api/leases", {"resource": "r", "holder": "w1", "ttl": 5})
    token = body["grant"]["token"]
    status, renewed = api.call("PUT", "/api/leases/renew", {"resource": "r", "holder": "w1", "token": token, "ttl": 60})
    assert status == 200
    assert renewed["grant"]["token"] == token
    assert api.call("PUT", "/api/leases/renew", {"resource": "r", "holder": "w1", "token": token + 1})[0] == 409
    assert api.call("PUT", "/api/leases/renew", {"resource": "nope", "holder": "w1", "token": token})[0] == 404
    assert api.call("PUT", "/api/leases/renew", {"resource": "r", "holder": "w1", "token": "1"})[0] == 400


def test_listing_states_and_pagination(api: Api) -> None:
    for i in range(5):
        api.call("POST", "/api/leases", {"resource": f"r{i}", "holder": "w"})
    Lease.objects.filter(resource="r0").revoke()
    status, body = api.call("GET", "/api/leases?limit=2")
    assert status == 200
    assert len(body["leases"]) == 2
    status, page2 = api.call("GET", "/api/leases" + body["next"])
    assert [lease["resource"] for lease in page2["leases"]] == ["r2", "r1"]
    assert [lease["resource"] for lease in api.call("GET", "/api/leases/released")[1]["leases"]] == ["r0"]
    assert len(api.call("GET", "/api/leases/active")[1]["leases"]) == 4
    assert api.call("GET", "/api/leases/renewed")[1]["leases"] == []
    assert api.call("GET", "/api/leases/expired")[1]["leases"] == []
    assert len(api.call("GET", "/api/leases?state=active")[1]["leases"]) == 4
    assert api.call("GET", "/api/leases?state=bogus")[0] == 400
    assert api.call("GET", "/api/leases?limit=0")[0] == 400
    assert api.call("GET", "/api/leases?before=x")[0] == 400


def test_detail_and_release(api: Api) -> None:
    _, body = api.call("POST", "/api/leases", {"resource": "r", "holder": "w1"})
    lease_id, token = body["lease"]["id"], body["grant"]["token"]
    assert api.call("GET", f"/api/leases/{lease_id}")[1]["lease"]["resource"] == "r"
    assert api.call("GET", "/api/leases/999999")[0] == 404
    assert api.call("DELETE", f"/api/leases/{lease_id}", {"holder": "w1"})[0] == 400
    assert api.call("DELETE", f"/api/leases/{lease_id}", {"holder": "w2", "token": token})[0] == 409
    status, released = api.call("DELETE", f"/api/leases/{lease_id}", {"holder": "w1", "token": token})
    assert status == 200
    assert released["lease"]["state"] == "released"
    assert api.call("DELETE", f"/api/leases/{lease_id}", {"holder": "w1", "token": token})[0] == 409
    assert api.call("DELETE", "/api/leases/999999", {"holder": "w1", "token": token})[0] == 404
    _, again = api.call("POST", "/api/leases", {"resource": "r", "holder": "w1"})
    query = f"/api/leases/{lease_id}?holder=w1&token={again['grant']['token']}"
    assert api.call("DELETE", query)[0] == 200


# -- tasks ----------------------------------------------------------------------------------------


def enqueue(api: Api, **fields: Any) -> dict[str, Any]:
    status, body = api.call("POST", "/api/tasks", {"task_path": DEMO, **fields})
    assert status == 201, body
    return body["task"]


def claim(api: Api, worker: str = "ext-1", **fields: Any) -> dict[str, Any]:
    status, body = api.call("POST", "/api/tasks/next", {"worker": worker, **fields})
    assert status == 200, body
    return body["task"]


def test_enqueue_dedup_and_validation(api: Api) -> None:
    task = enqueue(api, payload={"sleep_duration_seconds": 1}, priority=5, dedup_key="k")
    assert (task["status"], task["kwargs"], task["priority"]) == ("READY", {"sleep_duration_seconds": 1}, 5)
    status, body = api.call("POST", "/api/tasks", {"task_path": DEMO, "dedup_key": "k"})
    assert (status, body["created"], body["task"]["id"]) == (200, False, task["id"])
    bad_bodies = [
        {"task_path": "os.system"},
        {"task_path": "not a path"},
        {"task_path": DEMO, "kwargs": {}, "payload": {}},
        {"task_path": DEMO, "priority": 101},
        {"task_path": DEMO, "run_after": "tomorrow"},
        {"task_path": DEMO, "run_after": "2030-01-01T00:00:00"},
        {"task_path": DEMO, "max_attempts": 0},
        {"task_path": DEMO, "args": {"a": 1}},
        {"task_path": DEMO, "queue": ""},
    ]
    for bad in bad_bodies:
        assert api.call("POST", "/api/tasks", bad)[0] == 400, bad
    assert Task.objects.count() == 1


def test_worker_protocol_round_trip(api: Api) -> None:
    task = enqueue(api)
    claimed = claim(api, ttl=30)
    assert claimed["id"] == task["id"]
    assert claimed["status"] == "RUNNING"
    assert claimed["holder"] == "ext-1"
    token = claimed["token"]
    assert claim(api) is None
    status, beat = api.call(
        "PUT", f"/api/tasks/{task['id']}/heartbeat", {"worker": "ext-1", "token": token, "progress": {"p": 50}}
    )
    assert status == 200
    assert beat["task"]["progress"] == {"p": 50}
    assert api.call("PUT", f"/api/tasks/{task['id']}/heartbeat", {"worker": "ext-2", "token": token})[0] == 409
    assert (
        api.call("PUT", f"/api/tasks/{task['id']}/complete", {"worker": "ext-1", "token": token + 1, "output": 1})[0]
        == 409
    )
    status, done = api.call(
        "PUT", f"/api/tasks/{task['id']}/complete", {"worker": "ext-1", "token": token, "output": {"ok": 1}}
    )
    assert status == 200
    assert (done["task"]["status"], done["task"]["output"]) == ("SUCCESSFUL", {"ok": 1})
    status, again = api.call("PUT", f"/api/tasks/{task['id']}/complete", {"worker": "ext-1", "token": token})
    assert status == 409
    assert "already successful" in again["error"]
    assert api.call("PUT", "/api/tasks/999999/complete", {"worker": "ext-1", "token": token})[0] == 404
    assert api.call("PUT", f"/api/tasks/{task['id']}/complete", {"worker": "ext-1", "token": "x"})[0] == 400


def test_fail_retries_then_ends(api: Api) -> None:
    task = enqueue(api, max_attempts=2)
    first = claim(api)
    body = {"worker": "ext-1", "token": first["token"], "error": {"type": "ValueError", "message": "bad"}}
    status, failed = api.call("PUT", f"/api/tasks/{task['id']}/fail", body)
    assert (status, failed["retrying"], failed["task"]["status"]) == (200, True, "READY")
    assert api.call("PUT", f"/api/tasks/{task['id']}/fail", body)[0] == 409  # no longer held
    Task.objects.filter(pk=task["id"]).retry_now()
    second = claim(api)
    status, final = api.call(
        "PUT", f"/api/tasks/{task['id']}/fail", {"worker": "ext-1", "token": second["token"], "retry": False}
    )
    assert (status, final["retrying"], final["task"]["status"]) == (200, False, "FAILED")
    assert [e["exception_class_path"] for e in final["task"]["errors"]] == ["ValueError", "api.Error"]
    bad = {"worker": "ext-1", "token": second["token"], "error": {"message": 5}}
    assert api.call("PUT", f"/api/tasks/{task['id']}/fail", bad)[0] == 400
    bad = {"worker": "ext-1", "token": second["token"], "error": {"colour": "x"}}
    assert api.call("PUT", f"/api/tasks/{task['id']}/fail", bad)[0] == 400


def test_listings_detail_cancel_requeue(api: Api) -> None:
    done = enqueue(api)
    running = enqueue(api)
    waiting = enqueue(api)
    first = claim(api)
    api.call("PUT", f"/api/tasks/{first['id']}/complete", {"worker": "ext-1", "token": first["token"]})
    claim(api)
    assert {t["id"] for t in api.call("GET", "/api/tasks")[1]["tasks"]} == {done["id"], running["id"], waiting["id"]}
    assert [t["id"] for t in api.call("GET", "/api/tasks/processed")[1]["tasks"]] == [done["id"]]
    assert [t["id"] for t in api.call("GET", "/api/tasks/started")[1]["tasks"]] == [running["id"]]
    assert api.call("GET", "/api/tasks/stuck")[1]["tasks"] == []
    assert [t["id"] for t in api.call("GET", "/api/tasks?status=READY")[1]["tasks"]] == [waiting["id"]]
    assert api.call("GET", "/api/tasks?status=NOPE")[0] == 400
    assert api.call("GET", f"/api/tasks/{done['id']}")[1]["task"]["status"] == "SUCCESSFUL"
    assert api.call("GET", "/api/tasks/999999")[0] == 404
    assert api.call("POST", f"/api/tasks/{running['id']}/requeue")[0] == 409  # running
    assert api.call("POST", f"/api/tasks/{done['id']}/requeue")[1]["task"]["status"] == "READY"
    assert api.call("POST", f"/api/tasks/{waiting['id']}/cancel")[1]["task"]["status"] == "CANCELLED"
    assert api.call("POST", f"/api/tasks/{waiting['id']}/cancel")[0] == 409
    assert api.call("POST", "/api/tasks/999999/cancel")[0] == 404
    assert api.call("POST", "/api/tasks/999999/requeue")[0] == 404


def test_generator_endpoint(api: Api) -> None:
    status, body = api.call("PUT", "/api/generator", {"running": True, "rate": 4})
    assert status == 200
    assert (body["generator"]["running"], body["generator"]["rate"], body["generator"]["leader"]) == (True, 4.0, None)
    assert api.call("PUT", "/api/generator", {"rate": 0})[0] == 400
    assert api.call("PUT", "/api/generator", {"running": "yes"})[0] == 400
    assert api.call("GET", "/api/generator")[1]["generator"]["running"] is True


def _api_routes() -> dict[str, set[str]]:
    """Each route under /api/ (its parameters written ``{}``) and the methods its view serves."""
    found: dict[str, set[str]] = {}

    def walk(patterns: list[Any], prefix: str) -> None:
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern) and pattern.name != "api-not-found":
                route = re.sub(r"<[^>]+>", "{}", prefix + str(pattern.pattern))
                if route.startswith("/api/"):
                    found[route] = set(getattr(pattern.callback, "permissions", ()))  # api_view's methods

    walk(get_resolver().url_patterns, "/")
    return found


def test_openapi_describes_every_route(api: Api) -> None:
    """Every route and exactly the methods it serves (tests/helpers/api.py checks every answer against
    the operation; a method a route does not serve is a 405 no operation describes)."""
    status, document = api.call("GET", "/api/openapi.json")
    assert status == 200
    assert document["openapi"].startswith("3.")
    described = {
        "/api" + re.sub(r"{[^}]+}", "{}", path): {key.upper() for key in item if key != "parameters"}
        for path, item in document["paths"].items()
    }
    assert _api_routes() == described


def test_lists_cut_tracebacks_and_the_task_itself_has_them_whole(api: Api) -> None:
    from tasks.models import Failure

    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", max_attempts=1).id
    claimed = Task.objects.claim("w1", start=True)[0]
    long_trace = "Traceback (most recent call last):\n" + "x" * 5000 + "\nValueError: the end"
    Task.objects.fail(Failure(claimed.id, claimed.token, "builtins.ValueError", "bad", long_trace), "w1")
    status, body = api.call("GET", "/api/tasks?status=FAILED")
    assert status == 200
    [listed] = [t for t in body["tasks"] if t["id"] == task_id]
    [error] = listed["errors"]
    assert error["traceback_truncated"] is True and len(error["traceback"]) <= 501
    assert error["traceback"].endswith("ValueError: the end") and error["message"] == "bad"
    status, body = api.call("GET", f"/api/tasks/{task_id}")
    assert body["task"]["errors"][0]["traceback"] == long_trace
