"""Where a fair key comes from and where fairness is configured: the JSON API (enqueue with a key,
claims that take turns even one task at a time), the django.tasks backend's OPTIONS["fair"] key
templates, and the system checks that refuse malformed settings."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tasks.checks import check_task_settings
from tasks.models import Task
from tests.helpers.api import TOKEN, Api
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fair_queue_api")]


def test_the_api_enqueues_with_a_key_and_its_claims_take_turns_one_at_a_time(api: Api) -> None:
    for key in ("a", "a", "a", "b", "b", "c"):
        status, body = api.call("POST", "/api/tasks", {"task_path": NOOP, "queue": "fair", "fair_key": key})
        assert status == 201, body
        assert body["task"]["fair_key"] == key
    served = []
    for _ in range(6):
        status, body = api.call("POST", "/api/tasks/next", {"worker": "ext", "queues": ["fair"]})
        assert status == 200, body
        served.append(body["task"]["fair_key"])
    assert served == ["a", "b", "c", "a", "b", "a"]  # without the process's cursor: a, a, a, b, b, c
    # a client's own cursor wins
    api.call("POST", "/api/tasks", {"task_path": NOOP, "queue": "fair", "fair_key": "x"})
    api.call("POST", "/api/tasks", {"task_path": NOOP, "queue": "fair", "fair_key": "y"})
    status, body = api.call("POST", "/api/tasks/next", {"worker": "ext", "queues": ["fair"], "fair_after": "x"})
    assert body["task"]["fair_key"] == "y"


def test_the_api_refuses_a_bad_key_and_creates_nothing(api: Api) -> None:
    for key in (5, "k" * 256, "nul\x00"):
        status, body = api.call("POST", "/api/tasks", {"task_path": NOOP, "queue": "fair", "fair_key": key})
        assert status == 400, (key, body)
    assert not Task.objects.exists()


def test_the_backend_fills_a_key_template_per_call(settings: Any) -> None:
    from tests.conformance.tasks import noop_task

    settings.TASKS = {
        "default": {"BACKEND": "tasks.backends.LeaseBackend", "OPTIONS": {"fair": {noop_task.module_path: "t:{0}"}}}
    }
    first, second = noop_task.enqueue(1), noop_task.enqueue(2)
    assert Task.objects.get(pk=int(first.id)).fair_key == "t:1"
    assert Task.objects.get(pk=int(second.id)).fair_key == "t:2"
    with pytest.raises(ValueError, match="does not fit"):
        noop_task.enqueue()
    assert Task.objects.count() == 2


@pytest.mark.parametrize("spec", [["a.b"], {"a.b": ""}, {"a.b": "{0.__class__}"}, {"a.b": 7}])
def test_the_backend_check_reports_a_bad_fair_mapping(settings: Any, spec: Any) -> None:
    from tasks.compat import task_backends

    settings.TASKS = {"default": {"BACKEND": "tasks.backends.LeaseBackend", "OPTIONS": {"fair": spec}}}
    assert "tasks.E016" in [e.id for e in task_backends["default"].check()]


@pytest.mark.parametrize(
    ("queues", "check"),
    [("fair", "tasks.E100"), (["fair", ""], "tasks.E120"), ([3], "tasks.E120"), (["q" * 101], "tasks.E120")],
)
def test_malformed_fair_queues_fail_the_system_check(settings: Any, queues: Any, check: str) -> None:
    settings.LEASING_TASKS = {"FAIR_QUEUES": queues}
    assert check in [e.id for e in check_task_settings()]


def test_well_formed_fair_queues_pass_the_system_check(settings: Any) -> None:
    settings.LEASING_TASKS = {"FAIR_QUEUES": ["fair", "mail"]}
    assert not [e for e in check_task_settings() if e.id in ("tasks.E100", "tasks.E120")]


def test_the_queue_page_and_api_say_a_queue_is_fair_and_how_many_keys_wait(admin_client: Any, api: Api) -> None:
    from tasks.web import queues

    for key in ("a", "b", "c"):
        Task.objects.bulk_enqueue(NOOP, [{}] * 3, queue="fair", fair_key=key)
    Task.objects.enqueue(NOOP, queue="plain")
    page = admin_client.get("/dashboard/queues/").content.decode()
    assert "fair: 3 keys" in page and "not fair" in page
    _status, body = api.call("GET", "/api/queues")
    entries = {e["name"]: e for e in body["queues"]}
    assert (entries["fair"]["fair"], entries["fair"]["fair_keys"], entries["plain"]["fair"]) == (True, 3, False)
    assert queues.fair_keys_waiting("fair") == 3


def test_the_keys_count_stops_at_its_cap(monkeypatch: Any) -> None:
    """Counting keys walks them one index probe each: it stops after KEY_CAP + 1, shown as "N+"."""
    from django.db import connection

    from tasks.web import queues

    monkeypatch.setattr(queues, "KEY_CAP", 20)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,"
            " attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,"
            " unstarted_returns, attempt_started, attempt_isolated, fair_key)"
            " SELECT 'fair', 0, %s, '[]', '{}', 'READY', now(), now(), 0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false,"
            " false, 'k' || g FROM generate_series(1, 500) AS g",
            [NOOP],
        )
    [entry] = [e for e in queues.queue_overview() if e["name"] == "fair"]
    assert (entry["fair_keys"], entry["fair_keys_capped"]) == (20, True)


def test_metrics_export_the_keys_waiting_per_fair_queue(client: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    for key in ("a", "b"):
        Task.objects.enqueue(NOOP, queue="fair", fair_key=key)
    response = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.content.decode())}
    samples = {s.labels["queue"]: s.value for s in families["tasks_fair_keys_waiting"].samples}
    assert samples == {"fair": 2}


def test_an_api_claim_returns_the_cursor_that_passes_a_key_with_nothing_due(api: Api) -> None:
    """Breaker 32's starvation through the API: a client that sends back the key of the last task it
    got went back to the oldest key whenever a key with nothing due took a turn (the fill's rows are
    that oldest key's). The reply's ``fair_after`` is where the turns went; a key with nothing due
    takes no turn (breaker 33), so the walk passes b on to c."""
    later = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)).isoformat()
    for key, run_after in (("a", None), ("a", None), ("a", None), ("b", later), ("c", None)):
        body: dict[str, Any] = {"task_path": NOOP, "queue": "fair", "fair_key": key}
        if run_after:
            body["run_after"] = run_after
        status, reply = api.call("POST", "/api/tasks", body)
        assert status == 201, reply
    served, claim = [], {"worker": "ext", "queues": ["fair"]}
    for _ in range(3):
        status, reply = api.call("POST", "/api/tasks/next", claim)
        assert status == 200, reply
        served.append(reply["task"]["fair_key"])
        claim["fair_after"] = reply["fair_after"]
    assert served == ["a", "c", "a"], served  # b (nothing due) passed over: c's turn comes next
    status, reply = api.call("POST", "/api/tasks/next", {"worker": "ext", "queues": ["plain"]})
    assert "fair_after" not in reply  # a plain queue's reply is as it was
