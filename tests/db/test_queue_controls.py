"""Pausing a queue: the claim statement reads the switch, so every worker and client obeys it."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connections

from tasks.models import NOTIFY_CHANNEL, QueueControl, Task

pytestmark = pytest.mark.django_db

NOOP = "tests.testapp.handlers.noop"


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
