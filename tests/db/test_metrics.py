from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from leasing.metrics import scrape_values
from leasing.models import Lease
from tasks.models import Task, Worker
from tests.factories import StaffFactory

pytestmark = pytest.mark.django_db


def scrape(client: Client, **headers: str) -> tuple[int, dict[str, float]]:
    response = client.get("/metrics", headers=headers)
    return response.status_code, scrape_values(response.content.decode()) if response.status_code == 200 else {}


def test_metrics_need_staff_or_a_token(client: Client, settings: Any) -> None:
    settings.LEASING_METRICS_TOKENS = ["scrape-me"]
    assert scrape(client)[0] == 401
    assert scrape(client, Authorization="Bearer wrong")[0] == 401
    assert scrape(client, Authorization="Bearer scrape-me")[0] == 200
    client.force_login(StaffFactory.create())
    assert scrape(client)[0] == 200


def test_metrics_can_be_made_public(client: Client, settings: Any) -> None:
    settings.LEASING_METRICS_PUBLIC = True
    assert scrape(client)[0] == 200


def test_metrics_report_the_cluster_from_the_database(client: Client, settings: Any) -> None:
    settings.LEASING_METRICS_PUBLIC = True
    Lease.objects.acquire("a", "h", ttl=30)
    Task.objects.bulk_enqueue("tasks.demo.sleep", [{}] * 3, queue="mail")
    stuck = Task.objects.enqueue("tasks.demo.sleep").id
    Task.objects.filter(pk=stuck).update(
        status="RUNNING",
        holder="dead",
        token=1,
        attempt_started=True,
        expires_at=timezone.now() - dt.timedelta(seconds=5),
    )
    Worker.objects.create(
        id="w1", hostname="h", pid=1, concurrency=1, stats={"rejected": 2, "heartbeats": 9, "heartbeat_failures": 1}
    )
    status, values = scrape(client)
    assert status == 200
    assert values['leasing_leases{database="default",state="active"}'] == 1
    assert values['tasks_queue_depth{database="default",queue="mail"}'] == 3
    assert values['tasks_queue_oldest_age_seconds{database="default",queue="mail"}'] >= 0
    assert values['tasks_stuck{database="default"}'] == 1
    assert values['tasks_tasks{database="default",state="stuck"}'] == 1
    assert values['tasks_workers_alive{database="default"}'] == 1
    assert values['tasks_fencing_rejections_total{database="default"}'] == 2
    assert values['tasks_heartbeats_total{database="default",result="failed"}'] == 1
    assert values['tasks_heartbeat_success_ratio{database="default"}'] == pytest.approx(0.9)

    Task.objects.recover_expired()
    _, values = scrape(client)
    assert values['tasks_recoveries_last_hour{database="default"}'] == 1
    assert values['tasks_death_to_requeue_seconds{database="default",stat="max"}'] >= 0
    assert values['tasks_stuck{database="default"}'] == 0


def test_acquisition_latency_is_observed(client: Client, settings: Any) -> None:
    settings.LEASING_METRICS_PUBLIC = True
    settings.LEASING_API_TOKENS = ["t"]
    before = scrape(client)[1].get("leasing_acquisition_seconds_count", 0)
    client.post(
        "/api/leases",
        data={"resource": "r", "holder": "h"},
        content_type="application/json",
        headers={"Authorization": "Bearer t"},
    )
    assert scrape(client)[1]["leasing_acquisition_seconds_count"] == before + 1


AGE = 'tasks_oldest_snapshot_age_seconds{database="default"}'
XIDS = 'tasks_xmin_horizon_age_transactions{database="default"}'


@pytest.mark.django_db(transaction=True)  # the test's own transaction would hold a snapshot too
def test_metrics_show_how_far_back_an_old_snapshot_holds_cleanup(client: Client, settings: Any) -> None:
    import psycopg

    from tests.helpers import test_database_url

    settings.LEASING_METRICS_PUBLIC = True
    before = scrape(client)[1]
    assert before[AGE] == 0
    assert before[XIDS] == 0
    with psycopg.connect(test_database_url()) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        row = holder.execute("SELECT now()").fetchone()
        assert row is not None
        began = row[0]
        for i in range(5):  # five commits after the snapshot: five transactions it holds back
            Task.objects.enqueue("tasks.demo.sleep", kwargs={"i": i})
        values = scrape(client)[1]
        assert 0 < values[AGE] <= (timezone.now() - began).total_seconds()
        assert values[XIDS] >= 5
        holder.rollback()
    after = scrape(client)[1]
    assert after[AGE] == 0


def table_health(client: Client) -> dict[str, float]:
    values = scrape(client)[1]
    return {
        name: values[f'tasks_table_{name}{{database="default"}}']
        for name in (
            "live_tuples",
            "dead_tuples",
            "vacuum_age_seconds",
            "analyze_age_seconds",
            "autovacuum_threshold_tuples",
            "autovacuum_enabled",
            "autovacuum_overdue_seconds",
        )
    }


def database_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        now: dt.datetime = cursor.fetchone()[0]
    return now


def add_and_delete(added: int, deleted: int) -> None:
    """``added`` tasks, then ``deleted`` of them deleted: that many dead row versions, flushed to the
    statistics now (a backend reports its counts at most once a second otherwise)."""
    Task.objects.bulk_enqueue("tasks.demo.sleep", [{}] * added, queue="health")
    with connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM tasks_task WHERE id IN "
            "(SELECT id FROM tasks_task WHERE queue = 'health' ORDER BY id LIMIT %s)",
            [deleted],
        )
        cursor.execute("SELECT pg_stat_force_next_flush()")


@pytest.fixture
def autovacuum_off() -> Iterator[None]:
    """tasks_task with autovacuum off and a threshold of 10 dead rows (its reloptions), so that what
    the test sees is what its own statements did: no autovacuum run in between."""
    with connection.cursor() as cursor:
        cursor.execute(
            "ALTER TABLE tasks_task SET (autovacuum_enabled = off, autovacuum_vacuum_threshold = 10, "
            "autovacuum_vacuum_scale_factor = 0)"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "ALTER TABLE tasks_task RESET (autovacuum_enabled, autovacuum_vacuum_threshold, "
                "autovacuum_vacuum_scale_factor)"
            )


@pytest.mark.django_db(transaction=True)  # VACUUM cannot run inside a transaction
def test_metrics_report_the_health_of_the_task_table(client: Client, settings: Any, autovacuum_off: None) -> None:
    settings.LEASING_METRICS_PUBLIC = True
    add_and_delete(40, 30)
    health = table_health(client)
    assert health["live_tuples"] == 10
    assert health["dead_tuples"] == 30
    assert health["autovacuum_threshold_tuples"] == 10  # the table's reloptions, scale factor 0
    assert health["autovacuum_enabled"] == 0
    # Over its threshold: overdue for as long as it has gone without a vacuum.
    assert health["autovacuum_overdue_seconds"] == pytest.approx(health["vacuum_age_seconds"], abs=1)
    assert health["autovacuum_overdue_seconds"] > 0

    before = database_now()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE) tasks_task")
    health = table_health(client)
    waited = (database_now() - before).total_seconds()
    assert health["dead_tuples"] == 0
    assert health["live_tuples"] == 10
    assert health["autovacuum_overdue_seconds"] == 0
    assert 0 <= health["vacuum_age_seconds"] <= waited
    assert 0 <= health["analyze_age_seconds"] <= waited

    # The settings again (no reloptions): autovacuum's own rule, threshold + scale factor x reltuples
    # (10 after the VACUUM), capped by autovacuum_vacuum_max_threshold where it exists (PostgreSQL 18).
    with connection.cursor() as cursor:
        cursor.execute(
            "ALTER TABLE tasks_task RESET (autovacuum_enabled, autovacuum_vacuum_threshold, "
            "autovacuum_vacuum_scale_factor)"
        )
        cursor.execute(
            "SELECT current_setting('autovacuum_vacuum_threshold')::float8"
            " + current_setting('autovacuum_vacuum_scale_factor')::float8 * 10"
        )
        expected = cursor.fetchone()[0]
    health = table_health(client)
    assert health["autovacuum_threshold_tuples"] == pytest.approx(expected)
    assert health["autovacuum_enabled"] == 1


@pytest.mark.django_db(transaction=True)
def test_dead_tuples_stay_after_a_vacuum_beside_an_old_snapshot(
    client: Client, settings: Any, autovacuum_off: None, old_snapshot: None
) -> None:
    """What the table-health alert and the old-snapshot alert say together: VACUUM ran (its age is
    fresh), yet the dead rows stay, because a snapshot older than their deletion may still see them."""
    settings.LEASING_METRICS_PUBLIC = True
    add_and_delete(40, 30)
    with connection.cursor() as cursor:
        cursor.execute("VACUUM tasks_task")
    health = table_health(client)
    assert health["dead_tuples"] == 30
    assert health["vacuum_age_seconds"] < 60
    assert scrape(client)[1][AGE] > 0


def test_metrics_say_which_queues_have_no_live_worker(client: Client, settings: Any) -> None:
    settings.LEASING_METRICS_PUBLIC = True
    Task.objects.bulk_enqueue("tasks.demo.sleep", [{}] * 2, queue="mail")
    Task.objects.enqueue("tasks.demo.sleep", queue="reports")
    Worker.objects.create(id="w1", hostname="h", pid=1, concurrency=1, queues=["mail", "default"])
    Worker.objects.create(id="w2", hostname="h", pid=2, concurrency=1, queues=["mail"])
    Worker.objects.create(id="gone", hostname="h", pid=3, concurrency=1, queues=["reports"], stopped_at=timezone.now())
    values = scrape(client)[1]
    assert values['tasks_queue_workers{database="default",queue="mail"}'] == 2
    assert values['tasks_queue_workers{database="default",queue="default"}'] == 1  # served, nothing waiting
    assert values['tasks_queue_workers{database="default",queue="reports"}'] == 0  # work, no live worker
    assert values['tasks_workers_alive{database="default"}'] == 2


RECOVERY_ABSENT = 'tasks_leader_absent_seconds{database="default",role="recovery"}'


def test_metrics_say_how_long_recovery_has_had_no_leader(client: Client, settings: Any) -> None:
    settings.LEASING_METRICS_PUBLIC = True
    assert scrape(client)[1][RECOVERY_ABSENT] == float("inf")  # never led in this database
    grant = Lease.objects.acquire("tasks:recovery", "worker-1", ttl=30)
    assert grant is not None
    values = scrape(client)[1]
    assert values[RECOVERY_ABSENT] == 0
    assert values['tasks_leader_absent_seconds{database="default",role="scheduler"}'] == float("inf")
    before = database_now()
    assert Lease.objects.release("tasks:recovery", "worker-1", grant.token)
    absent = scrape(client)[1][RECOVERY_ABSENT]
    assert 0 < absent <= (database_now() - before).total_seconds()
