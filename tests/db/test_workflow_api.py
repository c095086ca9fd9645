"""The workflow routes of the JSON API: list, one workflow, cancel; the tasks' workflow fields and
filter; the OpenAPI document. A refused request (400, 403, 404, 409) changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from tasks.lifecycle.workflows import WorkflowStatus
from tasks.models import Failure, Task, TaskStatus, Workflow
from tasks.web.api.openapi import parts as openapi
from tasks.workflows import EnqueuedWorkflow, chain, group, step
from tests.helpers.api import TOKEN, Api
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("api_token_and_reader")]


def call(method: str, url: str, body: Any = None, *, raw: str | None = None, token: str = TOKEN) -> tuple[int, Any]:
    return Api(Client(), headers={"Authorization": f"Bearer {token}"}).call(method, url, body, raw=raw)


def state() -> tuple[list[Any], list[Any]]:
    return list(Task.objects.order_by("pk").values()), list(Workflow.objects.order_by("pk").values())


def half_done_group() -> EnqueuedWorkflow:
    """Three members (one succeeded, one failed for good, one waiting) and a callback run anyway."""
    done = group([step(NOOP) for _ in range(3)], then=step(NOOP), on_failure="run", name="fan-out").enqueue()
    first, second = Task.objects.claim("w1", limit=2)
    Task.objects.complete_many("w1", [(first.id, first.token, "null")])
    Task.objects.fail(Failure(second.id, second.token, "E", "boom", retry=False), "w1")
    return done


def test_the_list_is_newest_first_filtered_by_status_and_paged() -> None:
    flows = [chain(step(NOOP), name=f"flow-{n}").enqueue() for n in range(4)]
    Workflow.objects.filter(pk=flows[0].id).cancel()
    status, body = call("GET", "/api/workflows")
    assert status == 200
    assert [w["id"] for w in body["workflows"]] == [f.id for f in reversed(flows)]
    assert body["next"] is None
    listed = body["workflows"][0]
    assert listed == {
        "id": flows[3].id,
        "name": "flow-3",
        "kind": "chain",
        "status": "RUNNING",
        "total": 1,
        "succeeded": 0,
        "failed": 0,
        "remaining": 1,
        "callback_id": flows[3].task_ids[0],
        "created_at": listed["created_at"],
        "finished_at": None,
    }
    status, body = call("GET", "/api/workflows?status=RUNNING&limit=2")
    assert [w["id"] for w in body["workflows"]] == [flows[3].id, flows[2].id]
    assert body["next"] == f"?limit=2&before={flows[2].id}&status=RUNNING"
    status, body = call("GET", "/api/workflows" + body["next"])
    assert [w["id"] for w in body["workflows"]] == [flows[1].id] and body["next"] is None
    status, body = call("GET", "/api/workflows?status=CANCELLED")
    assert [w["id"] for w in body["workflows"]] == [flows[0].id]
    assert body["workflows"][0]["finished_at"] is not None


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("status=NOPE", "status"),
        ("status=", "status"),
        ("status=running", "status"),
        ("limit=0", "limit"),
        ("limit=501", "limit"),
        ("before=abc", "before"),
        ("before=²", "before"),
        ("before=99999999999999999999", "before"),
        ("status=RUNNING%00", None),
        ("db=nowhere", "db"),
    ],
)
def test_bad_list_queries_are_400_with_a_reason(query: str, field: str | None) -> None:
    chain(step(NOOP)).enqueue()
    status, body = call("GET", f"/api/workflows?{query}")
    assert status == 400, body
    assert body["error"]
    if field is not None:
        assert body.get("field") == field


def test_one_workflow_with_its_members_counted_by_status_and_its_callback() -> None:
    done = half_done_group()
    status, body = call("GET", f"/api/workflows/{done.id}")
    assert status == 200
    assert body["workflow"]["id"] == done.id and body["workflow"]["name"] == "fan-out"
    assert (body["workflow"]["succeeded"], body["workflow"]["failed"], body["workflow"]["remaining"]) == (1, 1, 2)
    assert body["members"] == {
        "AWAITING": 1,
        "BLOCKED": 0,
        "READY": 1,
        "RUNNING": 0,
        "SUCCESSFUL": 1,
        "FAILED": 1,
        "CANCELLED": 0,
    }
    assert body["callback"] == {"id": done.callback_id, "status": "AWAITING"}
    assert call("GET", "/api/workflows/999999")[0] == 404
    assert call("GET", f"/api/workflows/{2**63}")[0] == 404
    assert call("GET", "/api/workflows/0")[0] == 404


def test_cancel_cancels_the_members_then_a_second_cancel_is_a_409() -> None:
    done = half_done_group()
    (running,) = Task.objects.claim("w1", limit=1)
    status, body = call("POST", f"/api/workflows/{done.id}/cancel")
    assert status == 200, body
    assert body["cancelled"] == 2  # the running member and the callback
    assert body["workflow"]["status"] == "CANCELLED" and body["workflow"]["remaining"] == 0
    assert body["members"]["CANCELLED"] == 2 and body["members"]["RUNNING"] == 0
    assert not Task.objects.complete_many("w1", [(running.id, running.token, "null")])  # its worker lost it

    before = state()
    status, body = call("POST", f"/api/workflows/{done.id}/cancel")
    assert (status, body) == (409, {"error": "workflow is already cancelled", "status": "CANCELLED"})
    assert state() == before
    assert call("POST", "/api/workflows/999999/cancel")[0] == 404


def test_a_finished_workflow_is_a_409_and_stays_as_it_ended() -> None:
    done = chain(step(NOOP)).enqueue()
    (task,) = Task.objects.claim("w1", limit=1)
    Task.objects.complete_many("w1", [(task.id, task.token, "null")])
    before = state()
    status, body = call("POST", f"/api/workflows/{done.id}/cancel")
    assert (status, body["status"]) == (409, "SUCCESSFUL")
    assert state() == before


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ('{"reason": "x"}', "unknown field(s): reason"),
        ("[1]", "body must be a JSON object"),
        ("{", None),
        ('{"a": NaN}', None),
    ],
)
def test_a_cancel_with_a_bad_body_is_a_400_and_changes_nothing(raw: str, reason: str | None) -> None:
    done = half_done_group()
    before = state()
    status, body = call("POST", f"/api/workflows/{done.id}/cancel", raw=raw)
    assert status == 400 and body["error"]
    if reason is not None:
        assert body["error"] == reason
    assert state() == before


def test_a_reader_cannot_cancel_and_other_methods_are_405() -> None:
    done = half_done_group()
    before = state()
    assert call("POST", f"/api/workflows/{done.id}/cancel", token="reader")[0] == 403
    assert call("GET", f"/api/workflows/{done.id}", token="reader")[0] == 200
    assert call("GET", f"/api/workflows/{done.id}/cancel")[0] == 405
    assert call("DELETE", f"/api/workflows/{done.id}")[0] == 405
    assert call("POST", "/api/workflows")[0] == 405
    assert Client().get("/api/workflows").status_code == 401
    assert state() == before


def test_tasks_carry_their_workflow_and_a_workflows_members_are_a_task_listing() -> None:
    done = half_done_group()
    plain = Task.objects.enqueue(NOOP, queue="mail").id
    status, body = call("GET", f"/api/tasks/{done.callback_id}")
    assert (body["task"]["workflow_id"], body["task"]["waiting_on"], body["task"]["status"]) == (
        done.id,
        1,
        "AWAITING",
    )
    assert call("GET", f"/api/tasks/{plain}")[1]["task"]["workflow_id"] is None
    status, body = call("GET", f"/api/tasks?workflow_id={done.id}")
    assert [t["id"] for t in body["tasks"]] == sorted(done.task_ids, reverse=True)
    status, body = call("GET", f"/api/tasks?workflow_id={done.id}&status=AWAITING")
    assert [t["id"] for t in body["tasks"]] == [done.callback_id]
    assert call("GET", f"/api/tasks?workflow_id={done.id}&queue=mail")[1]["tasks"] == []
    status, body = call("GET", f"/api/tasks?workflow_id={done.id}&limit=2")
    assert body["next"] == f"?limit=2&before={body['tasks'][-1]['id']}&workflow_id={done.id}"
    rest = call("GET", "/api/tasks" + body["next"])[1]["tasks"]
    assert [t["id"] for t in rest] == sorted(done.task_ids, reverse=True)[2:]
    assert [t["id"] for t in call("GET", "/api/tasks?status=AWAITING")[1]["tasks"]] == [done.callback_id]
    for bad in ("abc", "0", "-1", str(2**63)):
        status, body = call("GET", f"/api/tasks?workflow_id={bad}")
        assert (status, body["field"]) == (400, "workflow_id")


def test_the_openapi_document_describes_the_workflow_routes_and_fields() -> None:
    status, document = call("GET", "/api/openapi.json")
    assert status == 200
    paths = document["paths"]
    assert set(paths["/workflows"]) == {"get"}
    assert set(paths["/workflows/{id}"]) == {"parameters", "get"}
    assert set(paths["/workflows/{id}/cancel"]) == {"parameters", "post"}
    assert set(paths["/workflows/{id}/cancel"]["post"]["responses"]) >= {"200", "400", "404", "409"}
    assert {p["name"] for p in paths["/tasks"]["get"]["parameters"]} >= {"workflow_id", "status", "queue"}
    schemas = document["components"]["schemas"]
    assert {"workflow_id", "waiting_on"} <= set(schemas["Task"]["properties"])
    assert schemas["Workflow"]["properties"]["status"]["enum"] == list(WorkflowStatus.values)
    # The documented statuses are the model's, AWAITING included.
    assert list(TaskStatus.values) == openapi.STATUSES
    assert list(WorkflowStatus.values) == openapi.WORKFLOW_STATUSES
    task_props = set(schemas["Task"]["properties"])
    body = call("GET", f"/api/tasks/{Task.objects.enqueue(NOOP).id}")[1]
    assert task_props <= set(body["task"])  # every documented field is there
    workflow = call("GET", f"/api/workflows/{chain(step(NOOP)).enqueue().id}")[1]
    assert set(schemas["Workflow"]["properties"]) == set(workflow["workflow"])
    assert set(
        paths["/workflows/{id}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["properties"]
    ) == set(workflow)


HOSTILE = ["%00", "%C2%B2", "%D9%A3", "%EF%BC%91", "9" * 5000, "9" * 20, "%ED%A0%80", "x" * 5000, "-1", "0", "NaN"]


def test_hostile_query_strings_are_a_400_or_ignored_never_a_server_error() -> None:
    done = half_done_group()
    for url in ("/api/workflows", f"/api/workflows/{done.id}", "/api/tasks"):
        for param in ("status", "limit", "before", "workflow_id", "other"):
            for value in HOSTILE:
                status, body = call("GET", f"{url}?{param}={value}")
                assert status in (200, 400), (url, param, value[:20], status)
                assert status == 200 or body["error"]
