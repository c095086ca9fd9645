"""Several databases: queues and lease namespaces routed to aliases, and everything that follows.

The second alias ("second", tests/settings.py) is another database on the same embedded server;
pytest-django creates it only for the tests that ask for it, as these do.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connections
from django.test import Client

from leasing.election import LeaderElection
from leasing.holder import lease
from leasing.metrics import scrape_values
from leasing.models import Lease
from leasing.routing import known_databases, lease_database
from tasks.compat import task_backends
from tasks.lifecycle.routing import queue_database
from tasks.maintenance.recovery import RECOVERY_LEASE, RecoveryController, recover_once
from tasks.maintenance.schedule_specs import load_schedules
from tasks.maintenance.scheduler import Scheduler, schedule_status
from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(databases=["default", "second"]), pytest.mark.usefixtures("routes")]


def rows(alias: str, **filters: Any) -> list[int]:
    return list(Task.objects.using(alias).filter(**filters).order_by("pk").values_list("pk", flat=True))


# -- routing ---------------------------------------------------------------------------------------


def test_enqueue_lands_in_the_database_its_queue_is_routed_to() -> None:
    report = Task.objects.enqueue(NOOP, queue="reports")
    plain = Task.objects.enqueue(NOOP)
    assert (report.database, plain.database) == ("second", "default")
    assert rows("second") == [report.id]
    assert rows("default") == [plain.id]
    # An explicit database wins over the route.
    forced = Task.objects.db_manager("default").enqueue(NOOP, queue="reports")
    assert forced.database == "default" and forced.id in rows("default", queue="reports")
    # bulk_enqueue: one queue, so one database.
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 3, queue="reports")
    assert set(ids) <= set(rows("second")) and not set(rows("default", queue="reports")) - {forced.id}


def test_dedup_keys_are_per_database() -> None:
    first = Task.objects.enqueue(NOOP, queue="reports", dedup_key="k")
    again = Task.objects.enqueue(NOOP, queue="reports", dedup_key="k")
    elsewhere = Task.objects.enqueue(NOOP, dedup_key="k")
    assert (first.created, again.created, again.id) == (True, False, first.id)
    assert elsewhere.created and elsewhere.database == "default"


def test_an_unknown_alias_in_the_routes_is_a_clear_configuration_error(settings: Any) -> None:
    settings.LEASING_TASKS = {"QUEUE_DATABASES": {"reports": "nowhere"}}
    with pytest.raises(ImproperlyConfigured, match=r"QUEUE_DATABASES.*'reports'.*no database 'nowhere'"):
        queue_database("reports")
    settings.LEASING = {"DATABASES": {"billing:": "nowhere"}}
    with pytest.raises(ImproperlyConfigured, match=r"LEASING\[\"DATABASES\"\].*'billing:'.*'nowhere'"):
        lease_database("billing:1")
    settings.LEASING = {"DATABASES": ["billing:"]}
    with pytest.raises(ImproperlyConfigured, match="must be a dict"):
        lease_database("billing:1")


# lease() commits its grants on a connection of its own: the test must clean up by flushing.
@pytest.mark.django_db(databases=["default", "second"], transaction=True)
def test_lease_namespaces_are_routed_and_their_tokens_grow_there() -> None:
    assert lease_database("billing:invoices") == "second"
    assert lease_database("billingx") == "default"
    tokens = []
    for _ in range(2):
        with lease("billing:x", ttl=5, timeout=0) as held:
            assert held.using == "second"
            tokens.append(held.token)
    assert tokens[1] > tokens[0]
    assert Lease.objects.using("second").filter(resource="billing:x").exists()
    assert not Lease.objects.using("default").filter(resource="billing:x").exists()
    # An explicit database wins over the namespace's route.
    with lease("billing:x", ttl=5, timeout=0, using="default") as held:
        assert held.using == "default"
    assert Lease.objects.using("default").filter(resource="billing:x").exists()
    assert LeaderElection("billing:leader").using == "second"


def test_the_backend_routes_by_queue_unless_it_names_its_database(settings: Any) -> None:
    from tests.conformance.lease_tasks import echo  # a django.tasks Task

    settings.TASKS = {
        "default": {"BACKEND": "tasks.backends.LeaseBackend", "QUEUES": []},
        "pinned": {"BACKEND": "tasks.backends.LeaseBackend", "QUEUES": [], "OPTIONS": {"database": "default"}},
    }
    routed = echo.using(queue_name="reports").enqueue("hi")
    number, _, alias = routed.id.partition("@")
    assert alias == "second" and int(number) in rows("second")
    assert task_backends["default"].get_result(routed.id).id == routed.id
    plain = echo.using(queue_name="default").enqueue("hi")
    assert "@" not in plain.id and int(plain.id) in rows("default")
    pinned = echo.using(backend="pinned", queue_name="reports").enqueue("hi")
    assert "@" not in pinned.id and int(pinned.id) in rows("default", queue="reports")


def test_schedules_run_where_their_queue_lives(settings: Any) -> None:
    settings.LEASING_TASKS = {
        "QUEUE_DATABASES": {"reports": "second"},
        "SCHEDULES": {
            "nightly": {"task": NOOP, "interval": 60, "queue": "reports"},
            "often": {"task": NOOP, "interval": 60},
        },
    }
    assert set(Scheduler(using="second").schedules) == {"nightly"}
    assert set(Scheduler(using="default").schedules) == {"often"}
    assert [e["name"] for e in schedule_status(using="second")] == ["nightly"]
    assert [e["name"] for e in schedule_status(load_schedules(), using="default")] == ["often"]
    with pytest.raises(ImproperlyConfigured, match="nightly"):
        Scheduler(using="default", schedules=load_schedules())


def test_a_worker_refuses_queues_routed_elsewhere() -> None:
    with pytest.raises(CommandError, match=r"--database second: .*default \(routed to default\)"):
        call_command("run_worker", "--database", "second", "--queues", "default")
    with pytest.raises(CommandError, match=r"--database default: .*reports \(routed to second\)"):
        call_command("run_worker", "--database", "default", "--queues", "reports,default")
    with pytest.raises(CommandError, match="several databases"):
        call_command("run_worker", "--queues", "reports,default")


def test_retention_prunes_the_database_it_is_given() -> None:
    from io import StringIO

    old = {alias: Task.objects.db_manager(alias).bulk_enqueue(NOOP, [{}] * 3) for alias in ("default", "second")}
    for alias, ids in old.items():
        Task.objects.using(alias).filter(pk__in=ids).update(status="SUCCESSFUL", finished_at="2000-01-01T00:00:00Z")
    out = StringIO()
    call_command("prune_tasks", "--database", "second", "--older-than", "1d", "--busy-fraction", "1", stdout=out)
    assert "successful 3" in out.getvalue()
    assert rows("second") == [] and rows("default") == old["default"]
    with pytest.raises(CommandError, match="no database 'nowhere'"):
        call_command("prune_tasks", "--database", "nowhere")


# -- recovery ----------------------------------------------------------------------------------------


def expired_running(alias: str) -> int:
    task_id = Task.objects.db_manager(alias).enqueue(NOOP, queue="reports" if alias == "second" else "default").id
    Task.objects.using(alias).filter(pk=task_id).update(
        status="RUNNING", holder="gone", token=1, attempt_started=True, expires_at="2000-01-01T00:00:00Z"
    )
    return task_id


@pytest.mark.django_db(databases=["default", "second"], transaction=True)
def test_recovery_of_each_database_has_its_own_leader_and_recovers_only_its_tasks() -> None:
    mine, theirs = expired_running("second"), expired_running("default")
    report = recover_once(using="second")
    assert report.requeued == [mine]
    assert Task.objects.using("default").get(pk=theirs).status == "RUNNING"

    second_expired = expired_running("second")
    controllers = [RecoveryController(interval=0.1, using=alias) for alias in ("default", "second")]
    threads = [threading.Thread(target=c.run, daemon=True) for c in controllers]
    for thread in threads:
        thread.start()
    try:
        # Both lead at once: each recovery lease lives in the database it recovers.
        assert all(c.election.wait_for_leadership(10) for c in controllers)
        wait_until(lambda: Task.objects.using("second").get(pk=second_expired).status == "READY", timeout=10)
        wait_until(lambda: Task.objects.using("default").get(pk=theirs).status == "READY", timeout=10)
        for alias in ("default", "second"):
            assert Lease.objects.using(alias).active().filter(resource=RECOVERY_LEASE).count() == 1
    finally:
        for controller in controllers:
            controller.stop()
        for thread in threads:
            thread.join(10)
        connections.close_all()


# -- the JSON API -------------------------------------------------------------------------------------


def test_the_api_enqueues_by_route_and_reads_and_acts_on_the_database_asked_for(api: Api) -> None:
    status, body = api.call("POST", "/api/tasks", {"task_path": NOOP, "queue": "reports"})
    assert status == 201
    task_id = body["task"]["id"]
    assert task_id in rows("second")
    # A task id is per database: the default database has no such task (or another one).
    Task.objects.using("default").filter(pk=task_id).delete()
    assert api.call("GET", f"/api/tasks/{task_id}")[0] == 404
    status, body = api.call("GET", f"/api/tasks/{task_id}?db=second")
    assert status == 200 and body["task"]["queue"] == "reports"
    status, body = api.call("GET", "/api/tasks?db=second")
    assert [t["id"] for t in body["tasks"]] == [task_id]
    assert api.call("POST", f"/api/tasks/{task_id}/cancel?db=second")[0] == 200
    assert Task.objects.using("second").get(pk=task_id).status == "CANCELLED"
    # Asking to create in a database the queue is not routed to changes nothing.
    status, body = api.call("POST", "/api/tasks?db=default", {"task_path": NOOP, "queue": "reports"})
    assert status == 400 and body["field"] == "db" and "routed to database 'second'" in body["error"]
    assert rows("default", queue="reports") == []
    # A pause lives where the queue's claims read it.
    assert api.call("POST", "/api/queues/reports/pause", {"reason": "r"})[0] == 200
    from tasks.models import QueueControl

    assert QueueControl.objects.using("second").get(name="reports").paused
    assert not QueueControl.objects.using("default").filter(name="reports").exists()
    # Leases by namespace, likewise.
    status, body = api.call("POST", "/api/leases", {"resource": "billing:api", "holder": "h"})
    assert status == 201 and Lease.objects.using("second").filter(resource="billing:api").exists()
    assert api.call("GET", "/api/leases?db=second")[1]["leases"][0]["resource"] == "billing:api"


@pytest.mark.parametrize(
    "value",
    ["nowhere", "%00", "%ED%A0%80", "x" * 5000, "second%00", "default%20"],
    ids=["unknown", "nul", "surrogate", "very-long", "nul-suffix", "space"],
)
def test_the_api_refuses_an_unknown_database_with_400_json(api: Api, value: str) -> None:
    before = Task.objects.using("default").count() + Task.objects.using("second").count()
    for method, url, body in [
        ("GET", f"/api/tasks?db={value}", None),
        ("GET", f"/api/tasks/1?db={value}", None),
        ("POST", f"/api/tasks?db={value}", {"task_path": NOOP}),
        ("GET", f"/api/leases?db={value}", None),
    ]:
        status, answer = api.call(method, url, body)
        assert status == 400, (method, url, status)
        assert isinstance(answer["error"], str) and len(answer["error"]) < 400
    assert Task.objects.using("default").count() + Task.objects.using("second").count() == before


# -- pages, admin, metrics ------------------------------------------------------------------------------


def test_every_page_says_which_database_it_shows_and_switches(staff: Client) -> None:
    mine = Task.objects.enqueue(NOOP, queue="reports").id
    theirs = Task.objects.enqueue(NOOP).id
    for url in ["/dashboard/", "/dashboard/tasks/pending/", "/dashboard/workers/", "/dashboard/queues/", "/leases/"]:
        page = staff.get(url + "?db=second").content.decode()
        assert 'data-database="second"' in page, url
        assert 'data-switch="default"' in page, url
        default_page = staff.get(url).content.decode()
        assert 'data-database="default"' in default_page and 'data-switch="second"' in default_page
    listing = staff.get("/dashboard/tasks/pending/?db=second").content.decode()
    assert f"/dashboard/tasks/{mine}/?db=second" in listing
    assert f"/dashboard/tasks/{theirs}/" not in listing.replace(f"/dashboard/tasks/{mine}/", "")
    detail = staff.get(f"/dashboard/tasks/{mine}/?db=second")
    assert detail.status_code == 200 and "reports" in detail.content.decode()
    # An action on the page acts on the database it shows.
    staff.post("/dashboard/tasks/action/?db=second", {"action": "cancel", "ids": [mine]})
    assert Task.objects.using("second").get(pk=mine).status == "CANCELLED"
    assert Task.objects.using("default").get(pk=theirs).status == "READY"


@pytest.mark.parametrize("value", ["nowhere", "%00", "%ED%A0%80", "y" * 5000])
def test_pages_refuse_an_unknown_database(staff: Client, value: str) -> None:
    response = staff.get(f"/dashboard/?db={value}")
    assert response.status_code == 400


def test_the_admin_shows_and_acts_on_the_database_asked_for(staff: Client) -> None:
    mine = Task.objects.enqueue(NOOP, queue="reports").id
    Task.objects.using("default").filter(pk=mine).delete()
    listing = staff.get("/admin/tasks/task/?db=second")
    assert listing.status_code == 200 and f"/admin/tasks/task/{mine}/change/" in listing.content.decode()
    assert f"/admin/tasks/task/{mine}/change/" not in staff.get("/admin/tasks/task/").content.decode()
    change = staff.get(f"/admin/tasks/task/{mine}/change/?_changelist_filters=db%3Dsecond")
    assert change.status_code == 200
    staff.post("/admin/tasks/task/?db=second", {"action": "cancel", "_selected_action": [mine]})
    assert Task.objects.using("second").get(pk=mine).status == "CANCELLED"
    assert staff.get("/admin/tasks/task/?db=nowhere").status_code == 302  # dropped, with a message


@pytest.fixture
def unreachable(settings: Any) -> Iterator[None]:
    """An alias on a port nothing listens on, routed to, as a database that is down."""
    config = {**connections.settings["default"], "HOST": "127.0.0.1", "PORT": "9", "NAME": "down"}
    connections.settings["down"] = config
    settings.LEASING_TASKS = {"QUEUE_DATABASES": {"reports": "second", "void": "down"}}
    try:
        yield
    finally:
        connections["down"].close()
        del connections["down"]
        del connections.settings["down"]


# lease() commits its grants on a connection of its own: the test must clean up by flushing.
@pytest.mark.django_db(databases=["default", "second"], transaction=True)
def test_metrics_are_labelled_by_database_and_a_down_one_is_a_gauge(
    client: Client, settings: Any, unreachable: None
) -> None:
    settings.LEASING_METRICS_PUBLIC = True
    Task.objects.bulk_enqueue(NOOP, [{}] * 2, queue="reports")
    Task.objects.enqueue(NOOP)
    with lease("billing:m", ttl=30, timeout=0):
        response = client.get("/metrics")
    assert response.status_code == 200
    values = scrape_values(response.content.decode())
    assert values['tasks_queue_depth{database="second",queue="reports"}'] == 2
    assert values['tasks_queue_depth{database="default",queue="default"}'] == 1
    assert values['leasing_leases{database="second",state="active"}'] == 1
    assert values['leasing_database_up{database="default"}'] == 1
    assert values['leasing_database_up{database="second"}'] == 1
    assert values['leasing_database_up{database="down"}'] == 0
    assert known_databases() == ["default", "second", "down"]
