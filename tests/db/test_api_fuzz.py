"""Fuzzed API input: random JSON bodies and ids never cause a 5xx, and invalid input changes nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasing.models import Lease
from tasks.models import Task

pytestmark = pytest.mark.django_db

TOKEN = "fuzz-token"
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["tasks.demo.sleep", "r", "w1", "default", "2030-01-01T00:00:00+00:00", "\x00", "os.system"])
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=15,
)
FIELDS = [
    "resource", "holder", "ttl", "token", "metadata", "worker", "queues", "limit", "task_path", "args", "kwargs",
    "payload", "queue", "priority", "run_after", "max_attempts", "timeout", "dedup_key", "progress", "output",
    "error", "retry", "running", "rate", "max_sleep",
]  # fmt: skip
bodies = json_values | st.fixed_dictionaries({}, optional=dict.fromkeys(FIELDS, json_values))
ROUTES = [
    ("post", "/api/leases"),
    ("put", "/api/leases/renew"),
    ("delete", "/api/leases/{id}"),
    ("post", "/api/tasks"),
    ("post", "/api/tasks/next"),
    ("put", "/api/tasks/{id}/heartbeat"),
    ("put", "/api/tasks/{id}/complete"),
    ("put", "/api/tasks/{id}/fail"),
    ("post", "/api/tasks/{id}/cancel"),
    ("post", "/api/tasks/{id}/requeue"),
    ("put", "/api/generator"),
    ("get", "/api/leases?limit={id}&state=active"),
    ("get", "/api/tasks?before={id}&status=READY"),
]


@pytest.fixture(autouse=True)
def api_settings(settings: Any) -> None:
    settings.LEASING_API_TOKENS = [TOKEN]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=bodies, ident=st.integers(min_value=-5, max_value=2**64))
def test_no_body_or_id_causes_a_server_error(client: Client, route: tuple[str, str], body: Any, ident: int) -> None:
    method, template = route
    url = template.replace("{id}", str(ident))
    before = (Task.objects.count(), Lease.objects.count())
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if method == "get":
        response = client.get(url, headers=headers)
    else:
        raw = json.dumps(body)
        response = getattr(client, method)(url, data=raw, content_type="application/json", headers=headers)
    assert response.status_code < 500, (url, body, response.content[:500])
    assert response["Content-Type"].startswith("application/json")
    if response.status_code >= 400:
        assert "error" in json.loads(response.content)
        assert (Task.objects.count(), Lease.objects.count()) == before, "a rejected request changed something"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_raw_garbage_bodies_are_400(client: Client, raw: bytes) -> None:
    response = client.post(
        "/api/tasks", data=raw, content_type="application/json", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert response.status_code in (200, 201, 400), response.content[:300]
