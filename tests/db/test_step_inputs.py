"""Hostile inputs to durable sleeps and events (issue 58): Python API and JSON API."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.utils import timezone

from tasks.exceptions import Snooze
from tasks.lifecycle.policy import MAX_DELAY
from tasks.models import Task, TaskEvent, TaskStep
from tasks.runtime import _set_current
from tasks.steps import send_event, sleep, sleep_until, wait_for_event
from tests.db.test_steps import attempt
from tests.helpers.api import Api

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "steps"
UTC = dt.timezone.utc


@pytest.fixture
def task_id() -> int:
    return Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id


@pytest.mark.parametrize(
    "when",
    [
        dt.datetime(1, 1, 1, tzinfo=UTC),
        dt.datetime(1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=14))),
        dt.datetime(1970, 1, 1, tzinfo=UTC),
    ],
    ids=["year-1", "year-1-plus-14h", "epoch"],
)
def test_a_sleep_until_the_far_past_goes_on_at_once(task_id: int, current: None, when: dt.datetime) -> None:
    _set_current(attempt(task_id, "w1"))
    sleep_until(when)
    assert TaskStep.objects.filter(task_id=task_id).count() == 1


def test_a_sleep_until_the_far_future_is_refused_before_anything_is_stored(task_id: int, current: None) -> None:
    _set_current(attempt(task_id, "w1"))
    for when in (dt.datetime(9999, 12, 31, 23, 59, tzinfo=UTC), timezone.now() + dt.timedelta(days=366)):
        with pytest.raises(ValueError, match="sleep"):
            sleep_until(when)
    for seconds in (-1, float("nan"), float("inf"), MAX_DELAY + 1, True):
        with pytest.raises(ValueError, match="sleep"):
            sleep(seconds)
    assert not TaskStep.objects.filter(task_id=task_id).exists()
    # The longest sleep is accepted and snoozes (at most a year).
    with pytest.raises(Snooze) as snoozed:
        sleep(MAX_DELAY)
    assert 0 < snoozed.value.seconds <= MAX_DELAY


def test_the_bound_of_a_sleep_until_is_read_on_the_database_clock(
    task_id: int, current: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An application server whose clock runs two years ahead of the database's: 400 days from the
    database's now is still more than the bound, however near it looks from that server."""
    _set_current(attempt(task_id, "w1"))
    real_now = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: real_now + dt.timedelta(days=730))
    with pytest.raises(ValueError, match="sleep_until"):
        sleep_until(real_now + dt.timedelta(days=400))
    assert not TaskStep.objects.filter(task_id=task_id).exists()
    # ... and a server two years behind does not refuse a wake a day ahead of the database's clock.
    monkeypatch.setattr(timezone, "now", lambda: real_now - dt.timedelta(days=730))
    with pytest.raises(Snooze) as snoozed:
        sleep_until(real_now + dt.timedelta(days=1))
    assert 0 < snoozed.value.seconds <= 86_400


@pytest.mark.parametrize("name", ["a\x00b", "\ud800"], ids=["nul", "lone-surrogate"])
def test_a_send_with_an_unstorable_name_is_a_value_error(task_id: int, name: str) -> None:
    try:
        send_event(task_id, name)
    except ValueError:
        pass
    except Exception as exc:
        pytest.fail(f"send_event({name!r}) raised {type(exc).__name__}: {exc} (not ValueError)")
    assert not TaskEvent.objects.exists()


@pytest.mark.parametrize("name", ["a\x00b", "\ud800"], ids=["nul", "lone-surrogate"])
def test_a_wait_with_an_unstorable_name_is_a_value_error_before_any_step(
    task_id: int, current: None, name: str
) -> None:
    _set_current(attempt(task_id, "w1"))
    try:
        wait_for_event(name)
    except ValueError:
        pass
    except Exception as exc:
        pytest.fail(f"wait_for_event({name!r}) raised {type(exc).__name__}: {exc} (not ValueError)")


def test_the_api_takes_unicode_names_and_refuses_hostile_payloads(client: Any, api_token: None, task_id: int) -> None:
    api = Api(client)
    url = f"/api/tasks/{task_id}/events"
    name = "\U0001f4b3" * 150  # 150 characters, 600 bytes
    assert api.call("POST", url, {"name": name, "payload": {"k": "\u00e9\u4e2d"}})[0] == 201
    assert TaskEvent.objects.get(task_id=task_id, name=name).payload == {"k": "\u00e9\u4e2d"}
    for raw in (
        '{"name": "n", "payload": {"a": ["\\u0000"]}}',
        '{"name": "n", "payload": {"\\u0000": 1}}',
        '{"name": "n\\u0000", "payload": 1}',
        '{"name": "n", "payload": "\\ud800"}',
        '{"name": "n", "payload": ' + "[" * 5000 + "]" * 5000 + "}",
        '{"name": "n", "payload": "' + "x" * 1_100_000 + '"}',
        '{"name": "n", "payload": 1e400}',
    ):
        status, body = api.call("POST", url, raw=raw)
        assert status == 400, (raw[:60], status, body)
    assert TaskEvent.objects.count() == 1
    # the largest payload the body allows is stored
    big = "y" * 990_000
    status, _ = api.call("POST", url, raw=json.dumps({"name": "big", "payload": big}))
    assert status == 201


def test_the_api_refuses_a_rerun_of_a_running_task_and_bad_positions_changing_nothing(
    client: Any, api_token: None, task_id: int, current: None
) -> None:
    from tasks.steps import step

    _set_current(attempt(task_id, "w1"))
    step("a", lambda: 1)
    _set_current(None)
    api = Api(client)
    url = f"/api/tasks/{task_id}/rerun-from-step"
    before = Task.objects.filter(pk=task_id).values().get()
    assert api.call("POST", url, {"position": 0})[0] == 409
    for bad in (
        {"position": True},
        {"position": "0"},
        {"position": -1},
        {"position": 2**31},
        {},
        {"position": 0, "x": 1},
    ):
        assert api.call("POST", url, bad)[0] == 400, bad
    assert api.call("POST", f"/api/tasks/{task_id + 99}/rerun-from-step", {"position": 0})[0] == 404
    assert Task.objects.filter(pk=task_id).values().get() == before
    assert TaskStep.objects.filter(task_id=task_id).count() == 1
