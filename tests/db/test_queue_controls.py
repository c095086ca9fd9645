"""Pausing a queue: the claim statement reads the switch, so every worker and client obeys it."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connections

from tasks.models import NOTIFY_CHANNEL, QueueControl, Task
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db


def ids(queues: list[str], limit: int = 10) -> list[int]:
    return [c.id for c in Task.objects.claim("w1", limit=limit, queues=queues)]


@pytest.mark.parametrize("take_isolated", [True, False], ids=["idle", "busy"])
def test_a_paused_queue_gives_nothing_to_one_queue_and_several_queue_claims(take_isolated: bool) -> None:
    mail = Task.objects.enqueue(NOOP, queue="mail").id
    bulk = Task.objects.enqueue(NOOP, queue="bulk", priority=5).id
    QueueControl.objects.pause("mail", by="test", reason="incident 42")
    assert Task.objects.claim("w1", limit=10, queues=["mail"], take_isolated=take_isolated) == []
    claimed = Task.objects.claim("w1", limit=10, queues=["mail", "bulk"], take_isolated=take_isolated)
    assert [c.id for c in claimed] == [bulk]  # the other queue flows on
    assert Task.objects.get(pk=mail).status == "READY"  # enqueueing and waiting are untouched
    QueueControl.objects.resume("mail", by="test")
    assert ids(["mail", "bulk"]) == [mail]


def test_pausing_leaves_running_tasks_to_finish() -> None:
    Task.objects.enqueue(NOOP, queue="mail")
    running = Task.objects.claim("w1", queues=["mail"], start=True)[0]
    QueueControl.objects.pause("mail")
    assert Task.objects.complete_many("w1", [(running.id, running.token, "1")]) == {running.key}
    assert Task.objects.heartbeat("w1", []) == set()


@pytest.mark.django_db(transaction=True)
def test_resume_wakes_listening_workers() -> None:
    listener = connections["default"].get_new_connection(connections["default"].get_connection_params())
    try:
        listener.autocommit = True
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        QueueControl.objects.pause("mail")
        QueueControl.objects.resume("mail")
        payloads = [n.payload for n in listener.notifies(timeout=1.0, stop_after=1)]
    finally:
        listener.close()
    assert payloads == ["mail"]


@pytest.mark.parametrize("name", ["", "x" * 101])
def test_a_queue_name_out_of_range_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="queue must be"):
        QueueControl.objects.pause(name)
    assert not QueueControl.objects.exists()


def test_the_command_pauses_resumes_and_reports() -> None:
    Task.objects.enqueue(NOOP, queue="mail")
    out = StringIO()
    call_command("tasks_queue", "pause", "mail", reason="smtp down", stdout=out)
    assert "mail: paused, 1 waiting, 0 running" in out.getvalue()
    assert "smtp down" in out.getvalue()
    assert ids(["mail"]) == []
    out = StringIO()
    call_command("tasks_queue", "status", stdout=out)
    assert out.getvalue().startswith("mail: paused")
    call_command("tasks_queue", "resume", "mail", stdout=StringIO())
    assert QueueControl.objects.paused_names() == []
    assert len(ids(["mail"])) == 1
    with pytest.raises(CommandError, match="needs a queue name"):
        call_command("tasks_queue", "pause")
    with pytest.raises(CommandError, match="queue must be"):
        call_command("tasks_queue", "pause", "x" * 101)


def test_a_pause_costs_the_claim_one_probe_not_a_scan(django_assert_num_queries: Any) -> None:
    Task.objects.bulk_enqueue(NOOP, [{}] * 50, queue="mail")
    QueueControl.objects.pause("other")
    with django_assert_num_queries(1):
        assert len(ids(["mail"], limit=5)) == 5


@pytest.mark.usefixtures("api_token")
def test_the_api_lists_pauses_and_resumes_queues(client: Any) -> None:
    from tests.helpers.api import Api

    api = Api(client)
    Task.objects.bulk_enqueue(NOOP, [{}] * 3, queue="mail")
    status, body = api.call("POST", "/api/queues/mail/pause", {"reason": "smtp down"})
    assert status == 200, body
    assert body["queue"]["paused"] is True and body["queue"]["waiting"] == 3
    assert body["queue"]["reason"] == "smtp down"
    assert ids(["mail"]) == []
    status, body = api.call("GET", "/api/queues")
    assert status == 200
    assert [(q["name"], q["paused"], q["waiting"]) for q in body["queues"]] == [("mail", True, 3)]
    status, body = api.call("POST", "/api/queues/mail/resume")
    assert status == 200 and body["queue"]["paused"] is False
    assert len(ids(["mail"])) == 3


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/api/queues/" + "x" * 101 + "/pause", {}),
        ("/api/queues/a%00b/pause", {}),
        ("/api/queues/mail/pause", {"reason": "a\u0000b"}),
        ("/api/queues/mail/pause", {"reason": 7}),
        ("/api/queues/mail/pause", {"reason": "x" * 501}),
    ],
)
@pytest.mark.usefixtures("api_token")
def test_a_refused_pause_changes_nothing(client: Any, url: str, body: Any) -> None:
    from tests.helpers.api import Api

    status, answer = Api(client).call("POST", url, body)
    assert status == 400, answer
    assert "error" in answer
    assert not QueueControl.objects.exists()


def test_the_dashboard_page_lists_pauses_and_resumes(admin_client: Any) -> None:
    Task.objects.enqueue(NOOP, queue="mail")
    page = admin_client.get("/dashboard/queues/")
    assert page.status_code == 200 and b"mail" in page.content
    response = admin_client.post("/dashboard/queues/", {"name": "mail", "action": "pause", "reason": "smtp"})
    assert response.status_code == 302
    assert QueueControl.objects.get(name="mail").paused
    assert b"paused" in admin_client.get("/dashboard/queues/").content
    admin_client.post("/dashboard/queues/", {"name": "mail", "action": "resume"})
    assert not QueueControl.objects.get(name="mail").paused
    admin_client.post("/dashboard/queues/", {"name": "", "action": "pause"})
    assert QueueControl.objects.count() == 1  # a refused name changes nothing


def test_the_overview_costs_a_probe_per_queue_not_a_scan_of_the_backlog() -> None:
    from tasks.web.queues import COUNT_CAP, queue_overview

    Task.objects.bulk_enqueue(NOOP, [{}] * (COUNT_CAP + 5), queue="bulk")
    Task.objects.bulk_enqueue(NOOP, [{}] * 2, queue="mail")
    QueueControl.objects.pause("empty")
    entries = {e["name"]: e for e in queue_overview()}
    assert set(entries) == {"bulk", "mail", "empty"}
    assert (entries["bulk"]["waiting"], entries["bulk"]["waiting_capped"]) == (COUNT_CAP, True)
    assert (entries["mail"]["waiting"], entries["mail"]["waiting_capped"]) == (2, False)
    assert entries["empty"]["paused"] and entries["empty"]["waiting"] == 0


def test_the_overview_counts_tasks_waiting_for_a_concurrency_slot(admin_client: Any) -> None:
    """A queue whose only waiting tasks wait for a slot of their key (BLOCKED) is listed, and they are
    counted apart from the claimable ones."""
    from tasks.web.queues import queue_overview

    for _ in range(4):
        Task.objects.enqueue(NOOP, queue="keyed", concurrency_key="smtp", concurrency_limit=1)
    Task.objects.enqueue(NOOP, queue="mail")
    Task.objects.filter(queue="keyed", status="READY").update(queue="other")  # "keyed" keeps only BLOCKED rows
    entries = {e["name"]: e for e in queue_overview()}
    assert set(entries) == {"keyed", "other", "mail"}
    assert (entries["keyed"]["waiting"], entries["keyed"]["blocked"], entries["keyed"]["blocked_capped"]) == (
        0,
        3,
        False,
    )
    assert (entries["other"]["waiting"], entries["other"]["blocked"]) == (1, 0)
    assert (entries["mail"]["waiting"], entries["mail"]["blocked"]) == (1, 0)
    page = admin_client.get("/dashboard/queues/")
    assert b"/dashboard/tasks/blocked/?queue=keyed" in page.content


def test_the_command_reports_an_idle_queue_and_tasks_waiting_for_a_slot() -> None:
    out = StringIO()
    call_command("tasks_queue", "status", "idle", stdout=out)
    assert out.getvalue() == "idle: running, 0 waiting, 0 running\n"
    for _ in range(3):
        Task.objects.enqueue(NOOP, queue="keyed", concurrency_key="smtp", concurrency_limit=1)
    out = StringIO()
    call_command("tasks_queue", "status", "keyed", stdout=out)
    assert out.getvalue() == "keyed: running, 1 waiting (2 more waiting for a concurrency slot), 0 running\n"
    with pytest.raises(CommandError, match="unknown database"):
        call_command("tasks_queue", "pause", "keyed", database="nowhere")
    assert not QueueControl.objects.exists()
