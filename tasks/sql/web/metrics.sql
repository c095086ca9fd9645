-- tasks.web.metrics: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: HORIZON_SQL
-- What holds back the cleanup of the queue's dead rows in this database (docs/howto/monitoring.md,
-- TasksOldSnapshot): sessions with a snapshot (backend_xmin), prepared transactions, replication
-- slots, and a standby's feedback (a walsender's backend_xmin). Since PostgreSQL 14 only the
-- current database's sessions hold back its tables (slots and walsenders hold every database).
-- Sessions of other roles show their snapshot only to a member of pg_read_all_stats (or pg_monitor).
-- One pass over a few shared-memory views: its cost is the number of connections, not of tasks.
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
FROM holders;

-- name: TABLE_HEALTH_SQL
-- The health of the queue table itself: what a PostgreSQL queue degrades by first. Every claim and
-- finish leaves a dead row version; until VACUUM removes them, claims step over them. Statistics and
-- catalog reads only (pg_stat_user_tables, pg_class, the settings), one row of each looked up by the
-- table's oid: the cost is the same at a thousand rows or a hundred million, and nothing reads
-- tasks_task itself. The vacuum threshold is autovacuum's own rule (src/backend/postmaster/
-- autovacuum.c, relation_needs_vacanalyze): threshold + scale factor x reltuples, the table's
-- reloptions before the settings, capped since PostgreSQL 18 by autovacuum_vacuum_max_threshold (-1:
-- no cap; current_setting(..., true) is NULL before 18). A vacuum or analyze never recorded counts
-- from when the statistics began (their reset, or the server's start): a lower bound.
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
WHERE s.relid = to_regclass(%(table)s);

-- name: LEADERS_SQL
-- The leader-elected services, by the lease each holds while it leads (tasks/maintenance/): 0 while
-- the lease is held, else the seconds since it was last held (a release sets expires_at to the release
-- time), +Inf when it never was in this database. One lookup of the resource's unique index per role.
-- Seconds rather than a 0/1 flag: a hand-over leaves a gap of up to the lease's TTL (a standby takes
-- the lease when it expires), and what to alert on is how long nothing has led, not whether a lease
-- is held at the instant of the scrape. Recovery run without the controller (``recover_tasks --once``
-- from cron, the Celery beat task) takes no lease: there this says nothing (docs/howto/monitoring.md).
SELECT role.name,
       CASE WHEN l.released_at IS NULL AND l.expires_at > clock_timestamp() THEN 0
            ELSE EXTRACT(epoch FROM clock_timestamp() - l.expires_at)::float8 END
FROM unnest(%(roles)s::text[], %(leases)s::text[]) AS role(name, lease)
LEFT JOIN leasing_lease AS l ON l.resource = role.lease;
