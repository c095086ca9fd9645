"""Cluster-wide task metrics, read from the database at scrape time (see leasing.metrics)."""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connections
from django.db.models.functions import Now
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from leasing.routing import selected_database
from tasks.lifecycle import activity, concurrency
from tasks.lifecycle.workflows import WorkflowStatus
from tasks.models import UniqueKey
from tasks.web.queries import COUNT_CAP, bounded_count
from tasks.web.workflows import running_workflows

# What holds back the cleanup of the queue's dead rows in this database (docs/howto/operations.md,
# "An old snapshot"): sessions with a snapshot (backend_xmin), prepared transactions, replication
# slots, and a standby's feedback (a walsender's backend_xmin). Since PostgreSQL 14 only the
# current database's sessions hold back its tables (slots and walsenders hold every database).
# Sessions of other roles show their snapshot only to a member of pg_read_all_stats (or pg_monitor).
# One pass over a few shared-memory views: its cost is the number of connections, not of tasks.
HORIZON_SQL = """
WITH holders AS (
    SELECT COALESCE(a.xact_start, a.query_start, a.backend_start) AS since, age(a.backend_xmin) AS xids
    FROM pg_stat_activity AS a
    WHERE a.backend_xmin IS NOT NULL AND a.pid <> pg_backend_pid()
      AND a.backend_type NOT IN ('autovacuum worker', 'autovacuum launcher')  -- vacuums ignore each other
      AND (a.datname = current_database() OR a.backend_type = 'walsender')
    UNION ALL
    SELECT p.prepared, age(p.transaction) FROM pg_prepared_xacts AS p WHERE p.database = current_database()
    UNION ALL
    SELECT NULL, age(s.xmin) FROM pg_replication_slots AS s WHERE s.xmin IS NOT NULL
)
SELECT COALESCE(EXTRACT(epoch FROM clock_timestamp() - min(since)), 0)::float8, COALESCE(max(xids), 0)
FROM holders
"""

WORKER_COUNTERS = (
    "claimed",
    "succeeded",
    "retried",
    "failed",
    "snoozed",
    "discarded",
    "cancelled",
    "rejected",
    "lost",
    "heartbeats",
    "heartbeat_failures",
)


def task_metrics() -> Iterable[Metric]:
    from tasks.web.dashboard import live_workers, queue_stats, task_counts

    counts = task_counts()
    tasks = GaugeMetricFamily(
        "tasks_tasks",
        "Tasks by state, counted up to 10,000 (pending: waiting minus retrying, a lower bound beyond).",
        labels=["state"],
    )
    for state, count in counts.items():
        tasks.add_metric([state], count.value)
    yield tasks
    yield GaugeMetricFamily("tasks_stuck", "Running tasks whose lease expired (orphaned).", value=counts["stuck"].value)
    yield GaugeMetricFamily(
        "tasks_awaiting",
        "Workflow members waiting for the tasks they depend on (AWAITING), counted up to 10,000.",
        value=counts["awaiting"].value,
    )
    # Running workflows only, from the status index: the cost is the running ones, not the history.
    workflows = GaugeMetricFamily(
        "tasks_workflows", "Workflows by status: the running ones (counted up to 10,000).", labels=["status"]
    )
    workflows.add_metric([WorkflowStatus.RUNNING.value], running_workflows().value)
    yield workflows

    depth = GaugeMetricFamily(
        "tasks_queue_depth", "Runnable tasks waiting, per queue (counted up to 10,000).", labels=["queue"]
    )
    age = GaugeMetricFamily("tasks_queue_oldest_age_seconds", "Age of the oldest runnable task.", labels=["queue"])
    for queue in queue_stats():
        depth.add_metric([queue["queue"]], queue["depth"].value)
        age.add_metric([queue["queue"]], queue["oldest_age"])
    yield depth
    yield age

    # Bounded cardinality: at most concurrency.SHOWN_KEYS keys (those at their limit first), never one
    # series per key ever used.
    keys = concurrency.key_states()
    running = GaugeMetricFamily(
        "tasks_concurrency_running",
        "Tasks of a concurrency key running now (keys at their limit first).",
        labels=["key"],
    )
    limit = GaugeMetricFamily("tasks_concurrency_limit", "A concurrency key's limit.", labels=["key"])
    waiting = GaugeMetricFamily(
        "tasks_concurrency_waiting", "Tasks waiting for a slot of the key (BLOCKED), up to 10,000.", labels=["key"]
    )
    kept = GaugeMetricFamily(
        "tasks_concurrency_kept",
        "Slots of the key kept for handlers still running after a timeout or a lapsed lease.",
        labels=["key"],
    )
    for key_state in keys:
        running.add_metric([key_state.key], key_state.running)
        limit.add_metric([key_state.key], key_state.limit or 0)
        waiting.add_metric([key_state.key], key_state.waiting)
        kept.add_metric([key_state.key], key_state.kept)
    yield running
    yield limit
    yield waiting
    yield kept
    yield GaugeMetricFamily(
        "tasks_concurrency_keys_full",
        "Concurrency keys at their limit (of those shown).",
        value=sum(s.full for s in keys),
    )
    yield from window_metrics()
    yield GaugeMetricFamily("tasks_workers_alive", "Workers that heartbeated recently.", value=live_workers().count())
    yield from horizon_metrics()

    with connections[selected_database()].cursor() as cursor:
        cursor.execute(
            "SELECT key, sum(value::bigint) FROM tasks_worker, jsonb_each_text(stats) WHERE key = ANY(%s) GROUP BY key",
            [list(WORKER_COUNTERS)],
        )
        totals = dict.fromkeys(WORKER_COUNTERS, 0) | {key: int(value) for key, value in cursor.fetchall()}
    # From the per-minute rollup the recovery statement writes: at most 60 rows, whatever the table.
    recovered = activity.recoveries_last_hour()

    events = CounterMetricFamily(
        "tasks_worker_events", "Events reported by workers with their heartbeats.", labels=["event"]
    )
    for key in ("claimed", "succeeded", "retried", "failed", "snoozed", "discarded", "cancelled", "lost"):
        events.add_metric([key], totals[key])
    yield events
    yield CounterMetricFamily(
        "tasks_fencing_rejections", "Worker results refused by the compare-and-set.", value=totals["rejected"]
    )
    heartbeats = CounterMetricFamily("tasks_heartbeats", "Worker heartbeat statements.", labels=["result"])
    heartbeats.add_metric(["ok"], totals["heartbeats"])
    heartbeats.add_metric(["failed"], totals["heartbeat_failures"])
    yield heartbeats
    sent = totals["heartbeats"] + totals["heartbeat_failures"]
    ratio = totals["heartbeats"] / sent if sent else 1.0
    yield GaugeMetricFamily("tasks_heartbeat_success_ratio", "Successful / all worker heartbeats.", value=ratio)
    yield GaugeMetricFamily(
        "tasks_recoveries_last_hour", "Tasks requeued after their lease expired.", value=recovered.count
    )
    death = GaugeMetricFamily(
        "tasks_death_to_requeue_seconds",
        "Time from a holder's last heartbeat to the requeue of its task, over the last hour's recoveries.",
        labels=["stat"],
    )
    death.add_metric(["max"], recovered.silent_max)
    death.add_metric(["avg"], recovered.silent_avg)
    yield death
    yield GaugeMetricFamily(
        "tasks_expiry_to_requeue_seconds_max",
        "Longest expiry-to-requeue delay in the last hour.",
        value=recovered.delay_max,
    )


# The waiting debounced tasks, from the arbiter index's own partial predicate (tasks_task_debounce_waiting
# holds those rows and no other), at most COUNT_CAP of them: the cost is the waiting ones, not the history.
_DEBOUNCED_SQL = """
SELECT count(*), COALESCE(sum(debounces), 0)
FROM (SELECT debounces FROM tasks_task
      WHERE status IN ('BLOCKED', 'READY') AND debounce_key IS NOT NULL AND transitions = 0
      LIMIT %(limit)s) AS waiting
"""


def window_metrics() -> Iterable[Metric]:
    """Open unique_for windows and waiting debounced tasks (tasks/lifecycle/windows.py), each counted
    up to 10,000 through its own index. A refused duplicate writes nothing (that is its point), so
    refusals are not counted cluster-wide; the enqueues folded into the tasks still waiting are."""
    database = selected_database()
    open_windows = bounded_count(UniqueKey.objects.using(database).filter(expires_at__gt=Now()))
    with connections[database].cursor() as cursor:
        cursor.execute(_DEBOUNCED_SQL, {"limit": COUNT_CAP})
        waiting, folded = cursor.fetchone()
    yield GaugeMetricFamily(
        "tasks_unique_windows_open",
        "Keys whose unique_for window is open: a second enqueue of one returns its task (counted up to 10,000).",
        value=open_windows.value,
    )
    yield GaugeMetricFamily(
        "tasks_debounced_waiting", "Debounced tasks waiting to start (counted up to 10,000).", value=int(waiting)
    )
    yield GaugeMetricFamily(
        "tasks_debounces_folded",
        "Later enqueues folded into the debounced tasks now waiting (their arguments replaced, start pushed).",
        value=int(folded),
    )


def horizon_metrics() -> Iterable[Metric]:
    """How far back the oldest snapshot holds this database's cleanup: its age in seconds and in
    transactions. A queue's claims slow down as the dead rows it keeps pile up (an alert at a few
    minutes catches a forgotten transaction long before the drain suffers)."""
    with connections[selected_database()].cursor() as cursor:
        cursor.execute(HORIZON_SQL)
        seconds, xids = cursor.fetchone()
    yield GaugeMetricFamily(
        "tasks_oldest_snapshot_age_seconds",
        "Age of the oldest transaction or prepared transaction holding a snapshot in this database "
        "(no dead row newer than it can be removed; 0 when none).",
        value=max(float(seconds), 0.0),
    )
    yield GaugeMetricFamily(
        "tasks_xmin_horizon_age_transactions",
        "Transactions since the oldest snapshot, prepared transaction or replication slot that holds back cleanup.",
        value=int(xids),
    )
