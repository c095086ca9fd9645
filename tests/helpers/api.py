"""The JSON API as the tests call it: one bearer token, and a client that sends JSON and reads it back.

Every answer is held to the API's OpenAPI document (tasks/web/api/openapi/) before a test sees it
(:func:`check_answer`): its status must be one the operation documents and its body must match that
status's schema, so the document cannot drift from what the API returns."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from django.http import HttpResponse
from django.test import Client
from jsonschema import Draft202012Validator
from openapi_core import Config, OpenAPI
from openapi_core.contrib.django import DjangoOpenAPIRequest, DjangoOpenAPIResponse
from openapi_core.exceptions import OpenAPIError
from openapi_core.templating.paths.exceptions import OperationNotFound, PathNotFound
from openapi_core.validation.exceptions import ValidationError

from tasks.web.api.openapi import document

if TYPE_CHECKING:
    # What Django's test client answers: the response, with the request that asked (wsgi_request).
    from django.test.client import _MonkeyPatchedWSGIResponse as TestResponse

#: The API token of the tests (``api_token`` and the other API fixtures put it in LEASING_API_TOKENS).
TOKEN = "test-token-123"
#: Where the test project mounts the API (project/urls.py): the document's server.
ROOT = "/api"


class UndocumentedAnswer(AssertionError):
    """The API answered something its OpenAPI document does not describe."""


@functools.cache
def described_api() -> OpenAPI:
    """The document the API serves, ready to validate answers (built once a process). Whether it is
    a valid OpenAPI 3.1 document is its own test (tests/db/test_api_answers_documented.py): checked
    here, it would cost every process two seconds."""
    # An object schema without additionalProperties is closed: a field the API answers and the document
    # does not name is a mismatch (one it leaves out is, by the schema's own "required").
    closed = Config(spec_validator_cls=None, additional_properties_default_policy="forbid")
    return OpenAPI.from_dict(document(ROOT), config=closed)


class _ConcreteRequest(DjangoOpenAPIRequest):
    """The request as sent: the document's path templates are matched against its concrete path,
    not against the Django route that served it (whose names differ: ``<int:task_id>`` for ``{id}``)."""

    @property
    def path_pattern(self) -> str | None:
        return None


def check_answer(response: TestResponse) -> None:
    """Raise UndocumentedAnswer unless ``response`` (from Django's test client, to a request under
    ``ROOT``) is what the document says the request's operation answers: a documented status, and a
    JSON body valid against that status's schema ($refs resolved).

    Two answers no operation can describe: a path the API does not serve (its JSON 404, the
    ``api-not-found`` route) and a method a route does not serve (405, from ``api_view``); each must
    carry the document's Error body. That the document names every route and exactly its methods is
    tests/db/test_api.py's ``test_openapi_describes_every_route``."""
    request = response.wsgi_request
    where = f"{request.method} {request.get_full_path()} answered {response.status_code}"
    if not request.path.startswith(ROOT + "/"):
        raise UndocumentedAnswer(f"{where}: not under {ROOT}/, where the document's server is")
    route = request.resolver_match.url_name if request.resolver_match else None
    if route == "api-not-found" or response.status_code == 405:
        _check_unserved(response, where, route)
        return
    assert isinstance(response, HttpResponse), f"{where}: streamed; the API answers whole JSON documents"
    try:
        described_api().validate_response(_ConcreteRequest(request), DjangoOpenAPIResponse(response))
    except (PathNotFound, OperationNotFound) as exc:
        raise UndocumentedAnswer(f"{where}: no operation of the document describes it ({exc})") from None
    except ValidationError as exc:
        raise UndocumentedAnswer(f"{where}: {_explained(exc)}\nbody: {_excerpt(response)}") from None
    except OpenAPIError as exc:  # openapi-core's other refusals: an undocumented status, not JSON
        raise UndocumentedAnswer(f"{where}: {type(exc).__name__}: {exc}\nbody: {_excerpt(response)}") from None


def _check_unserved(response: TestResponse, where: str, route: str | None) -> None:
    """An unknown path is a 404 (a caller is authenticated and its query string checked first: 400, 401,
    403), a method the route does not serve a 405 naming those it does; each with the Error body."""
    method = response.wsgi_request.method
    if route == "api-not-found" and response.status_code not in (400, 401, 403, 404):
        raise UndocumentedAnswer(f"{where}: a path the API does not serve, answered other than 404")
    if response.status_code == 405 and method in response.get("Allow", "").split(", "):
        raise UndocumentedAnswer(f"{where}: 405, yet Allow names {method}: {response.get('Allow')!r}")
    if response["Content-Type"] != "application/json":
        raise UndocumentedAnswer(f"{where}: {response['Content-Type']}, not JSON\nbody: {_excerpt(response)}")
    if method == "HEAD":
        return  # the test client drops a HEAD answer's body, as a server does
    errors = list(_error_body().iter_errors(json.loads(response.content or b"null")))
    if errors:
        raise UndocumentedAnswer(f"{where}: not the Error body: {errors[0].message}\nbody: {_excerpt(response)}")


@functools.cache
def _error_body() -> Draft202012Validator:
    """The document's Error schema (OpenAPI 3.1's schemas are JSON Schema 2020-12)."""
    schema = {"$ref": "#/components/schemas/Error", "components": document(ROOT)["components"]}
    return Draft202012Validator(schema)


def _explained(exc: ValidationError) -> str:
    """Each way the body departs from its schema, where (openapi-core's own message repeats the body)."""
    errors = exc.details["schema_errors"]
    if not errors:
        return str(exc)
    lines = [f"{type(exc).__name__}, the body against the schema of its status:"]
    lines += [f"  at {'/'.join(map(str, e['path'])) or '(the body)'}: {e['message']}" for e in errors]
    return "\n".join(lines)


def _excerpt(response: TestResponse) -> str:
    text = response.content.decode(errors="replace")
    return text if len(text) <= 2000 else text[:2000] + "…"


class Api:
    """Calls the JSON API through Django's test client, with ``TOKEN`` unless other headers are given.
    Every answer is checked against the OpenAPI document (:func:`check_answer`)."""

    def __init__(self, client: Client, headers: dict[str, str] | None = None) -> None:
        self.client = client
        self.headers = headers if headers is not None else {"Authorization": f"Bearer {TOKEN}"}

    def call(self, method: str, url: str, body: Any = None, raw: str | None = None) -> tuple[int, Any]:
        """The status and the decoded body (None when empty) of ``method url`` with ``body`` as JSON, or
        the ``raw`` text as it is."""
        data = raw if raw is not None else (json.dumps(body) if body is not None else "")
        if method == "GET":
            response = self.client.get(url, headers=self.headers)
        else:
            response = getattr(self.client, method.lower())(
                url, data=data, content_type="application/json", headers=self.headers
            )
        check_answer(response)
        content = json.loads(response.content) if response.content else None
        return response.status_code, content

    def enqueue(self, body: Any = None, *, raw: str | None = None) -> tuple[int, Any]:
        """``POST /api/tasks``: the status and the decoded reply."""
        return self.call("POST", "/api/tasks", body, raw=raw)
