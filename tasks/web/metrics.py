"""Cluster-wide task metrics, read from the database at scrape time (see leasing.metrics)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from django.db import connections
from django.db.models.functions import Now
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from leasing.routing import selected_database
from tasks.conf import get_settings
from tasks.lifecycle import activity, concurrency, ratelimits
from tasks.lifecycle.workflows import WorkflowStatus
from tasks.maintenance.archive import HISTORY_WAIT, archive_after
from tasks.maintenance.partitions import STATUS_TABLES, day_start, horizons, partitions
from tasks.maintenance.recovery import RECOVERY_LEASE
from tasks.maintenance.repair import REPAIR_KINDS
from tasks.maintenance.scheduler import SCHEDULER_LEASE
from tasks.models import Repair, Task, TaskEvent, UniqueKey
from tasks.web.queries import COUNT_CAP, bounded_count
from tasks.web.queues import KEY_CAP, fair_keys_waiting
from tasks.web.workflows import running_workflows

# What holds back the cleanup of the queue's dead rows in this database (docs/howto/monitoring.md,
# TasksOldSnapshot): sessions with a snapshot (backend_xmin), prepared transactions, replication
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

# The health of the queue table itself: what a PostgreSQL queue degrades by first. Every claim and
# finish leaves a dead row version; until VACUUM removes them, claims step over them. Statistics and
# catalog reads only (pg_stat_user_tables, pg_class, the settings), one row of each looked up by the
# table's oid: the cost is the same at a thousand rows or a hundred million, and nothing reads
# tasks_task itself. The vacuum threshold is autovacuum's own rule (src/backend/postmaster/
# autovacuum.c, relation_needs_vacanalyze): threshold + scale factor x reltuples, the table's
# reloptions before the settings, capped since PostgreSQL 18 by autovacuum_vacuum_max_threshold (-1:
# no cap; current_setting(..., true) is NULL before 18). A vacuum or analyze never recorded counts
# from when the statistics began (their reset, or the server's start): a lower bound.
TABLE_HEALTH_SQL = """
SELECT s.n_live_tup, s.n_dead_tup, h.vacuum_age, h.analyze_age, h.threshold, h.enabled,
       CASE WHEN s.n_dead_tup > h.threshold THEN h.vacuum_age ELSE 0 END
FROM pg_stat_user_tables AS s
JOIN pg_class AS c ON c.oid = s.relid
CROSS JOIN LATERAL (
    SELECT max(option_value) FILTER (WHERE option_name = 'autovacuum_enabled') AS enabled,
           max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_threshold') AS threshold,
           max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_scale_factor') AS scale_factor,
           max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_max_threshold') AS max_threshold
    FROM pg_options_to_table(c.reloptions)
) AS o
CROSS JOIN LATERAL (
    SELECT GREATEST(d.stats_reset, pg_postmaster_start_time()) AS since
    FROM pg_stat_database AS d WHERE d.datname = current_database()
) AS stats
CROSS JOIN LATERAL (
    SELECT EXTRACT(epoch FROM clock_timestamp()
                   - COALESCE(GREATEST(s.last_vacuum, s.last_autovacuum), stats.since))::float8 AS vacuum_age,
           EXTRACT(epoch FROM clock_timestamp()
                   - COALESCE(GREATEST(s.last_analyze, s.last_autoanalyze), stats.since))::float8 AS analyze_age,
           LEAST(
               COALESCE(o.threshold, current_setting('autovacuum_vacuum_threshold'))::float8
               + COALESCE(o.scale_factor, current_setting('autovacuum_vacuum_scale_factor'))::float8
                 * GREATEST(c.reltuples, 0),
               NULLIF(COALESCE(o.max_threshold, current_setting('autovacuum_vacuum_max_threshold', true)), '-1')::float8
           ) AS threshold,
           current_setting('autovacuum')::bool AND current_setting('track_counts')::bool
           AND COALESCE(o.enabled, 'on')::bool AS enabled
) AS h
WHERE s.relid = to_regclass(%(table)s)
"""

# The leader-elected services, by the lease each holds while it leads (tasks/maintenance/): 0 while
# the lease is held, else the seconds since it was last held (a release sets expires_at to the release
# time), +Inf when it never was in this database. One lookup of the resource's unique index per role.
# Seconds rather than a 0/1 flag: a hand-over leaves a gap of up to the lease's TTL (a standby takes
# the lease when it expires), and what to alert on is how long nothing has led, not whether a lease
# is held at the instant of the scrape. Recovery run without the controller (``recover_tasks --once``
# from cron, the Celery beat task) takes no lease: there this says nothing (docs/howto/monitoring.md).
LEADERS_SQL = """
SELECT role.name,
       CASE WHEN l.released_at IS NULL AND l.expires_at > clock_timestamp() THEN 0
            ELSE EXTRACT(epoch FROM clock_timestamp() - l.expires_at)::float8 END
FROM unnest(%(roles)s::text[], %(leases)s::text[]) AS role(name, lease)
LEFT JOIN leasing_lease AS l ON l.resource = role.lease
"""
LEADER_LEASES = {"recovery": RECOVERY_LEASE, "scheduler": SCHEDULER_LEASE}

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
        "Tasks by state, counted up to 10,000 (pending: waiting minus retrying and snoozed, a lower bound beyond).",
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
    # The repair sweep's counts (tasks/maintenance/repair.py): a row per kind, zero unless a settle was lost.
    repaired = dict.fromkeys(REPAIR_KINDS, 0) | dict(
        Repair.objects.using(selected_database()).values_list("kind", "count")
    )
    repairs = CounterMetricFamily(
        "tasks_repairs",
        "Workflow members and workflows the recovery round found stranded and set right (each is a bug: report it).",
        labels=["kind"],
    )
    for kind, made in sorted(repaired.items()):
        repairs.add_metric([kind], made)
    yield repairs

    depth = GaugeMetricFamily(
        "tasks_queue_depth", "Runnable tasks waiting, per queue (counted up to 10,000).", labels=["queue"]
    )
    age = GaugeMetricFamily("tasks_queue_oldest_age_seconds", "Age of the oldest runnable task.", labels=["queue"])
    with_work = queue_stats()
    for queue in with_work:
        depth.add_metric([queue["queue"]], queue["depth"].value)
        age.add_metric([queue["queue"]], queue["oldest_age"])
    yield depth
    yield age

    # One series per queue named in FAIR_QUEUES (bounded by the settings, never by the keys).
    fair = GaugeMetricFamily(
        "tasks_fair_keys_waiting",
        f"Keys (tenants) with waiting tasks in a fair queue, counted up to {KEY_CAP:,}.",
        labels=["queue"],
    )
    for name in get_settings().FAIR_QUEUES:
        fair.add_metric([name], min(fair_keys_waiting(name), KEY_CAP))
    yield fair

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
    # Rate keys: at most ratelimits.SHOWN_KEYS, those started most recently (bounded cardinality).
    rates = ratelimits.rate_key_states()
    in_window = GaugeMetricFamily(
        "tasks_rate_starts_in_window", "Starts of a rate key in the window ending now.", labels=["key"]
    )
    rate_limit = GaugeMetricFamily("tasks_rate_limit", "Starts a rate key allows per window.", labels=["key"])
    rate_period = GaugeMetricFamily("tasks_rate_period_seconds", "A rate key's window.", labels=["key"])
    granted = CounterMetricFamily("tasks_rate_granted", "Starts a rate key granted.", labels=["key"])
    refused = CounterMetricFamily(
        "tasks_rate_refused", "Starts a rate key refused (handed back uncharged, run later).", labels=["key"]
    )
    for rate_state in rates:
        in_window.add_metric([rate_state.key], rate_state.in_window)
        rate_limit.add_metric([rate_state.key], rate_state.count)
        rate_period.add_metric([rate_state.key], rate_state.period)
        granted.add_metric([rate_state.key], rate_state.grants)
        refused.add_metric([rate_state.key], rate_state.refusals)
    yield in_window
    yield rate_limit
    yield rate_period
    yield granted
    yield refused
    yield GaugeMetricFamily(
        "tasks_rate_keys_full", "Rate keys at their limit now (of those shown).", value=sum(s.full for s in rates)
    )
    yield from window_metrics()
    # Durable events (tasks/steps.py) not yet taken: sent to a task running now, or to one that waits
    # for another name, or not yet at its wait. From the undelivered events' partial index, capped.
    undelivered = bounded_count(TaskEvent.objects.using(selected_database()).filter(delivered=False))
    yield GaugeMetricFamily(
        "tasks_events_undelivered",
        "Durable events sent that no waiting task has been woken for yet (counted up to 10,000).",
        value=undelivered.value,
    )
    alive = list(live_workers().values_list("queues", flat=True))
    yield GaugeMetricFamily("tasks_workers_alive", "Workers that heartbeated recently.", value=len(alive))
    # Per queue with runnable tasks or a live worker: a queue with work and no worker is the one
    # case a growing backlog cannot fix by itself. The cost is the live workers, not the tasks.
    serving = GaugeMetricFamily(
        "tasks_queue_workers",
        "Live workers serving the queue (each queue with runnable tasks or a live worker).",
        labels=["queue"],
    )
    served: dict[str, int] = dict.fromkeys((str(queue["queue"]) for queue in with_work), 0)
    for queues in alive:
        for name in dict.fromkeys(queues or []):
            served[str(name)] = served.get(str(name), 0) + 1
    for name, workers in served.items():
        serving.add_metric([name], workers)
    yield serving
    yield from leader_metrics()
    yield from horizon_metrics()
    yield from table_health_metrics()
    yield from partition_metrics()
    yield from archive_metrics()

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


def table_health_metrics() -> Iterable[Metric]:
    """The queue table's own health from the statistics: its live and dead row versions, how long
    since it was last vacuumed and analyzed, autovacuum's threshold for it, and how long it has been
    over that threshold without a vacuum (autovacuum lagging: every worker busy elsewhere, turned
    off, or cancelled again and again by a lock)."""
    with connections[selected_database()].cursor() as cursor:
        cursor.execute(TABLE_HEALTH_SQL, {"table": Task._meta.db_table})
        row = cursor.fetchone()
    if row is None:  # no statistics for it (not yet migrated): nothing to say, rather than zeros
        return
    live, dead, vacuum_age, analyze_age, threshold, enabled, overdue = row
    yield GaugeMetricFamily(
        "tasks_table_live_tuples", "Live row versions of tasks_task (statistics estimate).", value=int(live)
    )
    yield GaugeMetricFamily(
        "tasks_table_dead_tuples",
        "Dead row versions of tasks_task that VACUUM has not removed yet (statistics estimate).",
        value=int(dead),
    )
    yield GaugeMetricFamily(
        "tasks_table_vacuum_age_seconds",
        "Seconds since the last VACUUM or autovacuum of tasks_task (none recorded: since the statistics began).",
        value=max(float(vacuum_age), 0.0),
    )
    yield GaugeMetricFamily(
        "tasks_table_analyze_age_seconds",
        "Seconds since the last ANALYZE or autoanalyze of tasks_task (none recorded: since the statistics began).",
        value=max(float(analyze_age), 0.0),
    )
    yield GaugeMetricFamily(
        "tasks_table_autovacuum_threshold_tuples",
        "Dead row versions above which autovacuum vacuums tasks_task (its reloptions, else the settings).",
        value=float(threshold),
    )
    yield GaugeMetricFamily(
        "tasks_table_autovacuum_enabled",
        "1 when autovacuum may vacuum tasks_task (autovacuum and track_counts on, autovacuum_enabled not off).",
        value=1 if enabled else 0,
    )
    yield GaugeMetricFamily(
        "tasks_table_autovacuum_overdue_seconds",
        "While tasks_task has more dead row versions than its autovacuum threshold: seconds since its last "
        "vacuum (0 when under the threshold).",
        value=max(float(overdue), 0.0),
    )


def leader_metrics() -> Iterable[Metric]:
    """How long each leader-elected service (recovery, the scheduler) has had no leader here."""
    with connections[selected_database()].cursor() as cursor:
        cursor.execute(LEADERS_SQL, {"roles": list(LEADER_LEASES), "leases": list(LEADER_LEASES.values())})
        rows = cursor.fetchall()
    absent = GaugeMetricFamily(
        "tasks_leader_absent_seconds",
        "0 while the service's leader lease is held; else seconds since it was last held (+Inf: never here).",
        labels=["role"],
    )
    for role, seconds in rows:
        absent.add_metric([role], math.inf if seconds is None else max(float(seconds), 0.0))
    yield absent


def partition_metrics() -> Iterable[Metric]:
    """The partitions of finished tasks (tasks/maintenance/partitions.py), per final status: how many,
    their bytes, how many days ahead of today (UTC, on the database's clock) the last one reaches,
    and the age of the oldest day kept. Catalog reads: the cost is the partitions, not the rows."""
    database = selected_database()
    found = partitions(database)
    with connections[database].cursor() as cursor:
        cursor.execute("SELECT (clock_timestamp() AT TIME ZONE 'UTC')::date, clock_timestamp()")
        today, now = cursor.fetchone()
    count = GaugeMetricFamily(
        "tasks_finished_partitions",
        "Day partitions of tasks_finished (finished tasks moved out of tasks_task), per final status.",
        labels=["status"],
    )
    size = GaugeMetricFamily(
        "tasks_finished_partition_bytes",
        "Bytes of tasks_finished's partitions with their indexes and TOAST, per final status.",
        labels=["status"],
    )
    ahead = GaugeMetricFamily(
        "tasks_finished_days_ahead",
        "Days from today (UTC) to the last day partition created, per final status: 0 when only today's "
        "exists, -1 when today's is missing (-Inf: none at all). The recovery leader keeps FINISHED_DAYS_AHEAD.",
        labels=["status"],
    )
    oldest = GaugeMetricFamily(
        "tasks_finished_oldest_day_age_seconds",
        "Seconds since the start of the oldest day partition kept, per final status (0: none).",
        labels=["status"],
    )
    for horizon in horizons(found):
        status = horizon.status
        count.add_metric([status], horizon.count)
        size.add_metric([status], horizon.bytes)
        days = horizon.days_ahead(today)
        ahead.add_metric([status], -math.inf if days is None else days)
        age = 0.0 if horizon.oldest_day is None else (now - day_start(horizon.oldest_day)).total_seconds()
        oldest.add_metric([status], max(age, 0.0))
    yield from (count, size, ahead, oldest)


# The mover's progress marks (tasks_archiveprogress: three rows) against the database clock.
_ARCHIVE_PROGRESS_SQL = (
    "SELECT status, extract(epoch FROM statement_timestamp() - moved_until)::float8 FROM tasks_archiveprogress"
)


def archive_metrics() -> Iterable[Metric]:
    """How far the mover (tasks/maintenance/archive.py) trails the latest finish time it could have
    reached, per final status, with ARCHIVE_AFTER set (nothing while it is None): the age of its
    progress mark less the longer of ARCHIVE_AFTER and HISTORY_WAIT (the most a task waits for its
    hour's count), at least 0; +Inf before its first batch of the status. Steady, it stays within
    a pass's interval (RETENTION_INTERVAL) of 0; it grows while the mover cannot keep up, is not
    running, or the history rollup it waits for is late. Three primary-key rows, whatever the tables."""
    behind = GaugeMetricFamily(
        "tasks_archive_behind_seconds",
        "Seconds the mover's progress (finished tasks moved out of tasks_task) trails the latest it could "
        "have reached: max(ARCHIVE_AFTER, 70 min) ago; +Inf before its first batch. Absent while ARCHIVE_AFTER "
        "is None (the mover off).",
        labels=["status"],
    )
    try:
        after = archive_after()
    except ValueError:  # tasks.E123 says why; the mover moves nothing meanwhile
        after = None
    if after is not None:
        with connections[selected_database()].cursor() as cursor:
            cursor.execute(_ARCHIVE_PROGRESS_SQL)
            ages = dict(cursor.fetchall())
        wait = max(after, HISTORY_WAIT).total_seconds()
        for status in STATUS_TABLES:
            age = ages.get(status)
            behind.add_metric([status], math.inf if age is None else max(age - wait, 0.0))
    yield behind
