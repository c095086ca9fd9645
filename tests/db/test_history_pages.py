"""The history page and ``GET /api/history``: what they show of the rollup, filters, bad input, and that
they read the rollup only (never tasks_task), with plans that stay on its index."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client

from tasks.maintenance.history import BUCKETS, roll_up_hours
from tasks.models import ActivityHour, ActivityHourMark
from tasks.web import history as views
from tests.db.test_history import PATH, finished, hour_ago, known_hour
from tests.factories import StaffFactory
from tests.helpers.api import TOKEN, check_answer
from tests.helpers.plans import explained

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("api_token")]


def get_api(client: Client, query: str = "") -> tuple[int, Any]:
    response = client.get(f"/api/history{query}", headers={"Authorization": f"Bearer {TOKEN}"})
    check_answer(response)
    return response.status_code, json.loads(response.content)


@pytest.fixture
def counted() -> None:
    """The hand-computed hour 3 hours ago (tests/db/test_history.py, with its one q1 task of the next
    hour) and a task of another path in q2 an hour later, all counted."""
    known_hour(hour_ago(3))
    finished(hour_ago(2), path="tests.testapp.handlers.echo", run=2.5, wait=0.05, queue="q2")
    roll_up_hours()


@pytest.mark.usefixtures("counted")
def test_the_api_serves_the_hours_the_totals_and_the_keys(client: Client) -> None:
    status, body = get_api(client, "?hours=24")
    assert status == 200
    assert body["hours"] == 24 and len(body["series"]) == 24
    hour = next(entry for entry in body["series"] if entry["hour"] == hour_ago(3).isoformat())
    # The two keys of that hour summed: q1 (8 ok, 2 failed, 1 cancelled) and q2 (1 ok).
    assert (hour["succeeded"], hour["failed"], hour["cancelled"], hour["attempt_failures"]) == (9, 2, 1, 6)
    assert hour["counted"] is True
    totals = body["totals"]
    assert (totals["succeeded"], totals["failed"], totals["finished"]) == (11, 2, 14)
    assert totals["failure_ratio"] == pytest.approx(2 / 13)
    q1 = next(key for key in body["keys"] if key["queue"] == "q1")
    # By hand, q1 over both its hours (tests/db/test_history.py): runs 0.03, 0.3 x5, 3 x3, 30, 700 s;
    # p50 is rank 5.5 of 11, the 4.5th of 5 in [0.2, 0.5); p99 rank 10.89, 0.89 into [500, 700].
    # Waits 1.5 s x9, 15 s x2: p95 is rank 10.45, 1.45 of 2 into [10, 15].
    assert q1["run_seconds"]["p50"] == pytest.approx(0.2 + 0.3 * 4.5 / 5)
    assert q1["run_seconds"]["p99"] == pytest.approx(500 + 200 * 0.89)
    assert q1["wait_seconds"]["p95"] == pytest.approx(10 + 5 * 1.45 / 2)
    assert q1["run_seconds"]["max"] == pytest.approx(700.0)
    assert body["keys"][0]["queue"] == "q1"  # busiest first


@pytest.mark.usefixtures("counted")
def test_the_api_filters_by_queue_and_task_path(client: Client) -> None:
    status, body = get_api(client, "?queue=q2")
    assert status == 200
    assert body["hours"] == 168
    assert (body["totals"]["succeeded"], body["totals"]["failed"]) == (2, 0)
    status, body = get_api(client, "?queue=q2&task_path=tests.testapp.handlers.echo&hours=5")
    assert body["totals"]["succeeded"] == 1
    assert body["totals"]["run_seconds"]["p50"] == pytest.approx(2.25)  # rank 0.5 of one in [2, 2.5]: capped by its max
    assert [key["task_path"] for key in body["keys"]] == ["tests.testapp.handlers.echo"]
    status, body = get_api(client, f"?task_path={PATH}&queue=nowhere")
    assert body["totals"]["finished"] == 0 and body["keys"] == []


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("?hours=0", "hours"),
        ("?hours=169", "hours"),
        ("?hours=abc", "hours"),
        ("?hours=-1", "hours"),
        ("?queue=" + "q" * 101, "queue"),
        ("?task_path=%00x", "task_path"),
        ("?window=3", "window"),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(client: Client, query: str, field: str) -> None:
    status, body = get_api(client, query)
    assert status == 400
    assert body.get("field") == field, body


def test_the_api_needs_credentials(client: Client) -> None:
    assert client.get("/api/history").status_code in (401, 403)


@pytest.mark.usefixtures("counted")
def test_the_page_draws_the_charts_with_the_data(staff: Client) -> None:
    response = staff.get("/dashboard/history/?hours=24")
    assert response.status_code == 200
    html = response.content.decode()
    assert html.count('class="chart history-chart"') == 4
    assert 'data-empty="false"' in html and 'data-empty="true"' not in html
    hour = hour_ago(3)
    assert f"{hour:%Y-%m-%d %H:00} successful: 9" in html
    assert f"{hour:%Y-%m-%d %H:00} failed: 2" in html
    # The run time chart, both keys summed: 0.004, 0.03, 0.3 x4 ...: p50 is rank 5.5 of 11, 3.5 of 4
    # into [0.2, 0.5).
    assert f"{hour:%Y-%m-%d %H:00} p50: {(0.2 + 0.3 * 3.5 / 4) * 1000:.3g} ms" in html
    assert 'id="history-keys"' in html and "q1" in html and "tests.testapp.handlers.echo" in html
    filtered = staff.get("/dashboard/history/?queue=q2").content.decode()
    assert f"{hour:%Y-%m-%d %H:00} successful: 1" in filtered


def test_the_page_is_staff_only_and_refuses_bad_filters(client: Client) -> None:
    assert client.get("/dashboard/history/").status_code == 302
    client.force_login(get_user_model().objects.create_user("plain", password="pw"))
    assert client.get("/dashboard/history/").status_code == 302
    client.force_login(StaffFactory.create())
    response = client.get("/dashboard/history/?hours=9999")
    assert response.status_code == 400
    assert "Filter refused: hours must be a whole number from 1 to 168" in response.content.decode()
    empty = client.get("/dashboard/history/").content.decode()
    assert "No finished task counted in these hours." in empty
    assert empty.count('data-empty="true"') == 4


def test_history_hours_bounds_the_window(client: Client, settings: Any) -> None:
    settings.LEASING_TASKS = {"HISTORY_HOURS": 24}
    assert get_api(client, "?hours=25")[0] == 400
    status, body = get_api(client)
    assert status == 200 and len(body["series"]) == 24


def test_the_statements_read_the_rollup_only() -> None:
    """Every statement is EXPLAINed over a rollup of 168 hours x 200 keys: none reads tasks_task,
    and the hours are a range of the rollup's unique index."""
    zeros = [0] * BUCKETS
    start = hour_ago(168)
    with connection.cursor() as cursor:  # one statement: the ORM's bulk_create of 33,600 rows took 20 s
        cursor.execute(
            """
            INSERT INTO tasks_activityhour (hour, queue, task_path, succeeded, failed, cancelled,
                attempt_failures, timed, wait_sum, wait_max, run_sum, run_max, wait_buckets, run_buckets)
            SELECT %(start)s::timestamptz + (%(now)s::timestamptz - %(start)s::timestamptz) * h / 168,
                   'q' || (k %% 10), 'app.jobs.t' || k, 1, 0, 0, 0, 0, 0, 0, 0, 0, %(zeros)s, %(zeros)s
            FROM generate_series(0, 167) AS h, generate_series(0, 199) AS k
            """,
            {"start": start, "now": hour_ago(0), "zeros": zeros},
        )
    assert ActivityHour.objects.count() == 168 * 200
    ActivityHourMark.objects.bulk_create(
        ActivityHourMark(hour=start + (hour_ago(0) - start) * h / 168, counted_at=start) for h in range(168)
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_activityhour")
    params = {"hours": 6, "queue": "q3", "task_path": None, "limit": views.SHOWN_KEYS}
    for sql in (views.HOURS_SQL, views.KEYS_SQL, views.OPTIONS_SQL):
        plan = json.dumps(explained(sql, params))
        assert "tasks_task" not in plan.replace("tasks_taskx", "")
        assert "tasks_activityhour_key" in plan, plan[:2000]
        assert (
            '"Seq Scan", "Parallel Aware": false, "Async Capable": false, "Relation Name": "tasks_activityhour"'
            not in plan
        )


def test_a_zero_percentile_is_drawn_on_the_floor_of_the_scale() -> None:
    start = hour_ago(2)
    zero = views.Hour(
        start,
        True,
        views.Totals.of((1, 0, 0, 0, 1, 0.0, 0.0, 0.0, 0.0, [1] + [0] * (BUCKETS - 1), [1] + [0] * (BUCKETS - 1))),
    )
    none = views.Hour(start + dt.timedelta(hours=1), True, views.Totals.of((0,) * 9 + ([0] * BUCKETS, [0] * BUCKETS)))
    chart = views.percentile_chart([zero, none], "run", title="run")
    assert not chart["empty"]
    p50 = next(line for line in chart["lines"] if line["name"] == "p50")
    assert [dot["title"] for dot in p50["dots"]] == [f"{start:%Y-%m-%d %H:00} p50: 0 ms"]
    assert p50["dots"][0]["y"] == chart["plot"]  # the floor
