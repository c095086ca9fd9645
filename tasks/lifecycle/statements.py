"""Every statement that changes a task or worker row, by the transition it serves; this module only
gathers them for the callers that read ``statements.X`` (``from tasks.lifecycle import statements as sql``).

- ``enqueue.py``: the inserts (one task, dedup, unique window, debounce, bulk);
- ``claim.py``: the claims (plain and fair, one queue and several, the eager mode's chosen ones);
- ``rounds.py``: the dispatcher's round (finish, mark starts, hand over and claim in one statement);
- ``finish.py``: start markers, the rate grant, heartbeat, checkpoint, complete, fail / retry / snooze,
  hand-back; and how an attempt is accounted;
- ``recover.py``: expired leases, stray leases, orphans, dead workers, attempt fates;
- ``steps.py``: a durable step's stored result and the fence its transaction commits under;
- ``operations.py``: the operator's delete (cancel and requeue are ``TaskQuerySet`` updates);
- ``fragments.py``: what several of them share.

Each statement reads whole, as it runs, in ``tasks/sql/lifecycle/<module>.sql``.
"""

from __future__ import annotations

from tasks.lifecycle.claim import (  # noqa: F401
    CLAIM_CHOSEN_SQL,
    CLAIM_SET,
    CLAIM_SQL,
    FAIR_CLAIM_RETURNING,
    FAIR_CLAIM_SQL,
    FAIR_CTES,
    FAIR_CURSOR,
    FAIR_CURSOR_READ_SQL,
    FAIR_CURSOR_WRITE_SQL,
    FAIR_WALK_KEYS_EXTRA,
    FAIR_WALK_KEYS_PER_TURN,
    ISOLATED_WAITING_SQL,
    NO_ISOLATION_BAR,
    PICK_FAIR,
    PICK_MANY,
    PICK_ONE,
    claim_params,
)
from tasks.lifecycle.enqueue import (  # noqa: F401
    BULK_ENQUEUE_SQL,
    ENQUEUE_DEBOUNCE_SQL,
    ENQUEUE_DEDUP_SQL,
    ENQUEUE_SQL,
    ENQUEUE_UNIQUE_SQL,
    INSERT_COLUMNS,
)
from tasks.lifecycle.finish import (  # noqa: F401
    CHECKPOINT_SQL,
    COMPLETE_SET,
    COMPLETE_SQL,
    FAIL_SQL,
    HAND_BACK_SQL,
    HEARTBEAT_SQL,
    START_SQL,
)
from tasks.lifecycle.fragments import (  # noqa: F401
    CLAIM_RETURNING,
    ERRORS_FULL,
    HELD,
    LIVE,
    MAX_ERRORS,
    OWNED,
    START_SET,
    STARTS,
    WAITING_STATUS,
    append_error,
)
from tasks.lifecycle.operations import (  # noqa: F401
    DELETE_FINISHED_SQL,
)
from tasks.lifecycle.prepared import plan_once
from tasks.lifecycle.ratelimits import RATE_START_SQL  # noqa: F401
from tasks.lifecycle.recover import (  # noqa: F401
    ATTEMPT_FATE_SQL,
    EXPIRE_ORPHANS_SQL,
    HELD_SQL,
    MARK_DEAD_WORKERS_SQL,
    RECOVER_EXPIRED_SINCE_SQL,
    RECOVER_EXPIRED_SQL,
    RELEASE_STRAY_LEASES_SQL,
)
from tasks.lifecycle.rounds import (  # noqa: F401
    FAIR_FINISH_AND_CLAIM_SQL,
    FAIR_FINISH_START_CLAIM_SQL,
    FINISH_AND_CLAIM_SQL,
    FINISH_START_CLAIM_SQL,
)
from tasks.lifecycle.steps import (  # noqa: F401
    EVENT_CHECK_SQL,
    EVENT_LOCK_SQL,
    EVENT_SEND_SQL,
    EVENTS_WAKE_SQL,
    SLEEP_REMAINING_SQL,
    SLEEP_WAKE_SQL,
    SPAWN_BIND_SQL,
    STEP_RECORD_SQL,
    STEPS_READ_SQL,
    WORKFLOW_EVENT_LOCK_SQL,
)

# The claims and rounds (not their fair forms, whose keys' turns are planned from the statistics of
# the moment: tests/db/test_fair_plans_without_statistics.py), and the dispatcher's finishes of a round
# that claims nothing, run under one generic plan per connection, without sequential scans.
plan_once(*CLAIM_SQL, *FINISH_AND_CLAIM_SQL, *FINISH_START_CLAIM_SQL, COMPLETE_SQL, FAIL_SQL)
