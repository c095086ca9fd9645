"""Durable steps (tasks/steps.py): a step's stored result, and the fence its transaction commits
under.

A step runs inside one transaction with what it writes, and that transaction ends with
``STEP_RECORD_SQL``: it stores the step's result only while the attempt still holds the task (its
holder, its fencing token, RUNNING, the lease not expired on the database clock), and takes a share
lock on the task's row until the commit. Recovery, a requeue or a cancel must update that row to take
the task from the attempt, so none of them can come between the check and the commit: a step either
committed while its attempt held the task, or not at all (its writes rolled back with it). A worker
paused past its TTL (SIGSTOP, a long pause, a partition) that wakes up inside a step finds no row to
fence against, and the whole step is undone.

The share lock is held only from the fence to the commit (the end of the step): the heartbeat's
renewal and the finish of the same task wait that long, never the step's own work.

A durable sleep (tasks/steps.py ``sleep``) is a step whose result is its wake time, taken on the
database clock (``SLEEP_WAKE_SQL``); each attempt that reaches it asks the same clock how long is left
(``SLEEP_REMAINING_SQL``) and snoozes that long, or goes on.

Steps are keyed by their position in the task's run (the n-th step called), with the name it was
called by: a later attempt that calls a different name at a recorded position is a code change the
stored results do not fit (``STEPS_READ_SQL`` returns them in order; tasks/steps.py refuses it).
"""

from __future__ import annotations

# The stored steps of a task, in the order they ran: read once by each attempt, at its first step.
STEPS_READ_SQL = """
SELECT position, name, result::text, attempt FROM tasks_taskstep WHERE task_id = %(id)s ORDER BY position
"""

# The fence: a step's result, stored only while the attempt holds the task; the row's share lock is
# held to the commit of the step's transaction. No row back: the attempt no longer holds the task and
# the step's transaction must roll back.
STEP_RECORD_SQL = """
INSERT INTO tasks_taskstep (task_id, position, name, attempt, token, result, started_at, completed_at)
SELECT t.id, %(position)s, %(name)s, %(attempt)s, t.token, %(result)s::jsonb, %(started_at)s, clock_timestamp()
FROM (
    SELECT id, token FROM tasks_task
    WHERE id = %(id)s AND holder = %(worker)s AND token = %(token)s AND status = 'RUNNING'
      AND expires_at > clock_timestamp()
    FOR SHARE
) AS t
RETURNING position
"""

# A durable sleep's wake time: the database clock plus the sleep (stored as the sleep's step).
SLEEP_WAKE_SQL = """
SELECT clock_timestamp() + make_interval(secs => %(seconds)s)
"""

# The seconds left until a durable sleep's stored wake time, on the database clock (not above zero:
# it has passed).
SLEEP_REMAINING_SQL = """
SELECT EXTRACT(EPOCH FROM (%(wake)s::timestamptz - clock_timestamp()))::float8
"""
