from __future__ import annotations

import datetime as dt

import pytest
from django.test import Client
from django.utils import timezone

from tasks.models import Failure, Task

pytestmark = pytest.mark.django_db

URL = "/admin/tasks/task/"


def test_changelist_filters_searches_and_shows_the_lease(staff: Client) -> None:
    stuck = Task.objects.enqueue("tests.testapp.handlers.noop", dedup_key="stuck-one").id
    claimed = Task.objects.claim("w-admin", limit=1)[0]
    Task.objects.filter(pk=claimed.id).update(expires_at=timezone.now() - dt.timedelta(seconds=5))
    other = Task.objects.enqueue("tests.testapp.handlers.noop", queue="mail").id
    page = staff.get(URL, {"lease": "stuck"})
    assert [t.pk for t in page.context["cl"].result_list] == [stuck]
    assert "expired 5 s ago" in page.content.decode() or "expired" in page.content.decode()
    assert [t.pk for t in staff.get(URL, {"queue": "mail"}).context["cl"].result_list] == [other]
    assert [t.pk for t in staff.get(URL, {"q": "stuck-one"}).context["cl"].result_list] == [stuck]
    assert [t.pk for t in staff.get(URL, {"q": "w-admin"}).context["cl"].result_list] == [stuck]


def test_detail_shows_every_attempt_with_its_traceback(staff: Client) -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", max_attempts=2).id
    for attempt in (1, 2):
        claimed = Task.objects.claim("w1", limit=1)[0]
        Task.objects.fail(Failure(claimed.id, claimed.token, "x.Boom", f"boom {attempt}", f"TB-{attempt}"), "w1")
        Task.objects.filter(pk=task_id).retry_now()
    page = staff.get(f"{URL}{task_id}/change/").content.decode()
    assert "boom 1" in page
    assert "TB-2" in page


def test_actions_are_compare_and_set(staff: Client) -> None:
    waiting = Task.objects.enqueue("tests.testapp.handlers.noop").id
    running = Task.objects.enqueue("tests.testapp.handlers.noop").id
    Task.objects.filter(pk=running).update(priority=5)
    Task.objects.claim("w1", limit=1)
    staff.post(URL, {"action": "requeue", "_selected_action": [waiting, running]})
    assert Task.objects.get(pk=running).status == "RUNNING"  # requeue touches finished tasks only
    staff.post(URL, {"action": "cancel", "_selected_action": [waiting]})
    assert Task.objects.get(pk=waiting).status == "CANCELLED"
    staff.post(URL, {"action": "requeue", "_selected_action": [waiting]})
    assert Task.objects.get(pk=waiting).status == "READY"
    Task.objects.filter(pk=waiting).update(run_after=timezone.now() + dt.timedelta(hours=1))
    staff.post(URL, {"action": "retry_now", "_selected_action": [waiting]})
    assert Task.objects.runnable().filter(pk=waiting).exists()
    assert staff.get(f"{URL}add/").status_code == 403


def test_lease_admin_links_to_the_holders_tasks(staff: Client) -> None:
    from leasing.models import Lease

    Lease.objects.acquire("r", "worker-7", ttl=30)
    page = staff.get("/admin/leasing/lease/").content.decode()
    assert "/admin/tasks/task/?q=worker-7" in page


def test_queues_are_paused_and_resumed_from_the_admin(staff: Client) -> None:
    from tasks.models import QueueControl

    Task.objects.enqueue("tests.testapp.handlers.noop", queue="mail")
    response = staff.post(
        "/admin/tasks/queuecontrol/add/", {"name": "mail", "paused": "on", "reason": "smtp down"}, follow=True
    )
    assert response.status_code == 200
    control = QueueControl.objects.get(name="mail")
    assert control.paused and control.reason == "smtp down" and "(admin)" in control.changed_by
    assert Task.objects.claim("w1", queues=["mail"]) == []
    staff.post(
        "/admin/tasks/queuecontrol/",
        {"action": "resume", "_selected_action": ["mail"]},
        follow=True,
    )
    assert not QueueControl.objects.get(name="mail").paused
    assert len(Task.objects.claim("w1", queues=["mail"])) == 1


def test_search_is_exact_and_indexed(staff: Client) -> None:
    ids = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 3)
    keyed = Task.objects.enqueue("tests.testapp.handlers.fail", dedup_key="invoice:7").id

    def found(term: str) -> list[int]:
        return [t.pk for t in staff.get(URL, {"q": term}).context["cl"].result_list]

    assert found("tests.testapp.handlers.noop") == sorted(ids, reverse=True)
    assert found("noop") == sorted(ids, reverse=True)  # a task path's last part, as people type it
    assert found("noo") == []  # no substring search: it would read every row
    assert found("handlers") == []
    assert found("invoice:7") == [keyed]
    assert found(str(ids[1])) == [ids[1]]
    assert found("²") == []
    refused = staff.get(URL, {"q": "a\x00b"}, follow=True)  # NUL: the search is dropped with a message
    assert refused.status_code == 200
    assert refused.redirect_chain and "q=" not in refused.redirect_chain[-1][0]


def test_queue_filter_offers_the_queues_and_counts_stop_at_the_cap(
    staff: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.web import listings

    Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 5, queue="mail")
    Task.objects.enqueue("tests.testapp.handlers.noop", queue="reports")
    page = staff.get(URL)
    queue_filter = next(spec for spec in page.context["cl"].filter_specs if spec.title == "queue")
    assert [value for value, _ in queue_filter.lookup_choices] == ["mail", "reports"]
    assert [t.queue for t in staff.get(URL, {"queue__exact": "reports"}).context["cl"].result_list] == ["reports"]
    monkeypatch.setattr(listings, "COUNT_CAP", 3)
    capped = staff.get(URL, {"queue__exact": "mail"})
    assert capped.context["cl"].result_count == 3
    assert capped.context["cl"].paginator.capped
    assert "3+ tasks" in capped.content.decode()
