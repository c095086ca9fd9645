"""The OpenAPI document holds the API's answers: it is a valid OpenAPI 3.1 document, and the check every
test's API call goes through (tests/helpers/api.py ``check_answer``) refuses an answer it does not
describe: a documented field missing, a field it does not name, a wrong type or value, a status the
operation does not list, a body that is not JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from django.test import Client
from openapi_spec_validator import validate

from tasks.models import Task
from tasks.web.api.openapi import document
from tests.helpers.api import TOKEN, UndocumentedAnswer, check_answer

if TYPE_CHECKING:
    from tests.helpers.api import TestResponse

pytestmark = pytest.mark.django_db

BEARER = {"Authorization": f"Bearer {TOKEN}"}


def test_the_document_is_valid_openapi_3_1() -> None:
    validate(document("/api"))  # raises OpenAPIValidationError, naming the part that is not


def _answer(client: Client, settings: Any) -> TestResponse:
    """A real answer: ``GET /api/tasks/<id>`` (a $ref to the Task schema, nullable times, an enum)."""
    settings.LEASING_API_TOKENS = [TOKEN]
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop").id
    response = client.get(f"/api/tasks/{task_id}", headers=BEARER)
    assert response.status_code == 200
    return response


def _body(change: Callable[[dict[str, Any]], None]) -> Callable[[TestResponse], None]:
    def edit(response: TestResponse) -> None:
        body = json.loads(response.content)
        change(body["task"])
        response.content = json.dumps(body).encode()

    return edit


def _status(status: int) -> Callable[[TestResponse], None]:
    def edit(response: TestResponse) -> None:
        response.status_code = status

    return edit


def _html(response: TestResponse) -> None:
    response.content = b"<h1>Server Error</h1>"
    response["Content-Type"] = "text/html; charset=utf-8"


MISMATCHES = {
    "a documented field left out": (_body(lambda task: task.pop("status")), "'status' is a required property"),
    "a field the document does not name": (
        _body(lambda task: task.update(secret="x")),
        "'secret' was unexpected",
    ),
    "a wrong type": (_body(lambda task: task.update(attempts="1")), "'1' is not of type 'integer'"),
    "a value outside the enum": (_body(lambda task: task.update(status="DONE")), "'DONE' is not one of"),
    "a time that is not a date-time": (_body(lambda task: task.update(enqueued_at="soon")), "'soon' is not a"),
    "a status the operation does not list": (_status(500), "500"),
    "a success status it does not list": (_status(201), "201"),
    "a body that is not JSON": (_html, "text/html"),
}


def test_a_documented_answer_passes(client: Client, settings: Any) -> None:
    check_answer(_answer(client, settings))  # the control of the cases below: the real answer is described


@pytest.mark.parametrize("mismatch", MISMATCHES, ids=list(MISMATCHES))
def test_an_answer_the_document_does_not_describe_is_refused(client: Client, settings: Any, mismatch: str) -> None:
    edit, reason = MISMATCHES[mismatch]
    response = _answer(client, settings)
    edit(response)
    with pytest.raises(UndocumentedAnswer) as refused:
        check_answer(response)
    assert reason in str(refused.value)
    assert str(refused.value).startswith("GET /api/tasks/")  # it names the call


def test_an_unrouted_request_must_be_answered_with_the_error_body(client: Client, settings: Any) -> None:
    settings.LEASING_API_TOKENS = [TOKEN]
    response = client.get("/api/no-such-route", headers=BEARER)
    assert response.status_code == 404
    check_answer(response)  # a 404 with the Error body: no operation describes the path, and none need
    response.content = json.dumps({"error": "gone", "why": "an extra field"}).encode()
    with pytest.raises(UndocumentedAnswer, match="not the Error body"):
        check_answer(response)
    response.status_code = 200
    with pytest.raises(UndocumentedAnswer, match="a path the API does not serve, answered other than 404"):
        check_answer(response)


def test_a_method_a_route_does_not_serve_must_be_a_405_with_the_error_body(client: Client, settings: Any) -> None:
    settings.LEASING_API_TOKENS = [TOKEN]
    response = client.delete("/api/tasks", headers=BEARER)
    assert (response.status_code, response["Allow"]) == (405, "GET, POST")
    check_answer(response)
    response["Allow"] = "GET, POST, DELETE"
    with pytest.raises(UndocumentedAnswer, match="405, yet Allow names DELETE"):
        check_answer(response)
    response["Allow"] = "GET, POST"
    response.content = b'{"detail": "not allowed"}'
    with pytest.raises(UndocumentedAnswer, match="not the Error body"):
        check_answer(response)
