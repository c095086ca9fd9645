"""One transaction per request: every write route, refused for every reason it can be refused,
leaves every row as it was, including when the refusal comes after a first write succeeded."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from leasing.models import Lease
from tasks.models import Task
from tests.factories import StaffFactory
from tests.helpers.api import check_answer
from tests.helpers.db_state import database_state

pytestmark = pytest.mark.django_db

TOKEN = "tx-token"
READER = "tx-reader"


@pytest.fixture(autouse=True)
def tokens_with_a_reader(settings: Any) -> None:
    settings.LEASING_API_TOKENS = [TOKEN, f"{READER}:tasks.view_task+leasing.view_lease+tasks.view_generatorstate"]


@pytest.fixture
def rows_in_every_state() -> dict[str, Any]:
    grant = Lease.objects.acquire("held", "holder-1", ttl=60)
    assert grant is not None
    running = Task.objects.enqueue("tasks.demo.sleep", priority=9).id
    claim = Task.objects.claim("w1", limit=1, ttl=60, start=True)[0]
    assert claim.id == running
    finished = Task.objects.enqueue("tasks.demo.sleep", dedup_key="k").id
    Task.objects.filter(pk=finished).cancel()
    holder_of_key = Task.objects.enqueue("tasks.demo.sleep", dedup_key="k").id  # unfinished, same key
    waiting = Task.objects.enqueue("tasks.demo.sleep", run_after=timezone.now() + dt.timedelta(hours=1)).id
    Client().get("/api/generator", headers={"Authorization": f"Bearer {TOKEN}"})  # the generator row exists
    return {
        "lease": Lease.objects.get(resource="held").pk,
        "lease_token": grant.token,
        "running": running,
        "token": claim.token,
        "finished": finished,
        "holder_of_key": holder_of_key,
        "waiting": waiting,
    }


def api(method: str, url: str, body: Any = None, token: str = TOKEN) -> Callable[[Client], int]:
    def send(client: Client) -> int:
        data = json.dumps(body) if body is not None else ""
        response = getattr(client, method)(
            url, data=data, content_type="application/json", headers={"Authorization": f"Bearer {token}"}
        )
        check_answer(response)  # JSON, as the OpenAPI document describes it
        return response.status_code

    return send


def refusals(w: dict[str, Any]) -> list[tuple[str, Callable[[Client], int], int]]:
    """(what, request, expected status) for every API write route and every way it is refused."""
    mine = {"worker": "w1", "token": w["token"]}
    stale = {"worker": "w1", "token": w["token"] + 1000}
    lease = f"/api/leases/{w['lease']}"
    stale_lease = w["lease_token"] + 1000
    task = f"/api/tasks/{w['running']}"
    cases: list[tuple[str, Callable[[Client], int], int]] = [
        ("acquire: bad ttl", api("post", "/api/leases", {"resource": "r", "holder": "h", "ttl": -1}), 400),
        ("acquire: held", api("post", "/api/leases", {"resource": "held", "holder": "other"}), 409),
        ("renew: bad", api("put", "/api/leases/renew", {"resource": "held", "holder": "holder-1"}), 400),
        (
            "renew: stale",
            api("put", "/api/leases/renew", {"resource": "held", "holder": "holder-1", "token": stale_lease}),
            409,
        ),
        ("renew: unknown", api("put", "/api/leases/renew", {"resource": "nope", "holder": "h", "token": 1}), 404),
        ("release: bad", api("delete", lease, {"holder": "holder-1"}), 400),
        ("release: not yours", api("delete", lease, {"holder": "other", "token": w["lease_token"]}), 409),
        ("release: unknown", api("delete", "/api/leases/999999", {"holder": "h", "token": 1}), 404),
        ("enqueue: path", api("post", "/api/tasks", {"task_path": "tasks.demo.os.system"}), 400),
        ("enqueue: priority", api("post", "/api/tasks", {"task_path": "tasks.demo.sleep", "priority": 101}), 400),
        ("enqueue: args", api("post", "/api/tasks", {"task_path": "tasks.demo.sleep", "args": {"a": 1}}), 400),
        ("claim: queues", api("post", "/api/tasks/next", {"worker": "w2", "queues": []}), 400),
        ("heartbeat: bad", api("put", f"{task}/heartbeat", {**mine, "ttl": 0}), 400),
        ("heartbeat: stale", api("put", f"{task}/heartbeat", {**stale, "progress": {"p": 1}}), 409),
        ("heartbeat: unknown", api("put", "/api/tasks/999999/heartbeat", mine), 404),
        ("complete: stale", api("put", f"{task}/complete", {**stale, "output": 1}), 409),
        ("complete: bad", api("put", f"{task}/complete", {**mine, "colour": 1}), 400),
        ("fail: stale", api("put", f"{task}/fail", stale), 409),
        ("fail: bad", api("put", f"{task}/fail", {**mine, "error": {"message": 5}}), 400),
        ("cancel: finished", api("post", f"/api/tasks/{w['finished']}/cancel"), 409),
        ("cancel: unknown", api("post", "/api/tasks/999999/cancel"), 404),
        ("requeue: running", api("post", f"{task}/requeue"), 409),
        ("requeue: key taken", api("post", f"/api/tasks/{w['finished']}/requeue"), 409),
        ("requeue: unknown", api("post", "/api/tasks/999999/requeue"), 404),
        ("generator: rate", api("put", "/api/generator", {"running": False, "rate": 0}), 400),
        ("generator: running", api("put", "/api/generator", {"running": "yes"}), 400),
    ]
    # A token without the change scope: every write refused before anything runs.
    for method, url, body in [
        ("post", "/api/leases", {"resource": "r", "holder": "h"}),
        ("put", "/api/leases/renew", {"resource": "held", "holder": "holder-1", "token": w["lease_token"]}),
        ("delete", lease, {"holder": "holder-1", "token": w["lease_token"]}),
        ("post", "/api/tasks", {"task_path": "tasks.demo.sleep"}),
        ("post", "/api/tasks/next", {"worker": "w2"}),
        ("put", f"{task}/heartbeat", mine),
        ("put", f"{task}/complete", mine),
        ("put", f"{task}/fail", mine),
        ("post", f"/api/tasks/{w['waiting']}/cancel", None),
        ("post", f"/api/tasks/{w['finished']}/requeue", None),
        ("put", "/api/generator", {"running": True}),
    ]:
        cases.append((f"reader token: {method} {url}", api(method, url, body, token=READER), 403))
    return cases


def test_every_refused_api_write_changes_nothing(rows_in_every_state: dict[str, Any]) -> None:
    client = Client()
    cases = refusals(rows_in_every_state)
    assert len(cases) >= 35
    for what, send, expected in cases:
        before = database_state()
        assert send(client) == expected, what
        assert database_state() == before, f"{what}: a refused request changed the database"


def test_dashboard_refusals_change_nothing(client: Client, rows_in_every_state: dict[str, Any]) -> None:
    client.force_login(StaffFactory.create())
    for what, refused in [
        ("odd id", {"action": "cancel", "ids": [rows_in_every_state["waiting"], "\u00b2"]}),
        ("unknown action", {"action": "explode", "ids": [rows_in_every_state["waiting"]]}),
    ]:
        before = database_state()
        assert client.post("/dashboard/tasks/action/", refused).status_code == 400, what  # a page with the reason
        assert database_state() == before, what
    for what, data, url in [
        ("bad rate", {"action": "start", "rate": "nan"}, "/dashboard/generator/"),
        ("rate out of range", {"action": "start", "rate": "0"}, "/dashboard/generator/"),
        ("unknown generator action", {"action": "explode"}, "/dashboard/generator/"),
    ]:
        before = database_state()
        response = client.post(url, data, follow=True)
        assert response.status_code == 200, what
        assert any(m.level_tag == "error" for m in response.context["messages"]), what
        assert database_state() == before, what


# -- refusals after a first write ----------------------------------------------------------------


def refuse_updates(table: str, condition: str) -> None:
    """A trigger that fails (as a data error) every UPDATE of ``table`` whose new row meets ``condition``:
    a real database refusal in the middle of a request, after its first statement succeeded."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            CREATE FUNCTION edge_refuse_{table}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF {condition} THEN
                    RAISE EXCEPTION 'refused by the test' USING ERRCODE = '22023';
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER edge_refuse_{table} BEFORE UPDATE ON {table}
                FOR EACH ROW EXECUTE FUNCTION edge_refuse_{table}();
            """
        )


def test_a_heartbeat_whose_checkpoint_fails_renews_nothing(rows_in_every_state: dict[str, Any]) -> None:
    refuse_updates("tasks_task", "NEW.progress ->> 'refuse' IS NOT NULL")
    before = database_state()
    body = {"worker": "w1", "token": rows_in_every_state["token"], "ttl": 600, "progress": {"refuse": 1}}
    status = api("put", f"/api/tasks/{rows_in_every_state['running']}/heartbeat", body)(Client())
    assert status == 400
    assert database_state() == before, "the lease was renewed by a request that failed"
    assert (
        api("put", f"/api/tasks/{rows_in_every_state['running']}/heartbeat", {**body, "progress": {"ok": 1}})(Client())
        == 200
    )
    assert Task.objects.get(pk=rows_in_every_state["running"]).progress == {"ok": 1}


def test_an_enqueue_that_fails_after_its_insert_leaves_no_task(rows_in_every_state: dict[str, Any]) -> None:
    refuse_updates("tasks_task", "NEW.api_origin AND NEW.queue = 'refused'")
    before = database_state()
    status = api("post", "/api/tasks", {"task_path": "tasks.demo.sleep", "queue": "refused"})(Client())
    assert status == 400
    assert database_state() == before, "a task was inserted by a request that failed"


def test_a_generator_change_that_fails_after_creating_its_row_leaves_no_row() -> None:
    refuse_updates("tasks_generatorstate", "NEW.rate = 42")
    before = database_state()
    assert before["tasks_generatorstate"] == []
    assert api("put", "/api/generator", {"rate": 42})(Client()) == 400
    assert database_state() == before, "get_or_create's row survived a failed request"


def test_a_bulk_retry_refused_halfway_undoes_its_first_half(
    client: Client, rows_in_every_state: dict[str, Any]
) -> None:
    # The requeue of the finished task hits the dedup key held by an unfinished task: refused (409), and
    # a retry that names a waiting task too (which it does not fit) is refused before anything moves.
    client.force_login(StaffFactory.create())
    before = database_state()
    for ids in ([rows_in_every_state["finished"]], [rows_in_every_state["waiting"], rows_in_every_state["finished"]]):
        response = client.post("/dashboard/tasks/action/", {"action": "retry", "ids": ids})
        assert response.status_code == 409
        assert "Nothing changed" in response.content.decode()
        assert database_state() == before
    response = client.post(
        "/dashboard/tasks/action/", {"action": "run_now", "ids": [rows_in_every_state["waiting"]]}, follow=True
    )
    assert "Run now: 1 task(s)" in response.content.decode()
    assert Task.objects.runnable().filter(pk=rows_in_every_state["waiting"]).exists()
