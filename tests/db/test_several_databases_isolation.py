"""Several databases: hostile ``?db=`` values on every surface, the same task id
in both databases, claims and creates asked for the wrong database. Nothing may 500, nothing may
act on a database the request did not name, and a refused request changes nothing.

Found by a bug hunt (breaker) on issue 13's several databases."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from leasing.models import Lease
from tasks.models import Task
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(databases=["default", "second"]), pytest.mark.usefixtures("routes")]

HOSTILE = [
    "DEFAULT",
    "Second",
    "%20second",
    "second%0A",
    "second/",
    "..%2Fsecond",
    "%F0%9F%92%A9",
    "0",
    "second&db=nowhere",
    "default&db=second",
    "second&db=",
]


def api(client: Client, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    return Api(client).call(method, url, body)


def snapshot() -> list[tuple[str, int, str, int | None]]:
    return [
        (alias, *row)
        for alias in ("default", "second")
        for row in Task.objects.using(alias).order_by("pk").values_list("pk", "status", "token")
    ] + [(alias, 0, str(n), None) for alias in ("default", "second") for n in [Lease.objects.using(alias).count()]]


def twin_tasks() -> int:
    """A task with the same id in both databases (ids are per database)."""
    first = Task.objects.db_manager("default").enqueue(NOOP).id
    other = Task.objects.db_manager("second").enqueue(NOOP, queue="reports").id
    Task.objects.using("second").filter(pk=other).update(id=first)
    return first


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_db_values_never_500_and_change_nothing(staff: Client, value: str) -> None:
    task_id = twin_tasks()
    before = snapshot()
    pages = [
        "/dashboard/",
        f"/dashboard/tasks/{task_id}/",
        "/dashboard/tasks/pending/",
        "/dashboard/workers/",
        "/dashboard/workers/w-1/",
        "/dashboard/queues/",
        "/dashboard/schedules/",
        "/dashboard/generator/",
        "/leases/",
        "/leases/active/",
    ]
    for url in pages:
        response = staff.get(f"{url}?db={value}")
        assert response.status_code == 400, (url, response.status_code)
    for url, body in [
        ("/dashboard/tasks/action/", {"action": "cancel", "ids": [task_id]}),
        ("/dashboard/queues/", {"action": "pause", "queue": "reports", "reason": "x"}),
    ]:
        response = staff.post(f"{url}?db={value}", body)
        assert response.status_code == 400, (url, response.status_code)
    for method, url, body in [
        ("GET", "/api/tasks", None),
        ("GET", f"/api/tasks/{task_id}", None),
        ("POST", f"/api/tasks/{task_id}/cancel", None),
        ("POST", f"/api/tasks/{task_id}/requeue", None),
        ("POST", "/api/tasks", {"task_path": NOOP, "queue": "reports"}),
        ("POST", "/api/tasks/next", {"worker": "w", "queues": ["reports"]}),
        ("POST", "/api/leases", {"resource": "billing:x", "holder": "h"}),
        ("POST", "/api/queues/reports/pause", {"reason": "r"}),
    ]:
        status, answer = api(staff, method, f"{url}?db={value}", body)
        assert status == 400, (method, url, status, answer)
        assert isinstance(answer["error"], str)
    for url in [
        "/admin/tasks/task/",
        f"/admin/tasks/task/{task_id}/change/",
        f"/admin/tasks/task/{task_id}/delete/",
        f"/admin/tasks/task/{task_id}/history/",
        "/admin/leasing/lease/",
        "/admin/tasks/worker/",
    ]:
        response = staff.get(f"{url}?db={value}")
        assert response.status_code in (302, 400), (url, response.status_code)
    response = staff.post(f"/admin/tasks/task/{task_id}/delete/?db={value}", {"post": "yes"})
    assert response.status_code == 400, response.status_code
    response = staff.post(f"/admin/tasks/task/?db={value}", {"action": "cancel", "_selected_action": [task_id]})
    assert response.status_code in (302, 400), response.status_code
    assert snapshot() == before


def test_the_same_id_in_both_databases_is_acted_on_only_where_asked(staff: Client) -> None:
    task_id = twin_tasks()
    assert api(staff, "POST", f"/api/tasks/{task_id}/cancel?db=second")[0] == 200
    assert Task.objects.using("second").get(pk=task_id).status == "CANCELLED"
    assert Task.objects.using("default").get(pk=task_id).status == "READY"
    # The admin's delete, on the second database, deletes there only.
    response = staff.post(f"/admin/tasks/task/{task_id}/delete/?db=second", {"post": "yes"})
    assert response.status_code == 302, response.status_code
    assert not Task.objects.using("second").filter(pk=task_id).exists()
    assert Task.objects.using("default").get(pk=task_id).status == "READY"
    # The dashboard's action, on the default database (no ?db=), acts there only.
    staff.post("/dashboard/tasks/action/", {"action": "cancel", "ids": [task_id]})
    assert Task.objects.using("default").get(pk=task_id).status == "CANCELLED"


def test_an_admin_action_on_one_database_never_touches_an_id_that_lives_only_in_the_other(staff: Client) -> None:
    only_default = Task.objects.db_manager("default").enqueue(NOOP).id
    Task.objects.using("second").filter(pk=only_default).delete()
    before = snapshot()
    staff.post("/admin/tasks/task/?db=second", {"action": "cancel", "_selected_action": [only_default]})
    response = staff.post(f"/admin/tasks/task/{only_default}/delete/?db=second", {"post": "yes"})
    assert response.status_code in (302, 404), response.status_code
    assert snapshot() == before


def test_claims_from_a_routed_queue_never_take_its_stray_rows_in_another_database(staff: Client) -> None:
    stray = Task.objects.db_manager("default").enqueue(NOOP, queue="reports").id
    routed = Task.objects.enqueue(NOOP, queue="reports").id
    Task.objects.using("second").filter(pk=routed).update(id=stray + 1000)
    status, body = api(staff, "POST", "/api/tasks/next?db=default", {"worker": "w", "queues": ["reports"]})
    assert status == 400 and body["field"] == "db"
    status, body = api(staff, "POST", "/api/tasks/next", {"worker": "w", "queues": ["reports"], "limit": 5})
    assert status == 200 and [t["id"] for t in body["tasks"]] == [stray + 1000]
    assert Task.objects.using("default").get(pk=stray).status == "READY"
    # A lease namespace routed to the second database cannot be taken in the default one.
    status, body = api(staff, "POST", "/api/leases?db=default", {"resource": "billing:y", "holder": "h"})
    assert status == 400 and body["field"] == "db"
    assert not Lease.objects.using("default").filter(resource="billing:y").exists()
    assert not Lease.objects.using("second").filter(resource="billing:y").exists()


def test_the_admin_switches_a_queue_only_in_the_database_its_workers_read(admin_client: Client) -> None:
    """Adding a queue's switch from the admin while another database is shown is refused with a
    form error (it would be a switch no worker of the queue reads); added on its own database, it
    pauses claims there, and the list's actions write there too."""
    from tasks.models import QueueControl

    Task.objects.db_manager("second").enqueue(NOOP, queue="reports")
    refused = admin_client.post("/admin/tasks/queuecontrol/add/", {"name": "reports", "paused": "on"})
    assert refused.status_code == 200 and b"lives in database" in refused.content
    assert not QueueControl.objects.using("default").exists() and not QueueControl.objects.using("second").exists()

    added = admin_client.post("/admin/tasks/queuecontrol/add/?db=second", {"name": "reports", "paused": "on"})
    assert added.status_code == 302, added.content[:500]
    assert QueueControl.objects.using("second").get(name="reports").paused
    assert not QueueControl.objects.using("default").exists()
    assert Task.objects.db_manager("second").claim("w1", queues=["reports"]) == []

    admin_client.post("/admin/tasks/queuecontrol/?db=second", {"action": "resume", "_selected_action": ["reports"]})
    assert not QueueControl.objects.using("second").get(name="reports").paused
    assert len(Task.objects.db_manager("second").claim("w1", queues=["reports"])) == 1
    assert not QueueControl.objects.using("default").exists()


def test_the_queue_command_pauses_a_routed_queue_in_its_own_database() -> None:
    from io import StringIO

    from django.core.management import CommandError, call_command

    from tasks.models import QueueControl

    Task.objects.db_manager("second").enqueue(NOOP, queue="reports")
    out = StringIO()
    call_command("tasks_queue", "pause", "reports", stdout=out)
    assert out.getvalue().startswith("reports: paused, 1 waiting, 0 running (since ")
    assert out.getvalue().rstrip().endswith("[database second]")
    assert QueueControl.objects.using("second").get(name="reports").paused
    assert not QueueControl.objects.using("default").exists()
    assert Task.objects.db_manager("second").claim("w1", queues=["reports"]) == []
    with pytest.raises(CommandError, match="would pause nobody"):
        call_command("tasks_queue", "resume", "reports", database="default")
    assert QueueControl.objects.using("second").get(name="reports").paused
    out = StringIO()
    call_command("tasks_queue", "status", stdout=out)
    assert "reports: paused" in out.getvalue() and "[database second]" in out.getvalue()
    call_command("tasks_queue", "resume", "reports", stdout=StringIO())
    assert len(Task.objects.db_manager("second").claim("w1", queues=["reports"])) == 1
