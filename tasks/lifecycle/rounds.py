"""The dispatcher's round: ONE statement finishes the attempts that completed, marks the ones that
began, names what goes to the executors on the worker's row and claims the next batch
(``FINISH_AND_CLAIM_SQL``, ``FINISH_START_CLAIM_SQL`` and their fair forms). The finish is
tasks/lifecycle/finish.py's ``COMPLETE_SET``, the claim tasks/lifecycle/claim.py's picks."""

from __future__ import annotations

from tasks.lifecycle.claim import CLAIM_SET, FAIR_CLAIM_RETURNING, FAIR_CTES, PICK_FAIR, PICK_MANY, PICK_ONE
from tasks.lifecycle.finish import COMPLETE_SET
from tasks.lifecycle.fragments import CLAIM_RETURNING, LIVE, OWNED, START_SET, STARTS, owned

# The dispatcher's steady state in ONE statement (one round trip, one commit): finish the attempts
# that completed, mark the ones that began, claim the next batch. The CTEs touch disjoint rows
# (finished and started are distinct attempts of ours; claimed rows are READY), and every row of
# ours is guarded by holder + token + RUNNING + live lease. Rows come back tagged: 'c' claimed (the
# claim's columns), 'f' finished, 's' started (its times placed in the timestamp columns).
_FINISHED_CTE = f"""finished AS (
    UPDATE tasks_task AS t SET {COMPLETE_SET}
    FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(values)s::jsonb[], %(started)s::float8[])
         AS d(id, token, return_value, at)
    WHERE {OWNED} AND {LIVE}
    RETURNING t.id, t.token
)"""


def _claimed_cte(pick: str, returning: str = CLAIM_RETURNING) -> str:
    return f"""claimed AS (
    UPDATE tasks_task AS t SET {CLAIM_SET}
    {pick}
    RETURNING {returning}
)"""


# A fair claim's three more columns (its key, the cursor, taken by its key's turn), NULL in the other rows.
_FAIR_NULLS = ", NULL, NULL, NULL"


def _claimed_and_finished(fair: bool) -> str:
    return f"""SELECT 'c', claimed.* FROM claimed
UNION ALL
SELECT 'f', finished.id, finished.token, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL{_FAIR_NULLS if fair else ""}
FROM finished"""


def _with(fair: bool) -> str:
    """The statement's WITH: a fair claim's CTEs (recursive) come first, after ``finished``."""
    return f"WITH RECURSIVE {_FINISHED_CTE}, {FAIR_CTES}," if fair else f"WITH {_FINISHED_CTE},"


# What the worker hands to its executors with this round (tasks/worker/handoff.py), named on its own
# row before any of it can start: ``handed``, the attempts handed earlier whose start is not on their
# row yet and those handed now, followed by the first ``release`` of this claim's rows whose start is
# lazy (in the order the worker routes them: priority, id). A suspect's or a rate-limited task's start
# is its own statement, sent before its handler runs (START_SQL, RATE_START_SQL): never named.
# Recovery counts a RUNNING attempt whose token its holder's row names as one that may have run
# (invariant 14, _HANDED). One primary-key update of one row per round (``hand`` false: no write),
# not one per task: the marker of a short task still rides on its finish. ``handed`` is sent as the
# array's text ('{1,2}'): psycopg's dump of a list of a hundred ints costs the dispatcher 0.1 ms a
# round (the thread a one-process drain waits on), joining them 0.02 ms.
_HANDING_CTE = """handing AS (
    UPDATE tasks_worker SET handed = %(handed)s::text::bigint[] || ARRAY(
        SELECT c.token FROM claimed AS c
        WHERE NOT c.suspect AND c.rate_key IS NULL AND c.queue <> ALL(%(rated_queues)s::text[])
        ORDER BY c.priority DESC, c.id
        LIMIT %(release)s)
    WHERE id = %(worker)s::text AND %(hand)s::boolean
)"""


# The usual round (a short task's start rides on its finish): no marker arrays to send.
def _finish_and_claim_sql(pick: str, fair: bool = False) -> str:
    returning = FAIR_CLAIM_RETURNING if fair else CLAIM_RETURNING
    return f"""
{_with(fair)} {_claimed_cte(pick, returning)}, {_HANDING_CTE}
{_claimed_and_finished(fair)}
"""


def _finish_start_claim_sql(pick: str, fair: bool = False) -> str:
    returning = FAIR_CLAIM_RETURNING if fair else CLAIM_RETURNING
    return f"""
{_with(fair)} started AS (
    UPDATE tasks_task AS t SET {START_SET}
    FROM {STARTS}
    WHERE {owned("start_ids")} AND {LIVE}
    RETURNING t.id, t.token, t.attempts, t.started_at, t.last_attempted_at
), {_claimed_cte(pick, returning)}, {_HANDING_CTE}
{_claimed_and_finished(fair)}
UNION ALL
SELECT 's', started.id, started.token, NULL, NULL, NULL, started.attempts, NULL, NULL,
       started.started_at, NULL, NULL, NULL, started.last_attempted_at, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL{_FAIR_NULLS if fair else ""}
FROM started
"""


# Each round statement in two forms, indexed by "claims from several queues".
FINISH_AND_CLAIM_SQL = (_finish_and_claim_sql(PICK_ONE), _finish_and_claim_sql(PICK_MANY))
# The same with start markers (attempts that began and have not ended): one more modifying CTE.
FINISH_START_CLAIM_SQL = (_finish_start_claim_sql(PICK_ONE), _finish_start_claim_sql(PICK_MANY))
# The same from one fair queue: each claimed row's fair_key and the cursor come back last.
FAIR_FINISH_AND_CLAIM_SQL = _finish_and_claim_sql(PICK_FAIR, fair=True)
# The fair queue's round with start markers.
FAIR_FINISH_START_CLAIM_SQL = _finish_start_claim_sql(PICK_FAIR, fair=True)
