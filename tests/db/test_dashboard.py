"""The HTML dashboard: staff only, every page, bulk actions, generator control, bounded counts."""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from tasks.demo import generator
from tasks.models import Failure, Task, Worker
from tasks.web.dashboard import TASK_STATES
from tasks.web.queries import Count, bounded_count

pytestmark = pytest.mark.django_db

PAGES = ["/dashboard/", "/dashboard/workers/", "/dashboard/generator/", "/dashboard/tasks/running/"]


@pytest.mark.parametrize("url", PAGES)
def test_pages_are_staff_only(client: Client, url: str) -> None:
    assert client.get(url).status_code == 302
    client.force_login(get_user_model().objects.create_user("plain", password="pw"))
    assert client.get(url).status_code == 302


def make_tasks() -> dict[str, int]:
    ids = {
        name: Task.objects.enqueue("tests.testapp.handlers.noop", queue="q").id
        for name in ("pending", "retrying", "running", "stuck", "succeeded", "failed", "cancelled")
    }
    ids["snoozed"] = Task.objects.enqueue("tests.testapp.handlers.noop", queue="q").id
    for name in ("retrying", "snoozed", "running", "stuck", "succeeded", "failed"):
        Task.objects.filter(pk=ids[name]).update(run_after=timezone.now() - dt.timedelta(hours=1), priority=100)
        claimed = Task.objects.claim("w1", limit=1, queues=["q"], ttl=30)[0]
        assert claimed.id == ids[name]
        if name == "retrying":
            Task.objects.fail(
                Failure(claimed.id, claimed.token, "builtins.ValueError", "oops", "Traceback: boom"), "w1"
            )
            Task.objects.filter(pk=claimed.id).update(run_after=timezone.now() + dt.timedelta(hours=1))
        elif name == "snoozed":
            Task.objects.fail(
                Failure(claimed.id, claimed.token, "tasks.exceptions.Snooze", "", kind="snooze", delay=3600), "w1"
            )
        elif name == "stuck":
            Task.objects.filter(pk=claimed.id).update(expires_at=timezone.now() - dt.timedelta(seconds=3))
        elif name == "succeeded":
            Task.objects.complete(claimed.id, "w1", claimed.token, {"ok": True})
        elif name == "failed":
            Task.objects.fail(Failure(claimed.id, claimed.token, "builtins.KeyError", "dead", "", retry=False), "w1")
        Task.objects.filter(pk=claimed.id).update(priority=0)
    Task.objects.filter(pk=ids["cancelled"]).cancel()
    # Deferred under a concurrency key: it waits BLOCKED without taking its key's slot.
    later = timezone.now() + dt.timedelta(hours=1)
    ids["blocked"] = Task.objects.enqueue(
        "tests.testapp.handlers.noop", queue="q", concurrency_key="dash", concurrency_limit=1, run_after=later
    ).id
    # A workflow member waiting for the blocked one (AWAITING).
    ids["awaiting"] = Task.objects.enqueue("tests.testapp.handlers.noop", queue="q", depends_on=[ids["blocked"]]).id
    return ids


def test_overview_counts_every_state_and_charts_the_last_hour(staff: Client) -> None:
    make_tasks()
    Worker.objects.create(id="w1", hostname="h", pid=1, concurrency=2, running=1)
    response = staff.get("/dashboard/")
    assert response.status_code == 200
    counts = response.context["task_counts"]
    assert {name: count.value for name, count in counts.items()} == dict.fromkeys(TASK_STATES, 1)
    chart = response.context["chart"]
    assert chart["totals"] == {"succeeded": 1, "failed": 1, "recovered": 0}
    assert len(chart["bars"]) >= 1
    page = response.content.decode()
    assert "<svg" in page
    assert "w1" in page
    assert response.context["queues"] == [
        {"queue": "q", "depth": Count(1, capped=False), "oldest_age": pytest.approx(0, abs=60)}
    ]


@pytest.mark.parametrize("state", list(TASK_STATES))
def test_each_state_page_lists_its_tasks(staff: Client, state: str) -> None:
    ids = make_tasks()
    response = staff.get(f"/dashboard/tasks/{state}/")
    assert response.status_code == 200
    assert [task.pk for task in response.context["tasks"]] == [ids[state]]


def test_unknown_state_is_404_and_search_and_keyset_pages(staff: Client) -> None:
    assert staff.get("/dashboard/tasks/nope/").status_code == 404
    ids = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 60)
    first = staff.get("/dashboard/tasks/pending/")
    assert len(first.context["tasks"]) == 50
    assert first.context["next_before"] == ids[10]
    second = staff.get(f"/dashboard/tasks/pending/?before={ids[10]}")
    assert [t.pk for t in second.context["tasks"]] == list(reversed(ids[:10]))
    found = staff.get(f"/dashboard/tasks/pending/?q={ids[3]}")
    assert [t.pk for t in found.context["tasks"]] == [ids[3]]


def test_task_detail_shows_attempts_errors_and_tracebacks(staff: Client) -> None:
    ids = make_tasks()
    page = staff.get(f"/dashboard/tasks/{ids['retrying']}/").content.decode()
    assert "builtins.ValueError" in page
    assert "Traceback: boom" in page
    assert "w1" in page
    assert staff.get("/dashboard/tasks/999999/").status_code == 404


def test_actions_change_only_the_statuses_they_fit_and_refuse_the_rest_whole(staff: Client) -> None:
    ids = make_tasks()
    response = staff.post(
        "/dashboard/tasks/action/", {"action": "retry", "ids": [ids["failed"], ids["cancelled"]], "next": "/dashboard/"}
    )
    assert response.status_code == 302 and response["Location"] == "/dashboard/"
    assert Task.objects.get(pk=ids["failed"]).status == "READY"
    # A selection with a task the action does not fit (a running one: not retried) changes nothing.
    before = dict(Task.objects.values_list("pk", "run_after"))
    refused = staff.post("/dashboard/tasks/action/", {"action": "run_now", "ids": [ids["retrying"], ids["running"]]})
    assert refused.status_code == 409
    assert f"task {ids['running']} is Running" in refused.content.decode()
    assert dict(Task.objects.values_list("pk", "run_after")) == before
    refused = staff.post("/dashboard/tasks/action/", {"action": "cancel", "ids": [ids["pending"], ids["succeeded"]]})
    assert refused.status_code == 409
    assert Task.objects.get(pk=ids["pending"]).status == "READY"  # rolled back with the rest
    assert Task.objects.get(pk=ids["succeeded"]).status == "SUCCESSFUL"
    assert staff.post("/dashboard/tasks/action/", {"action": "cancel", "ids": [ids["pending"]]}).status_code == 302
    assert Task.objects.get(pk=ids["pending"]).status == "CANCELLED"
    assert staff.post("/dashboard/tasks/action/", {"action": "explode", "next": "/dashboard/"}).status_code == 400


def test_workers_page_shows_what_each_worker_holds(staff: Client) -> None:
    ids = make_tasks()
    Worker.objects.create(id="w1", hostname="box", pid=42, concurrency=2)
    Worker.objects.create(id="gone", hostname="box", pid=43, concurrency=2, stopped_at=timezone.now())
    response = staff.get("/dashboard/workers/")
    entry = response.context["workers"][0]
    assert entry["worker"].id == "w1"
    assert {task.pk for task in entry["tasks"]} == {ids["running"], ids["stuck"]}
    assert [w.id for w in response.context["recent"]] == ["gone"]


def test_workers_page_folds_stopped_workers_away_after_ten_minutes(staff: Client) -> None:
    now = timezone.now()
    Worker.objects.create(id="alive", hostname="box", pid=1, concurrency=2)
    for n in range(25):  # a crash-injecting demo's restarts: the newest 20 shown, folded
        Worker.objects.create(
            id=f"dead-{n:02d}",
            hostname="box",
            pid=100 + n,
            concurrency=2,
            stopped_at=now,
            stop_reason="presumed dead: no heartbeat",
        )
    old = Worker.objects.create(id="long-gone", hostname="box", pid=9, concurrency=2, stopped_at=now)
    Worker.objects.filter(pk=old.pk).update(
        stopped_at=now - dt.timedelta(minutes=20), last_seen_at=now - dt.timedelta(minutes=20)
    )
    response = staff.get("/dashboard/workers/")
    page = response.content.decode()
    assert len(response.context["recent"]) == 20 and response.context["recent_more"]
    assert "long-gone" not in page  # folded away for good: its own page and the admin keep it
    assert staff.get("/dashboard/workers/long-gone/").status_code == 200
    fold = page.split('<details id="recent-workers-fold"', 1)[1].split(">", 1)[0]
    assert "open" not in fold  # closed while a worker is alive
    assert "more than 20; of those shown, 20 dead or silent" in page
    Worker.objects.filter(pk="alive").update(last_seen_at=now - dt.timedelta(hours=1))
    page = staff.get("/dashboard/workers/").content.decode()
    assert page.split('<details id="recent-workers-fold"', 1)[1].split(">", 1)[0].strip() == "open"


def test_generator_page_starts_and_stops_through_the_database(staff: Client) -> None:
    staff.post("/dashboard/generator/", {"action": "start", "rate": "7.5"})
    assert (generator.status().running, generator.status().rate) == (True, 7.5)
    staff.post("/dashboard/generator/", {"action": "stop", "rate": ""})
    assert generator.status().running is False
    response = staff.post("/dashboard/generator/", {"action": "start", "rate": "-3"}, follow=True)
    assert "rate must be" in response.content.decode()
    assert generator.status().running is False


def test_counts_are_bounded() -> None:
    Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 30)
    count = bounded_count(Task.objects.all(), cap=20)
    assert (count.value, count.capped, str(count)) == (20, True, "20+")
    assert str(bounded_count(Task.objects.all(), cap=100)) == "30"


def test_a_page_cut_short_by_the_scan_window_says_so_and_goes_on(
    staff: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.web import listings

    monkeypatch.setattr(listings, "SCAN_WINDOW", 4)
    pending = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 2, queue="mail")
    retrying = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 6, queue="mail")
    Task.objects.filter(pk__in=retrying).update(failures=1)
    first = staff.get("/dashboard/tasks/pending/", {"queue": "mail"})
    assert first.context["tasks"] == []
    assert first.context["scanned_to"] == retrying[1] + 1  # retrying[5..2] checked, more below
    page = first.content.decode()
    assert 'id="scan-note"' in page
    assert f"?before={retrying[1] + 1}&queue=mail" in page
    second = staff.get("/dashboard/tasks/pending/", {"queue": "mail", "before": str(retrying[1] + 1)})
    assert [t.pk for t in second.context["tasks"]] == list(reversed(pending))
    assert second.context["next_before"] is None


def test_workers_page_shows_four_counters_as_columns_and_links_each_worker(staff: Client) -> None:
    stats = {"succeeded": 7, "failed": 2, "rejected": 1, "lost": 3, "claimed": 13, "heartbeats": 99}
    Worker.objects.create(id="host:1:abc", hostname="box", pid=42, concurrency=2, stats=stats)
    Worker.objects.create(
        id="host:2:def", hostname="box", pid=43, concurrency=2, stats=stats, stopped_at=timezone.now()
    )
    page = staff.get("/dashboard/workers/").content.decode()
    for table in ('id="workers"', 'id="recent-workers"'):
        header = page.split(table, 1)[1].split("</thead>", 1)[0]
        assert [h.split(">", 1)[1] for h in header.split("</th>")[-5:-1]] == [
            "Successful",
            "Failed",
            "Rejected",
            "Lost",
        ]
    assert '<td class="num">7</td><td class="num">2</td><td class="num">1</td><td class="num">3</td>' in page
    assert "claimed=" not in page and ">99<" not in page  # the rest is on the worker's own page
    assert 'href="/dashboard/workers/host:1:abc/"' in page and 'href="/dashboard/workers/host:2:def/"' in page


def test_worker_page_shows_every_counter_and_what_it_holds(staff: Client, client: Client) -> None:
    ids = make_tasks()
    stats = {"heartbeats": 99, "claimed": 13, "lost": 3, "succeeded": 7}
    Worker.objects.create(id="w1", hostname="box", pid=42, concurrency=2, stats=stats, running=2)
    response = staff.get("/dashboard/workers/w1/")
    assert response.status_code == 200
    # The four columns of the list first (zero when never counted), then the rest by name.
    assert response.context["counters"] == [
        ("succeeded", 7),
        ("failed", 0),
        ("rejected", 0),
        ("lost", 3),
        ("claimed", 13),
        ("heartbeats", 99),
    ]
    assert {task.pk for task in response.context["held"]} == {ids["running"], ids["stuck"]}
    assert response.context["alive"] is True
    page = response.content.decode()
    assert ">Stuck</span>" in page and f'href="/dashboard/tasks/{ids["running"]}/"' in page

    Worker.objects.filter(pk="w1").update(stopped_at=timezone.now(), stop_reason="presumed dead: silent for 61.0 s")
    stopped = staff.get("/dashboard/workers/w1/")
    assert stopped.context["alive"] is False
    assert "presumed dead: silent for 61.0 s" in stopped.content.decode()

    assert staff.get("/dashboard/workers/nobody/").status_code == 404
    client.logout()
    assert client.get("/dashboard/workers/w1/").status_code == 302


def test_worker_ids_with_any_character_have_a_page(staff: Client) -> None:
    odd = "pod/7 ü:#?%"
    Worker.objects.create(id=odd, hostname="box", pid=1, concurrency=1)
    page = staff.get("/dashboard/workers/").content.decode()
    link = page.split('<td class="mono"><a href="', 1)[1].split('"', 1)[0]
    assert staff.get(link).context["worker"].id == odd
