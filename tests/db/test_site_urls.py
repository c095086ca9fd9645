"""Mounting the package in a project: one include under any prefix, or the pieces apart."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from tests.helpers.api import TOKEN

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("api_token")]

BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def plain(client: Client) -> Client:
    client.force_login(get_user_model().objects.create_user("plain", password="pw"))
    return client


def json_of(response: Any) -> Any:
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    return json.loads(response.content)


@pytest.mark.urls("tests.testapp.urls_prefixed")
def test_one_include_mounts_everything_under_the_chosen_prefix(staff: Client) -> None:
    assert staff.get("/ops/")["Location"] == "/ops/dashboard/"
    overview = staff.get("/ops/dashboard/")
    assert overview.status_code == 200
    page = overview.content.decode()
    for link in ("/ops/dashboard/workers/", "/ops/leases/", "/ops/dashboard/tasks/running/", "/admin/"):
        assert f'href="{link}"' in page, link
    assert staff.get("/ops/dashboard/workers/").status_code == 200
    assert staff.get("/ops/leases/active/").status_code == 200
    assert reverse("tasks:overview") == "/ops/dashboard/"
    assert reverse("leasing:lease-list") == "/ops/leases/"
    assert reverse("metrics") == "/ops/metrics"

    acquired = staff.post(
        "/ops/api/leases",
        {"resource": "mounted", "holder": "h", "ttl": 30},
        content_type="application/json",
        headers=BEARER,
    )
    assert acquired.status_code == 201, acquired.content
    assert json_of(staff.get("/ops/api/leases/active", headers=BEARER))["leases"][0]["resource"] == "mounted"
    document = json_of(staff.get("/ops/api/openapi.json", headers=BEARER))
    assert document["servers"] == [{"url": "http://testserver/ops/api"}]  # where the API really is
    missing = staff.get("/ops/api/no-such-thing", headers=BEARER)
    assert missing.status_code == 404
    assert json_of(missing)["error"] == "no such API route: /ops/api/no-such-thing"
    metrics = staff.get("/ops/metrics")
    assert metrics.status_code == 200
    assert b"leasing_leases{" in metrics.content
    # Nothing is left at the demo's paths.
    assert staff.get("/dashboard/").status_code == 404
    assert staff.get("/api/leases", headers=BEARER).status_code == 404


@pytest.mark.urls("tests.testapp.urls_prefixed")
def test_the_include_keeps_every_permission(client: Client, plain: Client) -> None:
    anonymous = Client()
    for url in ("/ops/dashboard/", "/ops/leases/", "/ops/dashboard/workers/"):
        assert anonymous.get(url)["Location"].startswith("/admin/login/?next=" + url), url
        assert plain.get(url).status_code == 302, url  # signed in, not staff: the admin log-in again
    assert anonymous.get("/ops/api/leases").status_code == 401
    assert anonymous.get("/ops/api/leases", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert plain.get("/ops/api/leases").status_code == 403
    assert anonymous.get("/ops/metrics").status_code == 401
    assert plain.get("/ops/metrics").status_code == 403  # signed in, without the view permissions
    assert anonymous.get("/ops/metrics", headers=BEARER).status_code == 200


@pytest.mark.urls("tests.testapp.urls_apart")
def test_the_pieces_mount_apart(staff: Client) -> None:
    page = staff.get("/board/").content.decode()
    assert 'href="/board-leases/"' in page and 'href="/board/workers/"' in page
    assert staff.get("/board-leases/expired/").status_code == 200
    assert staff.get("/v1/leases", headers=BEARER).status_code == 200
    assert json_of(staff.get("/v1/openapi.json", headers=BEARER))["servers"] == [{"url": "http://testserver/v1"}]
    assert json_of(staff.get("/v1/nope", headers=BEARER))["error"] == "no such API route: /v1/nope"
    assert staff.get("/prometheus/metrics").status_code == 200
    assert staff.get("/").status_code == 404
