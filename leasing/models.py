"""The Lease model and the lease columns shared with the task queue.

Every transition is ONE conditional SQL statement timed by the database clock. The statements
read ``clock_timestamp()``, never ``now()``: ``now()`` is the start of the *transaction*, so a caller
inside a long ``transaction.atomic()`` block would see a stale clock and could take over a lease
that is still live. (Read-only filters such as ``active()`` use Django's ``Now()``, which is
``statement_timestamp()`` on PostgreSQL: also immune to the transaction problem.)
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import connections, models
from django.db.models.functions import Coalesce, Concat, Least, Now
from django.db.models.lookups import IsNull

from leasing import signals
from leasing.routing import SelectedManager

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    # typing.Self is 3.11+; annotations are not evaluated at run time (__future__), so no run-time dependency.
    from typing_extensions import Self

#: The one sequence every grant (lease acquire, task claim) draws its fencing token from.
FENCE_SEQUENCE = "leasing_fence_token_seq"

_M = TypeVar("_M", bound=models.Model)


def seconds(value: float | dt.timedelta) -> float:
    """A TTL given as seconds or a timedelta, as positive seconds."""
    result = value.total_seconds() if isinstance(value, dt.timedelta) else float(value)
    if not result > 0:
        raise ValueError(f"a lease TTL must be positive, got {value!r}")
    return result


@dataclass(frozen=True, slots=True)
class Grant:
    """What a holder gets from a successful acquire or renew."""

    resource: str
    holder: str
    token: int
    acquired_at: dt.datetime
    expires_at: dt.datetime


class LeaseStateQuerySet(models.QuerySet[_M]):
    """State filters shared by every model with lease columns (``Lease`` and ``Task``)."""

    def active(self) -> Self:
        return self.filter(released_at__isnull=True, expires_at__gt=Now())

    def expired(self) -> Self:
        return self.filter(released_at__isnull=True, expires_at__lte=Now())

    def renewed(self) -> Self:
        """Active leases that have been renewed at least once."""
        return self.active().filter(renewals__gt=0)

    def released(self) -> Self:
        return self.filter(released_at__isnull=False)

    def held_by(self, holder: str) -> Self:
        return self.filter(holder=holder)


class LeaseFields(models.Model):
    """The lease columns. ``Task`` reuses them so a task's lease lives on its own row."""

    holder = models.CharField(max_length=200, null=True, blank=True, db_index=True)
    token = models.BigIntegerField(null=True, blank=True, help_text="Fencing token of the current grant.")
    acquired_at = models.DateTimeField(null=True, blank=True)
    renewed_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    renewals = models.PositiveIntegerField(default=0, help_text="Renewals of the current grant.")
    transitions = models.PositiveIntegerField(default=0, help_text="How many times the holder changed.")

    class Meta:
        abstract = True

    @property
    def state(self) -> str:
        """active / renewed / expired / released, as of the Python clock (display only)."""
        if self.released_at is not None:
            return "released"
        if self.expires_at is None:
            return "unheld"
        if self.expires_at <= dt.datetime.now(dt.timezone.utc):
            return "expired"
        return "renewed" if self.renewals else "active"


def _fetch_grant(connection: BaseDatabaseWrapper, sql: str, params: dict[str, Any]) -> Grant | None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return Grant(*row) if row else None


_RETURNING = "RETURNING resource, holder, token, acquired_at, expires_at"

# Times come from clock_timestamp(), read when the row is actually written. A statement that
# waited for a row lock (an acquire queued behind a concurrent release) would otherwise stamp its
# grant with the time it *started*, before the release it waited for: two grants whose recorded
# validity overlaps. In the ON CONFLICT branch the times are computed in SET, after the lock is
# taken, never copied from EXCLUDED (evaluated before the wait). The same goes for the token:
# EXCLUDED.token was drawn before the wait, so an acquire queued behind another could install a
# token *smaller* than the grant before it. Drawn in SET, under the row lock, tokens follow the
# order in which grants really happen. (The VALUES token is then wasted: gaps are harmless.)
#: The columns every new grant sets, shared by the lease acquire and the task claim so that the
#: two cannot drift: a fresh token from the one sequence, timed by the clock read under the lock.
GRANT_SET = f"""token = nextval('{FENCE_SEQUENCE}'),
    acquired_at = clock_timestamp(),
    renewed_at = NULL,
    released_at = NULL,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewals = 0"""

# The acquire: a new row, or the row of a lease that expired or was released, taken over with a fresh
# token (GRANT_SET, under the row lock); a live lease of another holder is left as it is (no row back).
ACQUIRE_SQL = f"""
INSERT INTO leasing_lease AS lease
    (resource, holder, token, created_at, acquired_at, renewed_at, released_at, expires_at,
     renewals, transitions, metadata)
VALUES (%(resource)s, %(holder)s, nextval('{FENCE_SEQUENCE}'), clock_timestamp(), clock_timestamp(), NULL, NULL,
        clock_timestamp() + make_interval(secs => %(ttl)s), 0, 0, %(metadata)s::jsonb)
ON CONFLICT (resource) DO UPDATE SET
    holder = EXCLUDED.holder,
    {GRANT_SET},
    transitions = lease.transitions + (lease.holder IS DISTINCT FROM EXCLUDED.holder)::int,
    metadata = COALESCE(EXCLUDED.metadata, lease.metadata)
WHERE lease.expires_at <= clock_timestamp() OR lease.released_at IS NOT NULL
{_RETURNING}
"""

# The renew: only the holder with this token, while its lease is live on the database clock; a lapsed
# lease is not revived (no row back: the holder has lost it).
RENEW_SQL = f"""
UPDATE leasing_lease
SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewed_at = clock_timestamp(),
    renewals = renewals + 1
WHERE resource = %(resource)s AND holder = %(holder)s AND token = %(token)s
  AND released_at IS NULL AND expires_at > clock_timestamp()
{_RETURNING}
"""

# The release: only the holder with this token, while its lease is live; it ends now (a lapsed one has
# ended already: no row back).
RELEASE_SQL = f"""
UPDATE leasing_lease
SET released_at = clock_timestamp(), expires_at = LEAST(expires_at, clock_timestamp())
WHERE resource = %(resource)s AND holder = %(holder)s AND token = %(token)s
  AND released_at IS NULL AND expires_at > clock_timestamp()
{_RETURNING}
"""


def slot_name(resource: str, slot: int) -> str:
    """The lease row behind slot ``slot`` of the counting semaphore ``resource``."""
    return f"{resource}#{slot}"


# A counting semaphore of N slots is N ordinary lease rows (``resource#0`` .. ``resource#N-1``): each
# slot has the TTL, renewal, release, loss detection and fencing token of a plain lease, and since a
# row holds one live grant at most, N rows hold at most N. Taking one is ONE statement: lock the first
# free slot row (expired or released; SKIP LOCKED passes slots another acquirer is taking, and a row
# taken since this statement's snapshot fails the recheck under its lock), or, when every existing slot
# is held, create a missing one (ON CONFLICT DO NOTHING: two acquirers creating the same slot cannot
# both win; the loser gets nothing and retries, like any acquirer of a busy lease).
ACQUIRE_SLOT_SQL = f"""
WITH slots AS (
    SELECT %(resource)s || '#' || k AS name, k FROM generate_series(0, %(limit)s - 1) AS k
), free AS MATERIALIZED (  -- run once (tasks/lifecycle/statements.py, _PICK_ONE, says why)
    SELECT lease.id FROM leasing_lease AS lease JOIN slots ON lease.resource = slots.name
    WHERE lease.expires_at <= clock_timestamp() OR lease.released_at IS NOT NULL
    ORDER BY slots.k
    LIMIT 1
    FOR UPDATE OF lease SKIP LOCKED
), taken AS (
    UPDATE leasing_lease AS lease SET
        holder = %(holder)s,
        {GRANT_SET},
        transitions = lease.transitions + (lease.holder IS DISTINCT FROM %(holder)s)::int,
        metadata = COALESCE(%(metadata)s::jsonb, lease.metadata)
    FROM free WHERE lease.id = free.id
    {_RETURNING.replace("RETURNING ", "RETURNING lease.").replace(", ", ", lease.")}
), created AS (
    INSERT INTO leasing_lease AS lease
        (resource, holder, token, created_at, acquired_at, renewed_at, released_at, expires_at,
         renewals, transitions, metadata)
    SELECT slots.name, %(holder)s, nextval('{FENCE_SEQUENCE}'), clock_timestamp(), clock_timestamp(), NULL, NULL,
           clock_timestamp() + make_interval(secs => %(ttl)s), 0, 0, %(metadata)s::jsonb
    FROM slots
    WHERE NOT EXISTS (SELECT 1 FROM taken)
      AND NOT EXISTS (SELECT 1 FROM leasing_lease AS existing WHERE existing.resource = slots.name)
    ORDER BY random()
    LIMIT 1
    ON CONFLICT (resource) DO NOTHING
    {_RETURNING}
)
SELECT * FROM taken UNION ALL SELECT * FROM created
"""


def acquire_slot_on(
    connection: BaseDatabaseWrapper,
    resource: str,
    holder: str,
    ttl: float,
    limit: int,
    metadata: dict[str, Any] | None = None,
) -> Grant | None:
    """Take one of ``limit`` slots of the semaphore ``resource``; the grant names its slot's row."""
    if limit < 1:
        raise ValueError(f"a semaphore needs at least one slot, got limit={limit!r}")
    return _acquire(
        connection, ACQUIRE_SLOT_SQL, {"resource": resource, "holder": holder, "ttl": ttl, "limit": limit}, metadata
    )


def acquire_on(
    connection: BaseDatabaseWrapper,
    resource: str,
    holder: str,
    ttl: float,
    metadata: dict[str, Any] | None = None,
) -> Grant | None:
    """The acquire statement on a given connection (the holder's heartbeat uses its own)."""
    return _acquire(connection, ACQUIRE_SQL, {"resource": resource, "holder": holder, "ttl": ttl}, metadata)


def _acquire(
    connection: BaseDatabaseWrapper, sql: str, params: dict[str, Any], metadata: dict[str, Any] | None
) -> Grant | None:
    params["metadata"] = None if metadata is None else json.dumps(metadata)
    grant = _fetch_grant(connection, sql, params)
    if grant is not None:
        signals.lease_acquired.send(sender=Lease, grant=grant)
    return grant


def renew_on(connection: BaseDatabaseWrapper, resource: str, holder: str, token: int, ttl: float) -> Grant | None:
    grant = _fetch_grant(connection, RENEW_SQL, {"ttl": ttl, "resource": resource, "holder": holder, "token": token})
    if grant is not None:
        signals.lease_renewed.send(sender=Lease, grant=grant)
    return grant


def release_on(connection: BaseDatabaseWrapper, resource: str, holder: str, token: int) -> Grant | None:
    """Release; the returned grant's ``expires_at`` is the moment of release (database clock)."""
    grant = _fetch_grant(connection, RELEASE_SQL, {"resource": resource, "holder": holder, "token": token})
    if grant is not None:
        signals.lease_released.send(sender=Lease, grant=grant)
    return grant


#: "Not released" as no partial index's predicate reads it (LeaseQuerySet.held).
_NOT_RELEASED = Coalesce(IsNull(models.F("released_at"), True), models.Value(False), output_field=models.BooleanField())
#: The lease states whose lists come from :meth:`LeaseQuerySet.held` (the dashboard's tabs, the admin's
#: filter), sorted by :data:`RESOURCE_VALUE`.
HELD_STATES = ("active", "renewed")
#: The resource as a value, not as the column (``resource || ''``): no index's order, so the planner
#: sorts the rows it found instead of walking the resource key through the history (see ``held``).
RESOURCE_VALUE = Concat(models.F("resource"), models.Value(""))


class LeaseQuerySet(LeaseStateQuerySet["Lease"]):
    """Lease operations. Each is one statement on this queryset's database, in its transaction.

    Called inside ``transaction.atomic()``, the statement joins that transaction, so a lease taken
    there is invisible to others until commit. ``leasing.lease()`` avoids that for you.
    """

    @property
    def _connection(self) -> BaseDatabaseWrapper:
        return connections[self.db]

    def acquire(
        self,
        resource: str,
        holder: str,
        ttl: float | dt.timedelta,
        *,
        metadata: dict[str, Any] | None = None,
    ) -> Grant | None:
        """Take ``resource`` if it is free, expired or released; None if someone holds it.

        A holder re-acquiring its own live lease gets None too: that is what ``renew`` is for.
        """
        return acquire_on(self._connection, resource, holder, seconds(ttl), metadata)

    def acquire_slot(
        self,
        resource: str,
        holder: str,
        ttl: float | dt.timedelta,
        *,
        limit: int,
        metadata: dict[str, Any] | None = None,
    ) -> Grant | None:
        """Take one of ``limit`` slots of the counting semaphore ``resource``; None when all are held.

        The grant's ``resource`` is the slot's own lease (``resource#k``): renew and release it
        like any lease. At most ``limit`` grants of the semaphore are live at any moment of the
        database clock (callers with different limits share the lower slots).
        """
        return acquire_slot_on(self._connection, resource, holder, seconds(ttl), limit, metadata)

    def slots(self, resource: str) -> Self:
        """The slot leases of the semaphore ``resource``."""
        return self.filter(resource__regex=rf"^{re.escape(resource)}#[0-9]+$")

    def renew(self, resource: str, holder: str, token: int, ttl: float | dt.timedelta) -> Grant | None:
        """Extend a live lease by ``ttl`` from now (database clock); None if it is no longer ours."""
        return renew_on(self._connection, resource, holder, token, seconds(ttl))

    def release(self, resource: str, holder: str, token: int) -> bool:
        """End a live lease now; False if it was no longer ours (expired, revoked, taken over)."""
        return release_on(self._connection, resource, holder, token) is not None

    def held(self, *, renewed: bool = False) -> Self:
        """The held leases (renewed at least once, with ``renewed``), as ``active()``, written for the
        lists that show them in resource order: reached only through the expiry range of
        ``leasing_lease_expires_idx`` (a release moves the expiry to its release time, so the range
        holds no history), "not released" out of every partial index's reach (inside COALESCE).
        No index holds the held leases apart from the expired ones (expiry is relative to now): a
        walk of ``leasing_lease_live_res_idx`` in resource order went through every expired lease
        named before the first held one (200,050 rows, 3,239 buffers beside 200,000 expired), and
        a bitmap of it ANDed into the range read all 205,000 entries. Sort these by the resource
        as a value (``resource || ''``), never by the column, or the planner walks
        ``leasing_lease_resource_key`` through the released ones: the cost is then the held
        leases' number, not the history's."""
        held = self.filter(_NOT_RELEASED, expires_at__gt=Now())
        return held.filter(renewals__gt=0) if renewed else held

    def is_current(self, resource: str, token: int) -> bool:
        """Whether ``token`` is the live grant of ``resource``: for callers that can check but not fence."""
        return self.active().filter(resource=resource, token=token).exists()

    def revoke(self) -> int:
        """End every active lease in this queryset now. Holders notice at their next renewal."""
        return self.active().update(released_at=Now(), expires_at=Least("expires_at", Now()))


class Lease(LeaseFields):
    """Time-bounded exclusive ownership of a named resource."""

    resource = models.CharField(max_length=255, unique=True)
    holder = models.CharField(max_length=200)
    token = models.BigIntegerField(help_text="Fencing token of the current grant.")
    acquired_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField()
    metadata = models.JSONField(null=True, blank=True)

    objects = SelectedManager.from_queryset(LeaseQuerySet)()

    class Meta:
        ordering = ["resource"]
        indexes = [
            # A holder's leases (held_by, the admin's exact holder search). Only this one: no
            # varchar_pattern_ops twin, as ``db_index=True`` made, which nothing read (no prefix
            # search on holders) and every acquire, renewal and release wrote (migration 0003).
            models.Index(fields=["holder"], name="leasing_lease_holder_d453b376"),
            # Also the held leases, in expiry order, apart from the history: a release moves a lease's
            # expiry to its release time, so ``expires_at > now`` reaches held leases only.
            models.Index(fields=["expires_at"], name="leasing_lease_expires_idx"),
            # Each side of "released" in the pages' order (resource): a tab's list and its capped
            # count read that state's rows only, never walking through the other's (a million
            # released leases named before the expired ones, or 200,000 expired before the released).
            models.Index(
                fields=["resource"],
                name="leasing_lease_live_res_idx",
                condition=models.Q(released_at__isnull=True),
            ),
            models.Index(
                fields=["resource"],
                name="leasing_lease_released_res_idx",
                condition=models.Q(released_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.resource} held by {self.holder} (token {self.token})"

    @property
    def grant(self) -> Grant:
        return Grant(self.resource, self.holder, self.token, self.acquired_at, self.expires_at)
