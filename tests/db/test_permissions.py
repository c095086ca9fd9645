"""Real permissions, route by route: the table is built from the URL configuration itself, so a new
route that declares no permission (or one a permission-less staff user can still use) fails here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from leasing.access import SCOPES
from leasing.models import Lease
from tasks.models import Task
from tests.factories import StaffFactory
from tests.helpers.api import TOKEN, check_answer

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("api_token")]

#: Routes that need authentication but no model permission, each for a stated reason.
AUTHENTICATION_ONLY = {
    "api-openapi",  # the description of the API
    "api-not-found",  # the JSON 404 of unknown API routes
}
#: Routes outside this table: Django's admin (its own permissions) and the root redirect.
NOT_OURS = ("/admin/",)


@dataclass(frozen=True)
class Route:
    name: str
    template: str
    view: Any

    def url(self, task_id: int, lease_id: int) -> str:
        url = self.template.replace("<int:task_id>", str(task_id)).replace("<int:lease_id>", str(lease_id))
        url = url.replace("<int:workflow_id>", str(task_id))  # no such workflow: refused first, else a 404
        url = url.replace("<int:operation_id>", str(task_id))  # likewise: refused before its 404
        url = url.replace("<slug:state>", "active" if url.startswith("/leases/") else "running")
        return url.replace("<path:rest>", "nope").replace("^(?P<rest>.*)$", "nope")


def routes() -> list[Route]:
    found: list[Route] = []

    def walk(patterns: list[Any], prefix: str) -> None:
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern):
                found.append(Route(pattern.name or "", prefix + str(pattern.pattern), pattern.callback))

    walk(get_resolver().url_patterns, "/")
    return [r for r in found if not r.template.startswith(NOT_OURS) and r.template != "/"]


ROUTES = routes()
ROUTE_IDS = [r.name or r.template for r in ROUTES]


def needs(route: Route) -> dict[str, tuple[str, ...]]:
    table = getattr(route.view, "permissions", None)
    assert table, f"{route.template} ({route.name}) declares no permissions: decorate it with api_view/staff_page"
    return table


@pytest.fixture
def ids() -> tuple[int, int]:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop").id
    grant = Lease.objects.acquire("route-table", "holder", ttl=30)
    assert grant is not None
    return task_id, Lease.objects.get(resource="route-table").pk


def send(client: Client, method: str, url: str, **headers: str) -> int:
    """The status, with a redirect to the login page reported as 401 (the page refused the caller)."""
    call = getattr(client, method.lower())
    if method in ("GET", "HEAD"):
        response = call(url, headers=headers)
    else:
        response = call(url, data=json.dumps({}), content_type="application/json", headers=headers)
    if response.status_code == 302 and response["Location"].startswith("/admin/login/"):
        return 401
    if url.startswith("/api/"):
        check_answer(response)  # every route, every method, every caller: as the OpenAPI document says
    return response.status_code


def staff_with(*permissions: str) -> Client:
    user = StaffFactory.create(is_superuser=False)
    for name in permissions:
        app_label, codename = name.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    client = Client()
    client.force_login(user)
    return client


def test_the_table_covers_the_dashboard_the_api_the_lease_pages_and_metrics() -> None:
    templates = {r.template for r in ROUTES}
    assert {"/dashboard/", "/dashboard/tasks/action/", "/api/tasks", "/leases/", "/metrics"} <= templates
    assert len(ROUTES) >= 30


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_every_route_declares_a_permission_for_every_method(route: Route) -> None:
    for method, permissions in needs(route).items():
        if route.name in AUTHENTICATION_ONLY:
            assert permissions == (), route
            continue
        assert permissions, f"{method} {route.template} needs no permission"
        # Reads need view permissions only; an action needs a change (or, to enqueue, add) permission,
        # deleting a stored schedule its delete permission.
        if method in ("GET", "HEAD"):
            assert all(".view_" in p for p in permissions), (method, route.template, permissions)
        else:
            acting = (".change_", ".add_", ".delete_") if method == "DELETE" else (".change_", ".add_")
            assert any(a in p for a in acting for p in permissions), (method, route.template, permissions)
        for permission in permissions:
            app_label, _, codename = permission.partition(".")
            assert Permission.objects.filter(content_type__app_label=app_label, codename=codename).exists(), permission


@pytest.mark.parametrize("route", [r for r in ROUTES if r.name not in AUTHENTICATION_ONLY], ids=lambda r: r.name)
def test_staff_without_the_permission_is_refused(route: Route, ids: tuple[int, int]) -> None:
    url = route.url(*ids)
    before = (list(Task.objects.values()), list(Lease.objects.values()))
    for method, permissions in needs(route).items():
        # Every permission of the app but the ones this method needs: still refused.
        others = [p for p in (*SCOPES, "tasks.view_worker") if p not in permissions]
        assert send(staff_with(*others), method, url) == 403, (method, url)
        # A token scoped to everything else: refused too.
        scoped = ":" + "+".join(p for p in SCOPES if p not in permissions)
        with pytest.MonkeyPatch.context() as patch:
            from django.conf import settings

            patch.setattr(settings, "LEASING_API_TOKENS", [TOKEN + scoped])
            if route.template.startswith(("/api/", "/metrics")):
                assert send(Client(), method, url, Authorization=f"Bearer {TOKEN}") == 403, (method, url)
    assert (list(Task.objects.values()), list(Lease.objects.values())) == before, "a refused request changed data"


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_the_declared_permission_is_enough(route: Route, ids: tuple[int, int]) -> None:
    url = route.url(*ids)
    for method, permissions in needs(route).items():
        status = send(staff_with(*permissions), method, url)
        assert status not in (401, 403), (method, url, status)
        if route.template.startswith(("/api/", "/metrics")) and all(p in SCOPES for p in permissions):
            with pytest.MonkeyPatch.context() as patch:
                from django.conf import settings

                patch.setattr(settings, "LEASING_API_TOKENS", [f"{TOKEN}:{'+'.join(permissions) or '*'}"])
                status = send(Client(), method, url, Authorization=f"Bearer {TOKEN}")
                assert status not in (401, 403), (method, url, status)


def test_a_staff_user_without_permissions_cannot_act_through_the_dashboard(ids: tuple[int, int]) -> None:
    task_id, _ = ids
    viewer = staff_with("tasks.view_task")
    assert viewer.get("/dashboard/tasks/pending/").status_code == 200
    assert viewer.post("/dashboard/tasks/action/", {"action": "cancel", "ids": [task_id]}).status_code == 403
    assert Task.objects.get(pk=task_id).status == "READY"
    assert viewer.post("/dashboard/generator/", {"action": "stop"}).status_code == 403
    operator = staff_with("tasks.view_task", "tasks.change_task")
    assert operator.post("/dashboard/tasks/action/", {"action": "cancel", "ids": [task_id]}).status_code == 302
    assert Task.objects.get(pk=task_id).status == "CANCELLED"


def test_scoped_tokens_do_only_what_their_scopes_say(settings: Any, ids: tuple[int, int]) -> None:
    settings.LEASING_API_TOKENS = ["worker-token:tasks.view_task+tasks.change_task", "reader:tasks.view_task"]
    worker = {"Authorization": "Bearer worker-token"}
    reader = {"Authorization": "Bearer reader"}
    client = Client()
    body = json.dumps({"task_path": "tasks.demo.sleep"})
    assert client.post("/api/tasks", body, content_type="application/json", headers=worker).status_code == 403
    claim = json.dumps({"worker": "w"})
    claimed = client.post("/api/tasks/next", claim, content_type="application/json", headers=worker)
    assert claimed.status_code == 200 and claimed.json()["task"]["id"] == ids[0]
    assert client.get("/api/tasks", headers=reader).status_code == 200
    assert client.post(f"/api/tasks/{ids[0]}/cancel", headers=reader).status_code == 403
    assert client.get("/api/leases", headers=reader).status_code == 403
    assert client.get("/metrics", headers=reader).status_code == 403  # metrics read leases too


def test_dashboard_redirects_stay_on_this_site() -> None:
    client = staff_with("tasks.view_task", "tasks.change_task")
    for target in (
        "//evil.example/x",
        "https://evil.example/x",
        "http://testserver.evil.example/",
        "/\\evil.example",
        "\\\\evil.example",
        "javascript:alert(1)",
        "///evil.example",
    ):
        response = client.post("/dashboard/tasks/action/", {"action": "cancel", "next": target})
        assert response.status_code == 302
        assert response["Location"] == "/dashboard/", target
    response = client.post("/dashboard/tasks/action/", {"action": "cancel", "next": "/dashboard/tasks/failed/?q=x"})
    assert response["Location"] == "/dashboard/tasks/failed/?q=x"
