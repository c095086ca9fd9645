-- leasing.models: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).

-- name: ACQUIRE_SQL
-- The acquire: a new row, or the row of a lease that expired or was released, taken over with a fresh
-- token (GRANT_SET, under the row lock); a live lease of another holder is left as it is (no row back).
INSERT INTO leasing_lease AS lease
    (resource, holder, token, created_at, acquired_at, renewed_at, released_at, expires_at,
     renewals, transitions, metadata)
VALUES (%(resource)s, %(holder)s, nextval('leasing_fence_token_seq'), clock_timestamp(), clock_timestamp(), NULL, NULL,
        clock_timestamp() + make_interval(secs => %(ttl)s), 0, 0, %(metadata)s::jsonb)
ON CONFLICT (resource) DO UPDATE SET
    holder = EXCLUDED.holder,
    token = nextval('leasing_fence_token_seq'),
    acquired_at = clock_timestamp(),
    renewed_at = NULL,
    released_at = NULL,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewals = 0,
    transitions = lease.transitions + (lease.holder IS DISTINCT FROM EXCLUDED.holder)::int,
    metadata = COALESCE(EXCLUDED.metadata, lease.metadata)
WHERE lease.expires_at <= clock_timestamp() OR lease.released_at IS NOT NULL
RETURNING resource, holder, token, acquired_at, expires_at;

-- name: RENEW_SQL
-- The renew: only the holder with this token, while its lease is live on the database clock; a lapsed
-- lease is not revived (no row back: the holder has lost it).
UPDATE leasing_lease
SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewed_at = clock_timestamp(),
    renewals = renewals + 1
WHERE resource = %(resource)s AND holder = %(holder)s AND token = %(token)s
  AND released_at IS NULL AND expires_at > clock_timestamp()
RETURNING resource, holder, token, acquired_at, expires_at;

-- name: RELEASE_SQL
-- The release: only the holder with this token, while its lease is live; it ends now (a lapsed one has
-- ended already: no row back).
UPDATE leasing_lease
SET released_at = clock_timestamp(), expires_at = LEAST(expires_at, clock_timestamp())
WHERE resource = %(resource)s AND holder = %(holder)s AND token = %(token)s
  AND released_at IS NULL AND expires_at > clock_timestamp()
RETURNING resource, holder, token, acquired_at, expires_at;

-- name: ACQUIRE_SLOT_SQL
-- A counting semaphore of N slots is N ordinary lease rows (``resource#0`` .. ``resource#N-1``): each
-- slot has the TTL, renewal, release, loss detection and fencing token of a plain lease, and since a
-- row holds one live grant at most, N rows hold at most N. Taking one is ONE statement: lock the first
-- free slot row (expired or released; SKIP LOCKED passes slots another acquirer is taking, and a row
-- taken since this statement's snapshot fails the recheck under its lock), or, when every existing slot
-- is held, create a missing one (ON CONFLICT DO NOTHING: two acquirers creating the same slot cannot
-- both win; the loser gets nothing and retries, like any acquirer of a busy lease).
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
        token = nextval('leasing_fence_token_seq'),
    acquired_at = clock_timestamp(),
    renewed_at = NULL,
    released_at = NULL,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
    renewals = 0,
        transitions = lease.transitions + (lease.holder IS DISTINCT FROM %(holder)s)::int,
        metadata = COALESCE(%(metadata)s::jsonb, lease.metadata)
    FROM free WHERE lease.id = free.id
    RETURNING lease.resource, lease.holder, lease.token, lease.acquired_at, lease.expires_at
), created AS (
    INSERT INTO leasing_lease AS lease
        (resource, holder, token, created_at, acquired_at, renewed_at, released_at, expires_at,
         renewals, transitions, metadata)
    SELECT slots.name, %(holder)s, nextval('leasing_fence_token_seq'), clock_timestamp(), clock_timestamp(), NULL, NULL,
           clock_timestamp() + make_interval(secs => %(ttl)s), 0, 0, %(metadata)s::jsonb
    FROM slots
    WHERE NOT EXISTS (SELECT 1 FROM taken)
      AND NOT EXISTS (SELECT 1 FROM leasing_lease AS existing WHERE existing.resource = slots.name)
    ORDER BY random()
    LIMIT 1
    ON CONFLICT (resource) DO NOTHING
    RETURNING resource, holder, token, acquired_at, expires_at
)
SELECT * FROM taken UNION ALL SELECT * FROM created;
