"""Recovery: what the recovery leader sends when a lease expired (the worker died or hung): the
attempt requeued, charged when attributable, FAILED after MAX_CRASHES; stray leases, orphans of
stopped workers, dead workers; and the fate of attempts a worker asks about after a lost reply."""

from __future__ import annotations

from tasks.lifecycle.fragments import WAITING_STATUS, append_error
from tasks.lifecycle.policy import backoff_sql

_NO_LEASE = "(t.expires_at IS NULL OR t.holder IS NULL OR t.token IS NULL)"
# Handed to an executor by its worker (the ``handed`` CTE of RECOVER_EXPIRED_SQL: its holder's row names its
# token) while its start marker had not committed: it may have run, so it counts as begun (invariant 14).
_HANDED = f"(handed.id IS NOT NULL AND NOT t.attempt_started AND NOT {_NO_LEASE})"
_STARTED = f"((t.attempt_started OR {_HANDED}) AND NOT {_NO_LEASE})"
# Whose fault was it? The worker's heartbeat renews every attempt it holds and stamps its own row
# (last_seen_at, and the beat before it in previous_seen_at) in the same statement. If the SAME
# incarnation of the worker (started before this claim) stamped its row between this attempt's last
# renewal (+ ttl/6 margin: beats are ttl/3 apart) and its expiry, the worker lived on without renewing
# this attempt: the attempt itself stalled, and the crash is the task's. Stamps after the expiry do
# not count (a frozen worker that thaws before recovery runs, or a restart under the same id). An
# attempt that ran isolated (nothing else in its process, abandoned threads included) is the task's
# too. Otherwise the worker vanished with several attempts in it and nobody can tell which one killed
# it: a *shared* crash, charged to no one; after ISOLATE_AFTER of them the task runs isolated.
_WORKER_OUTLIVED = """EXISTS (
    SELECT 1 FROM tasks_worker AS w
    WHERE w.id = t.holder AND w.started_at <= t.acquired_at
      AND (w.last_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.last_seen_at < t.expires_at
        OR w.previous_seen_at > COALESCE(t.renewed_at, t.acquired_at) + make_interval(secs => w.ttl / 6)
           AND w.previous_seen_at < t.expires_at))"""
_ATTRIBUTABLE = f"(t.attempt_isolated OR {_WORKER_OUTLIVED})"


def _stalled_in_live_worker(alias: str, last_renewed: str) -> str:
    """The attempt's worker has not stopped and stamped its row after the attempt's last renewal (plus
    the beats' margin): it lived on, so the attempt's handler may still be running there."""
    return f"""EXISTS (
        SELECT 1 FROM tasks_worker AS w
        WHERE w.id = {alias}.holder AND w.stopped_at IS NULL
          AND w.last_seen_at > {last_renewed} + make_interval(secs => w.ttl / 6))"""


_CRASHED = f"({_STARTED} AND {_ATTRIBUTABLE})"
_SHARED = f"({_STARTED} AND NOT {_ATTRIBUTABLE})"
_STILL_ALLOWED = f"(NOT {_CRASHED} OR t.crashes + 1 < %(max_crashes)s)"
# A keyed attempt that stalled while its worker lived on keeps its key slot for its handler (the kept
# CTE of RECOVER_EXPIRED_SQL), so the task gives up the slot of its row and waits BLOCKED: it runs again
# when the key has room, never beside its own stalled handler.
_KEEPS_SLOT = (
    f"(t.concurrency_key IS NOT NULL AND {_CRASHED}"
    f" AND {_stalled_in_live_worker('t', 'COALESCE(t.renewed_at, t.acquired_at)')})"
)

_RECOVERY_ENTRY = f"""jsonb_build_object(
        'attempt', t.attempts + {_HANDED}::int, 'worker', t.holder, 'token', t.token, 'at', clock_timestamp(),
        'started_at', CASE WHEN {_HANDED} THEN t.acquired_at WHEN {_STARTED} THEN t.last_attempted_at END,
        'position', CASE WHEN {_STARTED} THEN jsonb_array_length(t.worker_ids) + {_HANDED}::int END,
        'kind', CASE WHEN {_CRASHED} THEN 'crash' WHEN {_SHARED} THEN 'vanished' WHEN {_NO_LEASE} THEN 'orphan'
                     ELSE 'returned' END,
        'exception_class_path', 'tasks.exceptions.TaskLeaseLost',
        'message', CASE WHEN {_CRASHED} THEN 'lease expired: the attempt stalled or killed its worker (charged)'
                        WHEN {_SHARED} THEN 'lease expired: its worker vanished with other attempts (not charged)'
                        WHEN {_NO_LEASE} THEN 'orphan: running without a lease; repaired by recovery'
                        ELSE 'lease expired before the attempt was known to start: returned uncharged' END,
        'traceback', '',
        'expired_at', t.expires_at,
        'recovery_delay', EXTRACT(EPOCH FROM clock_timestamp() - t.expires_at),
        'silent_for', EXTRACT(EPOCH FROM clock_timestamp() - COALESCE(t.renewed_at, t.acquired_at)))"""

# Requeue tasks whose lease expired (their worker died or stalled) and running rows without a lease
# (impossible states, repaired). An attempt that never started goes back uncharged, keeping its place;
# so does a shared crash (the first keeps its place: a crash is rarely the task's fault, and behind a
# long backlog "runnable again" would otherwise mean "runs minutes later"). From ISOLATE_AFTER shared
# crashes on, the task runs isolated, so its next crash is attributable. Attributable crashes back
# off after the first and after MAX_CRASHES the task is FAILED: a poison pill stops killing workers.
# One statement per batch; a row's classification is read under its row lock. A keyed attempt that
# stalled in a worker that lived on (charged as a crash, its worker stamped its row after the attempt's
# last renewal and has not stopped) may still be running its handler: its key slot is kept in
# tasks_concurrencyhold by the same statement, so the admission this requeue triggers (at the end of
# the statement, seeing the insert) does not hand the slot on (tasks/lifecycle/concurrency.py).
# What it recovered is added to the current minute of the activity rollup in the same statement
# (tasks/lifecycle/activity.py reads it), so the chart and /metrics count every recovery once.
#
# An attempt its worker had handed to an executor counts as started even if its marker never
# committed (invariant 14; tasks/worker/handoff.py): its start is charged here (``attempts``,
# ``worker_ids``; its times no earlier than its claim) and its end is a crash like any started
# attempt's. ``handed`` reads the holder's row with a lock (FOR KEY SHARE: it waits for no update of
# the worker's, which take no key lock), so it reads the newest committed names rather than the
# statement's snapshot: a round committed after that snapshot may have handed the attempt over. A
# round not committed yet has handed nothing: once it commits, the executor finds the lease gone (the
# worker's local deadline comes before the expiry recovery saw) and gives the claim back.
#
# Two picks. The full one reads every entry of tasks_task_running_exp_idx up to now, and finds the
# impossible states (no lease, no holder). Beside an old snapshot every RUNNING version a task ever
# had keeps its entry there (its expires_at long past), so that scan steps over the whole history
# since the snapshot. The windowed one (``after``: the database time of the last scan's start, less
# RECOVERY_MARGIN) reads only the leases that expired since: a range of the index, as long as the
# leases that ended in it, whatever the history. The recovery leader runs it between full scans
# (tasks/maintenance/recovery.py, RecoveryWindow).
_PICK_EXPIRED = """
    WHERE status = 'RUNNING'
      AND (expires_at <= clock_timestamp() OR expires_at IS NULL OR holder IS NULL OR token IS NULL)
    ORDER BY expires_at NULLS FIRST"""
_PICK_EXPIRED_SINCE = """
    WHERE status = 'RUNNING' AND expires_at > %(after)s::timestamptz AND expires_at <= clock_timestamp()
    ORDER BY expires_at"""


# The recovered leases on the activity chart (tasks/lifecycle/activity.py): how many this minute, how
# long each was silent since its last renewal, and how long past its expiry it was found.
_RECORD_RECOVERED = """), timed AS (
    -- tasks_task as it was before the statement (one snapshot): each recovered lease's last renewal
    SELECT EXTRACT(EPOCH FROM clock_timestamp() - COALESCE(held.renewed_at, held.acquired_at))::float8 AS silent,
           recovered.expired_for
    FROM recovered JOIN tasks_task AS held ON held.id = recovered.id
), recorded AS (
    INSERT INTO tasks_activityminute AS a
        (minute, succeeded, failed, closed, final, recovered, silent_total, silent_max, delay_max)
    SELECT date_trunc('minute', clock_timestamp()), 0, 0, false, false, count(*),
           COALESCE(sum(silent), 0), COALESCE(max(silent), 0), COALESCE(max(expired_for), 0)
    FROM timed
    HAVING count(*) > 0
    ON CONFLICT (minute) DO UPDATE SET
        recovered = a.recovered + EXCLUDED.recovered,
        silent_total = a.silent_total + EXCLUDED.silent_total,
        silent_max = GREATEST(a.silent_max, EXCLUDED.silent_max),
        delay_max = GREATEST(a.delay_max, EXCLUDED.delay_max)
)
"""


def _recover_expired(pick: str) -> str:
    return f"""
WITH picked AS MATERIALIZED (
    SELECT id, expires_at, holder, token FROM tasks_task{pick}
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), handed AS MATERIALIZED (
    SELECT p.id FROM picked AS p JOIN tasks_worker AS w ON w.id = p.holder
    WHERE p.token = ANY(w.handed)
    FOR KEY SHARE OF w
), recovered AS (
UPDATE tasks_task AS t SET
    status = CASE WHEN NOT {_STILL_ALLOWED} THEN 'FAILED'
                  WHEN {_CRASHED} AND t.crashes > 0 THEN {WAITING_STATUS}  -- backs off
                  WHEN {_KEEPS_SLOT} THEN 'BLOCKED'  -- its stalled handler keeps the slot
                  ELSE 'READY' END,
    run_after = CASE WHEN NOT {_STILL_ALLOWED} OR NOT {_CRASHED} OR t.crashes = 0
                     THEN LEAST(t.run_after, clock_timestamp())
                     ELSE clock_timestamp() + {backoff_sql("t.crashes - 1")} END,
    finished_at = CASE WHEN {_STILL_ALLOWED} THEN NULL ELSE clock_timestamp() END,
    crashes = t.crashes + {_CRASHED}::int,
    shared_crashes = t.shared_crashes + {_SHARED}::int,
    unstarted_returns = t.unstarted_returns + (NOT {_STARTED} AND NOT {_NO_LEASE})::int,
    attempts = t.attempts + {_HANDED}::int,
    worker_ids = CASE WHEN {_HANDED} THEN t.worker_ids || jsonb_build_array(t.holder) ELSE t.worker_ids END,
    started_at = CASE WHEN {_HANDED} THEN COALESCE(t.started_at, t.acquired_at) ELSE t.started_at END,
    last_attempted_at = CASE WHEN {_HANDED} THEN t.acquired_at ELSE t.last_attempted_at END,
    attempt_started = false,
    attempt_isolated = false,
    snoozed_at = NULL,  -- as after any failure: it waits for this attempt's end now, not a snooze
    {append_error(_RECOVERY_ENTRY)},
    released_at = clock_timestamp(),
    expires_at = LEAST(t.expires_at, clock_timestamp())
FROM picked LEFT JOIN handed ON handed.id = picked.id
WHERE t.id = picked.id
RETURNING t.id, t.status, EXTRACT(EPOCH FROM clock_timestamp() - picked.expires_at)::float8 AS expired_for,
          -- a grant is recovered at most once: a last error entry with this token was just added
          t.errors -> -1 ->> 'kind' AS kind,
          t.concurrency_key, t.token, t.holder, COALESCE(t.renewed_at, t.acquired_at) AS last_renewed,
          t.queue, t.attempts  -- with the holder: the fields of recovery's log record about the task
), kept AS (
    INSERT INTO tasks_concurrencyhold (key, task_id, token, worker, reason)
    SELECT r.concurrency_key, r.id, r.token, r.holder, 'lapsed' FROM recovered AS r
    WHERE r.concurrency_key IS NOT NULL AND r.kind = 'crash' AND {_stalled_in_live_worker("r", "r.last_renewed")}
    ON CONFLICT DO NOTHING
{_RECORD_RECOVERED}SELECT id, status, expired_for, kind, queue, attempts, holder FROM recovered
"""


# Recovery's full scan: every lapsed lease (and impossible state) from the front of the expiry index;
# each row requeued, backed off, kept BLOCKED for its stalled handler's slot, or FAILED past its limits,
# in one statement with the error entry, the kept slot and the activity record (_recover_expired).
RECOVER_EXPIRED_SQL = _recover_expired(_PICK_EXPIRED)
# The windowed scan between full ones: the same, for the leases that expired since the last scan's
# start (less RECOVERY_MARGIN): a range of the expiry index, whatever the history beside an old snapshot.
RECOVER_EXPIRED_SINCE_SQL = _recover_expired(_PICK_EXPIRED_SINCE)

# A lease left live on a row that is not running (it can only come from hand edits or a bug):
# release it, so the lease state querysets and the dashboard stay truthful.
RELEASE_STRAY_LEASES_SQL = """
UPDATE tasks_task SET released_at = clock_timestamp(), expires_at = LEAST(expires_at, clock_timestamp())
WHERE status <> 'RUNNING' AND released_at IS NULL AND expires_at IS NOT NULL
RETURNING id
"""

# Running tasks held by a worker that has already said it stopped (or was found dead): it will never
# heartbeat or finish them, so there is no reason to wait for the TTL. Expire them now; recovery
# requeues them.
# Only workers that stopped within twice their TTL: an older one's leases have all expired (its last
# renewal was before it stopped), and recovery's own pick takes those. Its rows are found by their
# live leases (expires_at still ahead: tasks_task_running_exp_idx) with the holder test hidden from
# the planner: a holder index once held every RUNNING version the stopped worker ever had, which an
# old snapshot kept (the holder index has no running rows since migration 0045; the expiry index is
# still the one read, whatever the planner thinks of a holder's share of the running set).
EXPIRE_ORPHANS_SQL = """
UPDATE tasks_task AS t SET expires_at = clock_timestamp()
FROM tasks_worker AS w
WHERE t.status = 'RUNNING' AND t.expires_at > clock_timestamp() AND COALESCE(t.holder, '') = w.id
  AND w.stopped_at IS NOT NULL AND w.stopped_at > clock_timestamp() - make_interval(secs => 2 * w.ttl)
RETURNING t.id
"""

# Workers that have not been seen for more than twice their own TTL are dead (SIGKILL, power loss):
# say so, with the reason, so the workers page does not fill with ghosts that look alive.
MARK_DEAD_WORKERS_SQL = """
UPDATE tasks_worker SET
    stopped_at = clock_timestamp(),
    stop_reason = format('presumed dead: silent for %%ss (more than twice its %%ss TTL)',
                         round(EXTRACT(EPOCH FROM clock_timestamp() - last_seen_at)::numeric, 1), ttl)
WHERE stopped_at IS NULL AND last_seen_at < clock_timestamp() - make_interval(secs => 2 * ttl)
RETURNING id
"""

# After a connection error the worker cannot know whether its last statement committed. It asks:
# what does the database say it holds under its id, and where did the attempts it was finishing end?
HELD_SQL = """
SELECT id, token, attempt_started FROM tasks_task WHERE holder = %(worker)s AND status = 'RUNNING'
"""

# Where did the attempts it was finishing end? Each row's holder, token, status and last error entry:
# the worker's outcome landed when that entry (or a snooze after the grant) is its own token's.
ATTEMPT_FATE_SQL = """
SELECT t.id, t.token, t.holder, t.status, t.errors -> -1 ->> 'token', t.errors -> -1 ->> 'kind',
       -- a snooze leaves no error entry: it landed if the row snoozed after this claim's grant
       COALESCE(t.snoozed_at >= t.acquired_at, false)
FROM tasks_task AS t
WHERE t.id = ANY(%(ids)s::bigint[])
"""
