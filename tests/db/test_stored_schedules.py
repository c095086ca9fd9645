"""Schedules stored at runtime (admin, JSON API): validated like settings schedules, a rejected write
changes nothing, settings schedules stay read-only, and the scheduler follows every change within one
round: no back-fill on create, edit or resume, nothing while paused, nothing after delete, and no slot
enqueued under a definition after the edit replacing it commits (two real connections)."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
from django.db import transaction
from django.test import Client

from leasing.models import Lease
from tasks.maintenance.scheduler import (
    SCHEDULER_LEASE,
    DefinitionChanged,
    Scheduler,
    ScheduleState,
    SlotWriter,
    database_now,
)
from tasks.models import Schedule, ScheduleRun, StoredSchedule, Task
from tests.factories import StaffFactory
from tests.helpers import iso_time, wait_until
from tests.helpers.api import TOKEN, Api
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

OTHER = "tests.testapp.handlers.record"  # importable, not on the allow-list


@pytest.fixture(autouse=True)
def declared_and_stored(settings: Any) -> None:
    settings.LEASING_TASKS = {
        "API_TASKS": [NOOP],
        "SCHEDULES": {"nightly": {"task": NOOP, "cron": "30 2 * * *"}},
    }
    settings.LEASING_API_TOKENS = [TOKEN, "reader:tasks.view_schedule"]


def tick(**extra: Any) -> dict[str, Any]:
    return {"name": "tick", "task": NOOP, "interval": 1, "catch_up": "all", **extra}


def snapshot() -> list[tuple[Any, ...]]:
    return list(StoredSchedule.objects.values_list("name", "entry", "paused", "revision", "effective_from"))


# -- the API -------------------------------------------------------------------------------------


def test_create_read_patch_put_pause_resume_delete(api: Api) -> None:
    status, body = api.call("POST", "/api/schedules", tick(kwargs={"n": 1}))
    assert status == 201, body
    assert body["kind"] == "stored" and not body["paused"]
    first = body["revision"]
    assert body["definition"]["task"] == NOOP and body["definition"]["kwargs"] == {"n": 1}

    status, body = api.call("GET", "/api/schedules")
    kinds = {s["name"]: (s["kind"], s["paused"]) for s in body["schedules"]}
    assert kinds == {"nightly": ("settings", False), "tick": ("stored", False)}
    status, body = api.call("GET", "/api/schedules/tick")
    assert status == 200 and body["schedule"]["kind"] == "stored" and body["schedule"]["next_run"]

    # PATCH merges into the entry (null removes a key), PUT replaces it; each bumps the revision.
    status, body = api.call("PATCH", "/api/schedules/tick", {"kwargs": {"n": 2}, "catch_up": None})
    assert status == 200, body
    second = body["revision"]
    assert second > first and body["entry"] == {"task": NOOP, "interval": 1, "kwargs": {"n": 2}}
    status, body = api.call("PUT", "/api/schedules/tick", {"task": NOOP, "cron": "*/5 * * * *", "revision": second})
    assert status == 200 and body["entry"] == {"task": NOOP, "cron": "*/5 * * * *"} and body["revision"] > second
    third = body["revision"]
    before = snapshot()
    status, body = api.call("PATCH", "/api/schedules/tick", {"interval": 5, "cron": None, "revision": second})
    assert status == 409 and body["field"] == "revision"
    assert snapshot() == before

    status, body = api.call("POST", "/api/schedules/tick/pause")
    assert status == 200 and body["paused"] and body["revision"] > third
    paused = body["revision"]
    assert api.call("POST", "/api/schedules/tick/pause")[1]["revision"] == paused  # paused already: no write
    listed = api.call("GET", "/api/schedules")[1]["schedules"]
    assert [s["paused"] for s in listed if s["name"] == "tick"] == [True]
    status, body = api.call("POST", "/api/schedules/tick/resume")
    assert status == 200 and not body["paused"] and body["revision"] > paused
    resumed = body["revision"]

    status, body = api.call("DELETE", "/api/schedules/tick")
    assert status == 200 and body == {"deleted": "tick", "revision": resumed}
    assert not StoredSchedule.objects.exists()
    assert api.call("DELETE", "/api/schedules/tick")[0] == 404
    assert api.call("PATCH", "/api/schedules/tick", {"interval": 2})[0] == 404
    assert api.call("POST", "/api/schedules/tick/pause")[0] == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (tick(cron="61 * * * *", interval=None), "cron"),
        (tick(interval=None, cron="* * *"), "cron"),
        (tick(interval=None), "cron"),  # neither cron nor interval
        (tick(cron="* * * * *"), "cron"),  # both
        (tick(task="tests.testapp.handlers.no_such_thing"), "task"),
        (tick(task="os.system"), "task"),  # not on the allow-list
        (tick(task=OTHER), "task"),  # importable, but not allowed
        (tick(task="tests.testapp.handlers._private"), "task"),
        (tick(interval=None, cron="0 * * * *", timezone="Mars/Olympus"), "timezone"),
        (tick(interval=None, cron="0 * * * *", timezone="../../etc/passwd"), "timezone"),
        (tick(interval=None, cron="0 " * 5000), "cron"),  # huge
        (tick(queue="q" * 101), "queue"),
        (tick(name="x" * 101), "name"),
        (tick(name="bad name!"), "name"),
        (tick(args="not a list"), "args"),
        (tick(args={"a": 1}), "args"),
        (tick(kwargs=[1, 2]), "kwargs"),
        (tick(interval="60"), "interval"),
        (tick(interval=0), "interval"),
        (tick(interval=True), "interval"),
        (tick(priority=1.5), "priority"),
        (tick(priority=1000), "priority"),
        (tick(max_attempts=0), "max_attempts"),
        (tick(timeout=-1), "timeout"),
        (tick(catch_up="sometimes"), "catch_up"),
        (tick(grace=[1]), "grace"),
        (tick(paused="yes"), "paused"),
        (tick(enabled=False), "enabled"),
        (tick(surprise=1), "entry"),
        (tick(revision=3), "revision"),
        ({"task": NOOP, "interval": 1}, "name"),  # no name
    ],
)
def test_a_hostile_body_is_a_400_naming_the_field_and_writes_nothing(api: Api, body: Any, field: str) -> None:
    status, reply = api.call("POST", "/api/schedules", body)
    assert status == 400, reply
    assert reply["field"] == field and reply["error"]
    assert not StoredSchedule.objects.exists()


@pytest.mark.parametrize(
    "raw",
    [
        '{"name": "tick", "task": "tests.testapp.handlers.noop", "interval": 1, "kwargs": {"a": "\\u0000"}}',
        '{"name": "tick\\u0000", "task": "tests.testapp.handlers.noop", "interval": 1}',
        '{"name": "tick", "task": "tests.testapp.handlers.noop", "interval": 1, "queue": "q\\u0000"}',
        '{"name": "tick", "task": "tests.testapp.handlers.noop", "interval": NaN}',
        '{"name": "tick", "task": "tests.testapp.handlers.noop", "interval": 1e999}',
        '["not", "an", "object"]',
        "not json at all",
    ],
)
def test_nul_and_non_json_bodies_are_refused(api: Api, raw: str) -> None:
    status, reply = api.call("POST", "/api/schedules", raw=raw)
    assert status == 400 and reply["error"]
    assert not StoredSchedule.objects.exists()


def test_a_rejected_edit_changes_nothing(api: Api) -> None:
    assert api.call("POST", "/api/schedules", tick())[0] == 201
    before = snapshot()
    for method, body in [
        ("PATCH", {"cron": "bad"}),
        ("PATCH", {"task": OTHER}),
        ("PATCH", {"interval": None}),
        ("PUT", {"interval": 1}),  # a PUT without the task
        ("PATCH", {"name": "renamed"}),
        ("PATCH", {"args": "x"}),
    ]:
        status, reply = api.call(method, "/api/schedules/tick", body)
        assert status == 400, (method, body, reply)
    assert snapshot() == before


def test_settings_schedules_are_read_only_and_their_names_taken(api: Api) -> None:
    for method, url, body in [
        ("POST", "/api/schedules", tick(name="nightly")),
        ("PATCH", "/api/schedules/nightly", {"interval": 5}),
        ("PUT", "/api/schedules/nightly", {"task": NOOP, "interval": 5}),
        ("DELETE", "/api/schedules/nightly", None),
        ("POST", "/api/schedules/nightly/pause", None),
        ("POST", "/api/schedules/nightly/resume", None),
    ]:
        status, reply = api.call(method, url, body)
        assert status == 409 and "settings" in reply["error"], (method, url, reply)
    assert not StoredSchedule.objects.exists()
    assert api.call("POST", "/api/schedules", tick())[0] == 201
    status, reply = api.call("POST", "/api/schedules", tick(interval=2))
    assert status == 409 and StoredSchedule.objects.get().entry["interval"] == 1


def test_the_api_needs_a_caller_with_the_permission(client: Client) -> None:
    assert Api(client, headers={}).call("POST", "/api/schedules", tick())[0] == 401
    reader = Api(client, headers={"Authorization": "Bearer reader"})
    assert reader.call("GET", "/api/schedules")[0] == 200
    assert reader.call("POST", "/api/schedules", tick())[0] == 403
    assert reader.call("DELETE", "/api/schedules/tick")[0] == 403
    assert reader.call("POST", "/api/schedules/tick/pause")[0] == 403
    client.force_login(StaffFactory.create(is_superuser=False))
    assert Api(client, headers={}).call("POST", "/api/schedules", tick())[0] == 403
    assert not StoredSchedule.objects.exists()


# -- the admin -----------------------------------------------------------------------------------


def form(**fields: Any) -> dict[str, Any]:
    base = {"name": "tick", "task": NOOP, "interval": "1", "catch_up": "all", "args": "", "kwargs": '{"n": 1}'}
    return {k: v for k, v in {**base, **fields}.items() if v is not None}


def test_admin_add_edit_pause_resume_delete(staff: Client) -> None:
    url = "/admin/tasks/storedschedule/"
    page = staff.post(url + "add/", form(cron="61 * * * *", interval=""))
    assert page.status_code == 200 and "invalid cron expression" in page.content.decode()
    page = staff.post(url + "add/", form(task=OTHER))
    assert page.status_code == 200 and "API_TASKS" in page.content.decode()
    page = staff.post(url + "add/", form(name="nightly"))
    assert page.status_code == 200 and "declared in settings" in page.content.decode()
    assert not StoredSchedule.objects.exists()

    assert staff.post(url + "add/", form()).status_code == 302
    row = StoredSchedule.objects.get()
    assert row.entry == {"task": NOOP, "interval": 1.0, "catch_up": "all", "kwargs": {"n": 1}}
    first = row.revision
    change = url + "tick/change/"
    assert "tick" in staff.get(change).content.decode()
    assert staff.post(change, form(kwargs='{"n": 2}', revision=str(first))).status_code == 302
    row = StoredSchedule.objects.get()
    assert row.entry["kwargs"] == {"n": 2} and row.revision > first
    edited = row.revision
    stale = staff.post(change, form(kwargs='{"n": 3}', revision=str(first)))  # edited from a page read before
    assert stale.status_code == 200 and "changed meanwhile" in stale.content.decode()
    assert StoredSchedule.objects.get().revision == edited

    staff.post(url, {"action": "pause_selected", "_selected_action": ["tick"]})
    assert StoredSchedule.objects.get().paused
    staff.post(url, {"action": "resume_selected", "_selected_action": ["tick"]})
    row = StoredSchedule.objects.get()
    assert not row.paused and row.revision > edited
    assert staff.post(url + "tick/delete/", {"post": "yes"}).status_code == 302
    assert not StoredSchedule.objects.exists()


def test_the_admin_needs_the_permission(client: Client) -> None:
    client.force_login(StaffFactory.create(is_superuser=False))
    assert client.post("/admin/tasks/storedschedule/add/", form()).status_code == 403
    assert not StoredSchedule.objects.exists()


def test_the_dashboard_marks_each_kind_and_the_paused_state(staff: Client, api: Api) -> None:
    api.call("POST", "/api/schedules", tick(paused=True))
    page = staff.get("/dashboard/schedules/").content.decode()
    row = page.split('data-schedule="tick"')[1].split("</tr>")[0]
    assert "stored" in row and "schedule-paused" in row
    row = page.split('data-schedule="nightly"')[1].split("</tr>")[0]
    assert "settings" in row and "paused" not in row


# -- the scheduler -------------------------------------------------------------------------------


class Leader:
    """A scheduler leading on this test's connection: refresh (one query) and a round, as ``_lead`` does."""

    def __init__(self) -> None:
        grant = Lease.objects.acquire(SCHEDULER_LEASE, "sched-a", 30)
        assert grant is not None
        self.writer = SlotWriter(holder="sched-a", token=grant.token)
        self.scheduler = Scheduler(schedules={}, ttl=30)
        self.states: dict[str, ScheduleState] = {}

    def round(self) -> list[Any]:
        self.scheduler.refresh(self.writer, self.states)
        return self.scheduler.round(self.writer, self.states).enqueued


def backdate(name: str, seconds: float) -> dt.datetime:
    """The schedule was stored ``seconds`` ago (the scheduler reads it only now)."""
    moment = database_now() - dt.timedelta(seconds=seconds)
    StoredSchedule.objects.filter(name=name).update(effective_from=moment)
    return moment


def tasks_with(kwargs: dict[str, Any]) -> list[Task]:
    return [t for t in Task.objects.filter(task_path=NOOP) if t.kwargs == kwargs]


def test_the_scheduler_reads_the_stored_schedules_in_one_query(api: Api, django_assert_num_queries: Any) -> None:
    api.call("POST", "/api/schedules", tick())
    api.call("POST", "/api/schedules", tick(name="other", interval=60))
    leader = Leader()
    leader.round()  # the first read syncs each schedule's progress row
    with django_assert_num_queries(1):
        leader.scheduler.refresh(leader.writer, leader.states)


def test_a_new_schedule_runs_the_slots_after_it_was_stored_and_none_before(api: Api) -> None:
    api.call("POST", "/api/schedules", tick(kwargs={"v": 1}))
    stored_at = backdate("tick", 5.5)
    # A progress row from an earlier schedule of that name, long ago: not a reason to back-fill.
    Schedule.objects.create(name="tick", baseline_at=stored_at - dt.timedelta(hours=1), fence_token=0)
    enqueued = Leader().round()
    first = stored_at.replace(microsecond=0) + dt.timedelta(seconds=1)
    assert [r.slot for r in enqueued][:5] == [first + dt.timedelta(seconds=k) for k in range(5)]
    assert len(tasks_with({"v": 1})) == len(enqueued)
    assert all(t.api_origin for t in Task.objects.all())  # the worker checks the allow-list again


def test_an_edit_is_followed_from_the_next_slot_and_missed_old_slots_are_not_back_filled(api: Api) -> None:
    api.call("POST", "/api/schedules", tick(kwargs={"v": 1}))
    backdate("tick", 3.5)
    leader = Leader()
    old = len(leader.round())
    assert old >= 3
    status, body = api.call("PATCH", "/api/schedules/tick", {"kwargs": {"v": 2}})
    assert status == 200
    edited_at = iso_time(body["effective_from"])
    StoredSchedule.objects.filter(name="tick").update(effective_from=edited_at)
    # The round after the edit enqueues the new definition's slots only, the first after the edit.
    enqueued = wait_until(lambda: leader.round(), 10, interval=0.05, what="a slot after the edit")
    assert all(r.slot > edited_at for r in enqueued)
    assert len(tasks_with({"v": 1})) == old and len(tasks_with({"v": 2})) == len(enqueued) >= 1


def test_a_paused_schedule_enqueues_nothing_and_resumes_without_back_fill(api: Api) -> None:
    api.call("POST", "/api/schedules", tick())
    leader = Leader()
    leader.round()
    # The first round may have enqueued a slot already due (a second went by since the POST on a
    # loaded machine): what counts is that nothing more comes while paused and on resume.
    before = Task.objects.count()
    assert api.call("POST", "/api/schedules/tick/pause")[0] == 200
    # Paused for ten seconds: the slots of that time are due now...
    Schedule.objects.filter(name="tick").update(last_slot=database_now() - dt.timedelta(seconds=10))
    StoredSchedule.objects.filter(name="tick").update(effective_from=database_now() - dt.timedelta(seconds=10))
    assert leader.round() == []  # ... and not enqueued while paused
    assert api.call("POST", "/api/schedules/tick/resume")[0] == 200
    assert leader.round() == []  # nor on resume (catch-up "all" notwithstanding)
    assert Task.objects.count() == before
    resumed = wait_until(lambda: leader.round(), 10, interval=0.05, what="the first slot after the resume")
    assert len(resumed) >= 1 and Task.objects.count() == before + len(resumed)


def test_a_deleted_schedule_stops_and_keeps_its_history(api: Api) -> None:
    api.call("POST", "/api/schedules", tick())
    backdate("tick", 2.5)
    leader = Leader()
    ran = len(leader.round())
    assert ran >= 2
    api.call("DELETE", "/api/schedules/tick")
    assert leader.round() == []
    assert "tick" not in leader.scheduler.schedules
    assert ScheduleRun.objects.filter(schedule="tick").count() == ran and Schedule.objects.filter(name="tick").exists()


def test_an_edit_committed_after_the_round_read_the_schedule_refuses_the_old_definition(api: Api) -> None:
    api.call("POST", "/api/schedules", tick(kwargs={"v": 1}))
    backdate("tick", 4.5)
    leader = Leader()
    leader.scheduler.refresh(leader.writer, leader.states)  # the round has read the first revision
    assert api.call("PATCH", "/api/schedules/tick", {"kwargs": {"v": 2}})[0] == 200  # committed
    with pytest.raises(DefinitionChanged):
        leader.scheduler.round(leader.writer, leader.states)
    assert not Task.objects.exists()  # no slot under the old definition after the edit committed
    leader.round()
    assert not tasks_with({"v": 1})


def test_an_edit_in_flight_holds_the_slot_statement_which_then_enqueues_nothing(api: Api) -> None:
    """Two real connections: the operator's edit has updated the row and not committed; the leader's
    slot statement (which read the first revision) waits for it on the row's share lock, then finds
    the next one and writes nothing: no slot is enqueued under a definition its replacement committed over."""
    api.call("POST", "/api/schedules", tick(kwargs={"v": 1}))
    backdate("tick", 2.5)
    leader = Leader()
    leader.scheduler.refresh(leader.writer, leader.states)
    row = StoredSchedule.objects.get()
    edited, release = threading.Event(), threading.Event()

    def edit() -> None:
        with transaction.atomic():
            StoredSchedule.objects.replace_stored(
                "tick", {**row.entry, "kwargs": {"v": 2}}, paused=False, revision=row.revision
            )
            edited.set()
            assert release.wait(30)

    operator = OnItsOwnConnection(edit)
    operator.start()
    assert edited.wait(30)
    scheduler = OnItsOwnConnection(lambda: leader.scheduler.round(leader.writer, leader.states))
    scheduler.start()
    assert scheduler.ready.wait(30)
    wait_until(lambda: waits_for_a_lock(scheduler.pid), 10, interval=0.02, what="the slot statement to wait")
    release.set()
    operator.outcome()
    with pytest.raises(DefinitionChanged):
        scheduler.outcome()
    assert not Task.objects.exists() and not ScheduleRun.objects.exists()
    assert StoredSchedule.objects.get().revision > row.revision


def test_a_slot_statement_in_flight_commits_first_and_the_edit_waits_for_it(api: Api) -> None:
    """The other order: the leader's statement holds the share lock (its transaction open), the edit
    waits for it; the slot it enqueued is the old definition's, committed before the edit."""
    api.call("POST", "/api/schedules", tick(kwargs={"v": 1}))
    backdate("tick", 1.5)
    leader = Leader()
    leader.scheduler.refresh(leader.writer, leader.states)
    wrote, release = threading.Event(), threading.Event()

    def slot() -> Any:
        with transaction.atomic():
            report = leader.scheduler.round(leader.writer, leader.states)
            wrote.set()
            assert release.wait(30)
        return report

    scheduler = OnItsOwnConnection(slot)
    scheduler.start()
    assert wrote.wait(30)
    operator = OnItsOwnConnection(lambda: Api(Client()).call("PATCH", "/api/schedules/tick", {"kwargs": {"v": 2}}))
    operator.start()
    assert operator.ready.wait(30)
    wait_until(lambda: waits_for_a_lock(operator.pid), 10, interval=0.02, what="the edit to wait")
    release.set()
    enqueued = len(scheduler.outcome().enqueued)
    assert enqueued >= 1
    assert operator.outcome()[0] == 200
    assert len(tasks_with({"v": 1})) == enqueued
    runs = list(ScheduleRun.objects.all())
    assert len(runs) == enqueued and max(r.enqueued_at for r in runs) < StoredSchedule.objects.get().updated_at
