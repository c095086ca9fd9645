"""The OpenAPI 3.1 document of the JSON API, served at ``/api/openapi.json``.

Why one module of ~1,000 lines (over the 700 of docs/CONTRIBUTING.md): it is one document, data and
no logic, read top to bottom as a reader of the API reads it; its paths share the schemas defined at
the top (``STRING``, ``TOKEN``, ``ERROR``, ...), and split in files each path would import them back.

The tests hold the API to it: ``tests/db/test_api.py`` checks that it names every route and exactly
the methods each serves, and every answer a test gets is validated against its operation's
responses (tests/helpers/api.py), an object's undeclared field refused. So an answer object lists
all its fields, ``required`` all but the conditional ones (``_object``), and free-form ones say so
(``ANY_OBJECT``)."""

from __future__ import annotations

from typing import Any

from tasks.lifecycle.windows import MAX_WINDOW_SECONDS

STRING = {"type": "string", "minLength": 1, "maxLength": 255}
HOLDER = {"type": "string", "minLength": 1, "maxLength": 200}
TOKEN = {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}
TTL = {"type": "number", "exclusiveMinimum": 0, "maximum": 86400}
WINDOW = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_WINDOW_SECONDS}
ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 1}}
PAGE = [
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}},
    {"name": "before", "in": "query", "schema": {"type": "integer"}, "description": "keyset: ids below this"},
]
STATUSES = ["AWAITING", "BLOCKED", "READY", "RUNNING", "SUCCESSFUL", "FAILED", "CANCELLED"]
WORKFLOW_STATUSES = ["RUNNING", "SUCCESSFUL", "FAILED", "CANCELLED"]
_STAMP = {"type": ["string", "null"], "format": "date-time"}
ERROR = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {"type": "string"},
        "field": {"type": "string", "description": "the body field or query parameter refused"},
        "status": {"type": "string", "description": "409: the status of the task, workflow or bulk operation"},
        "holder": {"type": ["string", "null"], "description": "409 on a lease: who holds it now"},
        "expires_at": {**_STAMP, "description": "409 on a lease: when the current holder's lease expires"},
    },
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "required": True,
        **_json({"type": "object", "properties": properties, "required": required, "additionalProperties": False}),
    }


def _responses(ok: int | tuple[int, ...], schema: dict[str, Any], *errors: int) -> dict[str, Any]:
    """``ok`` the success status(es), each answering ``schema``; every operation may answer 400 (its
    query string is checked), 401 and 403."""
    described = {
        400: "invalid body or query (any route: a query string that cannot be stored, an unknown ?db=)",
        401: "no valid credentials",
        403: "not staff, CSRF token missing, or without the route's permission (a token: its scope)",
        404: "unknown id",
        409: "conflict: held by another holder, lease lost, or already finished",
    }
    responses: dict[str, Any] = {
        str(status): {"description": "success", **_json(schema)} for status in (ok if isinstance(ok, tuple) else (ok,))
    }
    for status in sorted({400, 401, 403, *errors}):
        responses[str(status)] = {"description": described[status], **_json(_ref("Error"))}
    return responses


def _op(summary: str, ok: int | tuple[int, ...], schema: dict[str, Any], *errors: int, **extra: Any) -> dict[str, Any]:
    return {"summary": summary, "responses": _responses(ok, schema, *errors), **extra}


def _object(properties: dict[str, Any], *optional: str, **extra: Any) -> dict[str, Any]:
    """An object the API answers: every property is in every answer, but the ``optional`` ones. The
    tests hold each answer to it and refuse a field it does not name (tests/helpers/api.py)."""
    return {
        "type": "object",
        "properties": properties,
        "required": [name for name in properties if name not in optional],
        **extra,
    }


def _list(name: str, item: dict[str, Any]) -> dict[str, Any]:
    return _object({name: {"type": "array", "items": item}, "next": NEXT})


#: Any keys (a handler's arguments, a lease's metadata, ...): said so, as an answer's objects are closed.
ANY_OBJECT = {"type": "object", "additionalProperties": True}
NEXT = {"type": ["string", "null"], "description": "the query string of the next page; null on the last"}
LEASE_LIST = _list("leases", _ref("Lease"))
TASK_LIST = _list("tasks", _ref("Task"))
ONE_TASK = _object({"task": _ref("Task")})
_TIMES = _object(
    {name: {"type": ["number", "null"]} for name in ("mean", "max", "p50", "p95", "p99")}
    | {"count": {"type": "integer"}},
    description="seconds; null when no task was timed",
)
_HISTORY_COUNTS: dict[str, Any] = {
    **{
        name: {"type": "integer", "minimum": 0}
        for name in ("succeeded", "failed", "cancelled", "finished", "attempt_failures")
    },
    "failure_ratio": {"type": ["number", "null"], "description": "failed / (succeeded + failed)"},
    "wait_seconds": _TIMES,
    "run_seconds": _TIMES,
}
HISTORY = _object(
    {
        "hours": {"type": "integer"},
        "queue": {"type": ["string", "null"]},
        "task_path": {"type": ["string", "null"]},
        "totals": _object(_HISTORY_COUNTS),
        "series": {
            "type": "array",
            "description": "one entry per hour, oldest first; counted: false until the rollup has counted it",
            "items": _object(
                {"hour": {"type": "string", "format": "date-time"}, "counted": {"type": "boolean"}} | _HISTORY_COUNTS
            ),
        },
        "keys": {
            "type": "array",
            "items": _object({"queue": {"type": "string"}, "task_path": {"type": "string"}} | _HISTORY_COUNTS),
        },
    }
)
WORKFLOW_LIST = _list("workflows", _ref("Workflow"))
WORKFLOW_PROPERTIES: dict[str, Any] = {
    "workflow": _ref("Workflow"),
    "members": _object(
        {status: {"type": "integer", "minimum": 0} for status in STATUSES},
        description="the workflow's tasks per status (every status, 0 when none)",
    ),
    "callback": {
        "oneOf": [
            _object(
                {
                    "id": {"type": "integer"},
                    "status": {"oneOf": [{"enum": STATUSES}, {"type": "null"}], "description": "null: pruned"},
                }
            ),
            {"type": "null"},
        ]
    },
}
ONE_WORKFLOW = _object(WORKFLOW_PROPERTIES)
WORKER_TOKEN = {"worker": HOLDER, "token": TOKEN}
ONE_BULK = _object({"operation": _ref("BulkOperation")})
#: A stored schedule's entry: the keys of a LEASING_TASKS["SCHEDULES"] entry (validated as they are).
SCHEDULE_ENTRY = {
    "task": {"type": "string", "maxLength": 255, "description": "import path the API allow-list admits"},
    "cron": {"type": ["string", "null"], "maxLength": 255},
    "interval": {"type": ["number", "null"], "minimum": 0.001},
    "timezone": {"type": ["string", "null"], "maxLength": 255},
    "args": {"type": "array"},
    "kwargs": ANY_OBJECT,
    "queue": {"type": "string", "minLength": 1, "maxLength": 100},
    "priority": {"type": "integer", "minimum": -100, "maximum": 100},
    "catch_up": {"enum": ["skip", "last", "all"]},
    "grace": {"type": "number", "minimum": 0},
    "max_attempts": {"type": ["integer", "null"], "minimum": 1},
    "timeout": {"type": ["number", "null"], "exclusiveMinimum": 0},
    "fair_key": {"type": ["string", "null"], "maxLength": 255},
    "paused": {"type": "boolean"},
}
#: What the scheduler runs (tasks/maintenance/schedules.py ``ScheduleSpec.definition``).
SCHEDULE_DEFINITION = _object(
    {
        **{name: schema for name, schema in SCHEDULE_ENTRY.items() if name != "paused"},
        "timezone": {"type": ["string", "null"], "description": "a cron's; null for an interval"},
        "enabled": {"type": "boolean"},
    },
    "fair_key",
)
STORED_SCHEDULE = _object(
    {
        "name": {"type": "string"},
        "kind": {"enum": ["stored"]},
        "paused": {"type": "boolean"},
        "revision": TOKEN,
        "entry": {
            "type": "object",
            "description": "the keys stored (arguments redacted as a task's)",
            "properties": {name: schema for name, schema in SCHEDULE_ENTRY.items() if name != "paused"},
        },
        "definition": {
            "oneOf": [SCHEDULE_DEFINITION, {"type": "null"}],
            "description": "null: the entry is not valid any more (its task path no longer allowed, ...)",
        },
        "effective_from": {"type": "string", "format": "date-time"},
        "created_at": {"type": "string", "format": "date-time"},
        "updated_at": {"type": "string", "format": "date-time"},
    }
)
#: A schedule as ``GET /schedules`` lists it (tasks/web/api/schedules.py ``schedule_json``).
SCHEDULE = _object(
    {
        "name": {"type": "string"},
        "declared": {"type": "boolean", "description": "false: a progress row whose schedule is gone"},
        "kind": {"enum": ["settings", "stored", None]},
        "paused": {"type": "boolean"},
        "revision": {"type": ["integer", "null"], "description": "a stored schedule's"},
        "error": {"type": ["string", "null"], "description": "why a stored schedule is not run"},
        "enabled": {"type": "boolean"},
        "definition": {
            **ANY_OBJECT,
            "description": "what runs (as a stored schedule's definition); not valid: the entry stored; gone"
            " from settings: its last definition",
        },
        "description": {"type": "string"},
        "last_run": {
            "oneOf": [
                _object(
                    {
                        "slot": _STAMP,
                        "task_id": {"type": "integer"},
                        "task_status": {"oneOf": [{"enum": STATUSES}, {"type": "null"}], "description": "null: pruned"},
                    }
                ),
                {"type": "null"},
            ]
        },
        "last_enqueued_at": _STAMP,
        "next_run": _STAMP,
        "enqueued": {"type": "integer"},
        "skipped": {"type": "integer"},
    }
)
SCHEDULE_RUN = _object(
    {
        "slot": _STAMP,
        "task_id": {"type": ["integer", "null"]},
        "task_status": {"oneOf": [{"enum": STATUSES}, {"type": "null"}], "description": "null: pruned"},
        "enqueued_at": _STAMP,
        "token": {"type": ["integer", "null"]},
    }
)
QUEUE = _object(
    {
        "name": {"type": "string"},
        "paused": {"type": "boolean"},
        "waiting": {"type": "integer", "minimum": 0},
        "waiting_capped": {"type": "boolean", "description": "more than waiting (its cap)"},
        "blocked": {"type": "integer", "minimum": 0, "description": "waiting for a concurrency slot"},
        "blocked_capped": {"type": "boolean"},
        "running": {"type": "integer", "minimum": 0},
        "fair": {"type": "boolean", "description": "claims take turns between its keys"},
        "fair_keys": {"type": "integer", "minimum": 0, "description": "keys with waiting tasks"},
        "fair_keys_capped": {"type": "boolean"},
        "changed_at": {**_STAMP, "description": "last paused or resumed"},
        "changed_by": {"type": "string"},
        "reason": {"type": "string"},
    }
)
GENERATOR = _object(
    {
        "name": {"type": "string"},
        "running": {"type": "boolean"},
        "rate": {"type": "number"},
        "max_sleep": {"type": "number"},
        "queue": {"type": "string"},
        "generated": {"type": "integer"},
        "leader": {"type": ["string", "null"], "description": "the instance holding the generator lease"},
        "leader_expires_at": _STAMP,
        "leader_sees_running": {"type": "boolean"},
    }
)
RATE_KEY = _object(
    {
        "key": {"type": "string"},
        "limit": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        "starts_in_window": {"type": "integer"},
        "full": {"type": "boolean"},
        "granted": {"type": "integer"},
        "refused": {"type": "integer"},
        "last_refused_until": _STAMP,
        "last_decided_at": _STAMP,
    }
)
NO_BODY = {
    "required": False,
    "content": {"application/json": {"schema": {"type": "object", "additionalProperties": False}}},
}
BULK_FILTER: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "description": "every field optional; absent: any. status defaults to what the kind applies to"
    " (retry: FAILED, CANCELLED; SUCCESSFUL only when named; cancel and discard: AWAITING, BLOCKED, READY;"
    " never RUNNING)",
    "properties": {
        "status": {"oneOf": [{"enum": STATUSES}, {"type": "array", "items": {"enum": STATUSES}, "minItems": 1}]},
        "queue": {"type": "string", "maxLength": 100},
        "task_path": {"type": "string", "maxLength": 255},
        "workflow_id": {"type": "integer", "minimum": 1},
        "dedup_key": {"type": "string", "maxLength": 255},
        **{
            name: {"type": "string", "format": "date-time", "description": "with a time zone; after: >=, before: <"}
            for name in ("enqueued_after", "enqueued_before", "finished_after", "finished_before")
        },
        "args_contains": {"type": "array", "minItems": 1, "description": "jsonb containment: args @> this"},
        "kwargs_contains": {"type": "object", "minProperties": 1, "description": "jsonb containment: kwargs @> this"},
    },
}


def document(server_url: str = "/api") -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/leases": {
            "get": _op(
                "List leases, newest first",
                200,
                LEASE_LIST,
                400,
                parameters=[
                    *PAGE,
                    {
                        "name": "state",
                        "in": "query",
                        "schema": {"enum": ["active", "expired", "renewed", "released"]},
                    },
                ],
            ),
            "post": _op(
                "Acquire a lease",
                201,
                _object({"grant": _ref("Grant"), "lease": _ref("Lease")}),
                400,
                409,
                requestBody=_body(
                    {"resource": STRING, "holder": HOLDER, "ttl": TTL, "metadata": {"type": "object"}},
                    ["resource", "holder"],
                ),
            ),
        },
        "/leases/renew": {
            "put": _op(
                "Renew a lease you hold",
                200,
                _object({"grant": _ref("Grant")}),
                400,
                404,
                409,
                requestBody=_body(
                    {"resource": STRING, "holder": HOLDER, "token": TOKEN, "ttl": TTL},
                    ["resource", "holder", "token"],
                ),
            )
        },
        **{
            f"/leases/{state}": {"get": _op(f"List {state} leases", 200, LEASE_LIST, 400, parameters=PAGE)}
            for state in ("active", "expired", "renewed", "released")
        },
        "/leases/{id}": {
            "parameters": [ID],
            "get": _op("One lease", 200, _object({"lease": _ref("Lease")}), 404),
            "delete": _op(
                "Release a lease you hold",
                200,
                _object({"released": {"type": "boolean"}, "lease": _ref("Lease")}),
                400,
                404,
                409,
                requestBody=_body({"holder": HOLDER, "token": TOKEN}, ["holder", "token"]),
            ),
        },
        "/tasks": {
            "get": _op(
                "List tasks, newest first",
                200,
                TASK_LIST,
                400,
                parameters=[
                    *PAGE,
                    {
                        "name": "status",
                        "in": "query",
                        "schema": {"enum": STATUSES},
                    },
                    {"name": "queue", "in": "query", "schema": {"type": "string"}},
                    {
                        "name": "workflow_id",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1},
                        "description": "the members of one workflow",
                    },
                ],
            ),
            "post": _op(
                "Enqueue a task (200 with created=false when an unfinished task has the dedup_key, its "
                "unique_for window is open, or the enqueue was folded into its waiting debounced task)",
                (201, 200),
                _object(
                    {
                        "task": {
                            "oneOf": [_ref("Task"), {"type": "null"}],
                            "description": "null only when a window's task was pruned before its window ended",
                        },
                        "task_id": {"type": "integer"},
                        "created": {"type": "boolean"},
                    }
                ),
                400,
                requestBody=_body(
                    {
                        "task_path": {
                            **STRING,
                            "pattern": r"^[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)+$",
                            "description": "allowed by LEASING_TASKS['API_TASKS'] or ['API_TASK_PATTERNS']",
                        },
                        "args": {"type": "array"},
                        "kwargs": {"type": "object"},
                        "payload": {"type": "object", "description": "the same as kwargs"},
                        "queue": {"type": "string", "minLength": 1, "maxLength": 100},
                        "priority": {"type": "integer", "minimum": -100, "maximum": 100},
                        "run_after": {"type": "string", "format": "date-time"},
                        "max_attempts": {"type": "integer", "minimum": 1, "maximum": 1000},
                        "timeout": TTL,
                        "dedup_key": STRING,
                        "concurrency_key": {
                            **STRING,
                            "description": "at most concurrency_limit tasks of this key run at once (give both)",
                        },
                        "concurrency_limit": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
                        "rate_key": {
                            **STRING,
                            "description": "at most rate_limit starts of this key in any sliding window (give both)",
                        },
                        "rate_limit": {
                            "description": "'14/s', '100/min', '5/10s', or [count, seconds]",
                            "oneOf": [
                                {"type": "string"},
                                {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
                            ],
                        },
                        "unique_for": {
                            **WINDOW,
                            "description": "seconds: no second task of the dedup_key within this long of the last "
                            "one accepted, finished or not (needs dedup_key)",
                        },
                        "debounce": {
                            **WINDOW,
                            "description": "seconds: start this long after the dedup_key's last enqueue; a later "
                            "enqueue while it waits replaces its arguments and pushes its start (needs dedup_key; "
                            "no run_after; not with unique_for)",
                        },
                        "max_wait": {
                            **WINDOW,
                            "description": "seconds: debounces never push the start past the first enqueue plus "
                            "this (at least debounce)",
                        },
                        "fair_key": {
                            **STRING,
                            "description": "its key (tenant) in a fair queue: claims take turns between keys",
                        },
                    },
                    ["task_path"],
                ),
            ),
        },
        "/tasks/next": {
            "post": _op(
                "Claim the next runnable task(s) under a lease (task is null when there is none)",
                200,
                _object(
                    {
                        "task": {"oneOf": [_ref("Task"), {"type": "null"}]},
                        "tasks": {"type": "array", "items": _ref("Task")},
                        "fair_after": {
                            "type": ["string", "null"],
                            "description": "from a fair queue only: send it back as fair_after (where the turns go on)",
                        },
                    },
                    "fair_after",
                ),
                400,
                requestBody=_body(
                    {
                        "worker": HOLDER,
                        "queues": {
                            "type": "array",
                            "items": {"type": "string", "minLength": 1, "maxLength": 100},
                            "minItems": 1,
                            "maxItems": 50,
                        },
                        "ttl": TTL,
                        "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                        "fair_after": {
                            **STRING,
                            "description": "from a fair queue: where the turns go on (the last reply's fair_after)",
                        },
                    },
                    ["worker"],
                ),
            )
        },
        **{
            f"/tasks/{name}": {"get": _op(summary, 200, TASK_LIST, 400, parameters=PAGE)}
            for name, summary in (
                ("processed", "Finished tasks"),
                ("started", "Running tasks"),
                ("stuck", "Running tasks whose lease expired"),
            )
        },
        "/tasks/{id}": {"parameters": [ID], "get": _op("One task", 200, ONE_TASK, 404)},
        "/tasks/{id}/heartbeat": {
            "parameters": [ID],
            "put": _op(
                "Renew your claim (optionally storing a progress checkpoint)",
                200,
                ONE_TASK,
                400,
                404,
                409,
                requestBody=_body({**WORKER_TOKEN, "ttl": TTL, "progress": {}}, ["worker", "token"]),
            ),
        },
        "/tasks/{id}/complete": {
            "parameters": [ID],
            "put": _op(
                "Finish your claimed task with its output",
                200,
                ONE_TASK,
                400,
                404,
                409,
                requestBody=_body({**WORKER_TOKEN, "output": {}}, ["worker", "token"]),
            ),
        },
        "/tasks/{id}/fail": {
            "parameters": [ID],
            "put": _op(
                "Report a failed attempt (retried with backoff unless retry=false or out of attempts)",
                200,
                _object({"task": _ref("Task"), "retrying": {"type": "boolean"}}),
                400,
                404,
                409,
                requestBody=_body(
                    {
                        **WORKER_TOKEN,
                        "retry": {"type": "boolean"},
                        "error": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "type": {"type": "string"},
                                "message": {"type": "string"},
                                "traceback": {"type": "string"},
                            },
                        },
                    },
                    ["worker", "token"],
                ),
            ),
        },
        "/tasks/{id}/cancel": {"parameters": [ID], "post": _op("Cancel an unfinished task", 200, ONE_TASK, 404, 409)},
        "/tasks/{id}/requeue": {
            "parameters": [ID],
            "post": _op("Run a finished or waiting task again now", 200, ONE_TASK, 404, 409),
        },
        "/tasks/{id}/rerun-from-step": {
            "parameters": [ID],
            "post": _op(
                "Discard the task's stored durable steps from a position on and run it again (a finished task"
                " requeued, a waiting one made due); 409 while it runs",
                200,
                _object({"task": _ref("Task"), "discarded": {"type": "integer"}}),
                400,
                404,
                409,
                requestBody=_body({"position": {"type": "integer", "minimum": 0}}, ["position"]),
            ),
        },
        "/tasks/{id}/events": {
            "parameters": [ID],
            "post": _op(
                "Send an event to an unfinished task, for its wait_for_event (a waiting task is made due at once);"
                " 409 when one of the name was sent before (the first payload stands) or the task is finished",
                201,
                _object({"task_id": {"type": "integer"}, "event": {"type": "string"}}),
                400,
                404,
                409,
                requestBody=_body({"name": {"type": "string", "maxLength": 150}, "payload": {}}, ["name"]),
            ),
        },
        "/tasks/bulk": {
            "get": _op(
                "List bulk operations, newest first",
                200,
                _list("operations", _ref("BulkOperation")),
                400,
                parameters=PAGE,
            ),
            "post": _op(
                "Request a bulk retry, cancel or discard of every task matching a filter: 202 with the operation"
                " to poll (the recovery leader works through it in batches); a refused request writes nothing",
                202,
                _object({"operation": _ref("BulkOperation"), "poll": {"type": "string", "description": "its URL"}}),
                400,
                requestBody=_body({"kind": {"enum": ["retry", "cancel", "discard"]}, "filter": BULK_FILTER}, ["kind"]),
            ),
        },
        "/tasks/bulk/{id}": {
            "parameters": [ID],
            "get": _op("One bulk operation: status, counts and progress", 200, ONE_BULK, 404),
        },
        "/tasks/bulk/{id}/cancel": {
            "parameters": [ID],
            "post": _op(
                "Stop an open bulk operation (what it changed stays changed); 409 when it has ended",
                200,
                ONE_BULK,
                400,
                404,
                409,
                requestBody={
                    "required": False,
                    "content": {"application/json": {"schema": {"type": "object", "additionalProperties": False}}},
                },
            ),
        },
        "/workflows": {
            "get": _op(
                "List workflows, newest first (their members: GET /tasks?workflow_id=)",
                200,
                WORKFLOW_LIST,
                400,
                parameters=[*PAGE, {"name": "status", "in": "query", "schema": {"enum": WORKFLOW_STATUSES}}],
            )
        },
        "/workflows/{id}": {
            "parameters": [ID],
            "get": _op("One workflow, its members counted by status, and its callback", 200, ONE_WORKFLOW, 404),
        },
        "/workflows/{id}/cancel": {
            "parameters": [ID],
            "post": _op(
                "Cancel a running workflow: every unfinished member is cancelled (a running one's worker loses"
                " its lease); 409 when it has already ended",
                200,
                _object({**WORKFLOW_PROPERTIES, "cancelled": {"type": "integer"}}),
                400,
                404,
                409,
                requestBody={
                    "required": False,
                    "content": {"application/json": {"schema": {"type": "object", "additionalProperties": False}}},
                },
            ),
        },
        "/workflows/{id}/events": {
            "parameters": [ID],
            "post": _op(
                "Send an event to every unfinished member of a workflow, for their wait_for_event (those waiting"
                " are made due at once): 201 with the members it was stored for; 409 when it reached none (the"
                " workflow has ended, or each unfinished member had one of the name: the first payload stands)",
                201,
                _object(
                    {
                        "workflow_id": {"type": "integer"},
                        "event": {"type": "string"},
                        "task_ids": {"type": "array", "items": {"type": "integer"}},
                    }
                ),
                400,
                404,
                409,
                requestBody=_body({"name": {"type": "string", "maxLength": 150}, "payload": {}}, ["name"]),
            ),
        },
        "/generator": {
            "get": _op("Demo generator state and leader", 200, _object({"generator": GENERATOR})),
            "put": _op(
                "Change the generator's desired state (reaches the leader from any replica)",
                200,
                _object({"generator": GENERATOR}),
                400,
                requestBody=_body(
                    {
                        "running": {"type": "boolean"},
                        "rate": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                        "max_sleep": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
                    },
                    [],
                ),
            ),
        },
        "/rate-keys": {
            "get": _op(
                "Rate keys started most recently (at most 50), those at their limit first: starts in the window "
                "ending now, the limit, and the starts granted and refused (handed back) so far",
                200,
                _object({"rate_keys": {"type": "array", "items": RATE_KEY}}),
            )
        },
        "/schedules": {
            "get": _op(
                "Periodic tasks: every schedule, declared in settings or stored (kind), with its last and next run"
                " and its paused state",
                200,
                _object(
                    {
                        "scheduler": _object({"leader": {"type": ["string", "null"]}}),
                        "schedules": {"type": "array", "items": SCHEDULE},
                        "settings_error": {
                            "type": ["string", "null"],
                            "description": "LEASING_TASKS['SCHEDULES'] is invalid: only the stored ones are listed",
                        },
                    }
                ),
            ),
            "post": _op(
                "Store a schedule (a settings entry's keys, validated as settings are; the task must be one the"
                " API may enqueue). Its first slot is the first after now; 409 when the name is taken (by a stored"
                " schedule or one declared in settings)",
                201,
                STORED_SCHEDULE,
                400,
                409,
                requestBody=_body({"name": {"type": "string", "maxLength": 100}, **SCHEDULE_ENTRY}, ["name", "task"]),
            ),
        },
        "/schedules/{name}": {
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "get": _op(
                "One schedule and its runs (each with its task), newest first",
                200,
                _object({"schedule": SCHEDULE, "runs": {"type": "array", "items": SCHEDULE_RUN}, "next": NEXT}),
                400,
                404,
                parameters=[
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}},
                    {"name": "before", "in": "query", "schema": {"type": "string", "format": "date-time"}},
                ],
            ),
            "put": _op(
                "Replace a stored schedule's entry (paused kept unless given); takes effect from the first slot"
                " after the edit. revision: only if still at it. 409 for a schedule declared in settings",
                200,
                STORED_SCHEDULE,
                400,
                404,
                409,
                requestBody=_body({**SCHEDULE_ENTRY, "name": {"type": "string"}, "revision": TOKEN}, ["task"]),
            ),
            "patch": _op(
                "Change some keys of a stored schedule's entry (a JSON merge patch: null removes a key); as PUT",
                200,
                STORED_SCHEDULE,
                400,
                404,
                409,
                requestBody=_body({**SCHEDULE_ENTRY, "name": {"type": "string"}, "revision": TOKEN}, []),
            ),
            "delete": _op(
                "Delete a stored schedule: nothing more is enqueued; its progress row and runs stay as history."
                " 409 for a schedule declared in settings",
                200,
                _object({"deleted": {"type": "string"}, "revision": TOKEN}),
                404,
                409,
            ),
        },
        "/schedules/{name}/pause": {
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "post": _op(
                "Pause a stored schedule: no slot is enqueued from the scheduler's next statement on (paused"
                " already: nothing written). 409 for a schedule declared in settings",
                200,
                STORED_SCHEDULE,
                404,
                409,
                requestBody=NO_BODY,
            ),
        },
        "/schedules/{name}/resume": {
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "post": _op(
                "Resume a stored schedule from its first slot after now (none of those missed while paused is"
                " back-filled). 409 for a schedule declared in settings",
                200,
                STORED_SCHEDULE,
                404,
                409,
                requestBody=NO_BODY,
            ),
        },
        "/queues": {
            "get": _op(
                "Every known queue: paused or not, waiting, waiting for a concurrency slot (blocked; both capped"
                " at 10,000) and running tasks",
                200,
                _object({"queues": {"type": "array", "items": QUEUE}}),
            )
        },
        "/history": {
            "get": _op(
                "Finished tasks per hour over the last days, from the hourly rollup (never the tasks table):"
                " succeeded, failed, cancelled and failed attempts, wait and run time percentiles (p50, p95, p99,"
                " read from summed fixed buckets), for all tasks or one queue and / or task path; also the totals"
                " and the busiest 50 (queue, task path) keys",
                200,
                HISTORY,
                400,
                parameters=[
                    {"name": "queue", "in": "query", "required": False, "schema": {"type": "string", "maxLength": 100}},
                    {
                        "name": "task_path",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "maxLength": 255},
                    },
                    {
                        "name": "hours",
                        "in": "query",
                        "required": False,
                        "description": "whole hours before the current one; default and most: HISTORY_HOURS (168)",
                        "schema": {"type": "integer", "minimum": 1},
                    },
                ],
            )
        },
        "/queues/{name}/pause": {
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "post": _op(
                "Pause a queue: no worker or client claims from it from its next claim; running tasks finish",
                200,
                _object({"queue": QUEUE}),
                400,
                409,
                requestBody={
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {"type": "object", "properties": {"reason": {"type": "string", "maxLength": 500}}}
                        }
                    },
                },
            ),
        },
        "/queues/{name}/resume": {
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "post": _op(
                "Resume a paused queue (idle workers are woken at once)",
                200,
                _object({"queue": QUEUE}),
                400,
            ),
        },
        "/openapi.json": {
            "get": _op(
                "This document; its server is where the API is mounted",
                200,
                {**ANY_OBJECT, "required": ["openapi", "info", "paths"]},
            )
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "django-leasing API",
            "version": "1",
            "description": (
                "Leases with fencing tokens and a lease-based task queue. Reads need the model's view"
                " permission (token scope), actions its change permission: leasing.view_lease,"
                " leasing.change_lease, tasks.view_task, tasks.add_task (enqueue), tasks.change_task,"
                " tasks.view_generatorstate, tasks.change_generatorstate (workflows need the task"
                " permissions). Strings must not contain NUL or lone surrogates, numbers must be finite,"
                " date-times are ISO 8601's extended format with a time zone (2030-01-31T12:00:00Z,"
                " 2030-01-31 13:00:00.5+01:00) from 1970 to before 3000 (UTC). A refused request"
                " changes nothing."
            ),
        },
        "servers": [{"url": server_url}],
        "security": [{"bearer": []}, {"session": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "session": {"type": "apiKey", "in": "cookie", "name": "sessionid"},
            },
            "schemas": {
                "Error": ERROR,
                "Grant": _object(
                    {
                        "resource": {"type": "string"},
                        "holder": {"type": "string"},
                        "token": {"type": "integer"},
                        "acquired_at": _STAMP,
                        "expires_at": _STAMP,
                    }
                ),
                "Lease": _object(
                    {
                        "id": {"type": "integer"},
                        "resource": {"type": "string"},
                        "holder": {"type": ["string", "null"]},
                        "token": {"type": ["integer", "null"]},
                        "state": {
                            "enum": ["active", "renewed", "expired", "released", "unheld"],
                            "description": "unheld: a row never granted (no expiry)",
                        },
                        "created_at": _STAMP,
                        "acquired_at": _STAMP,
                        "renewed_at": _STAMP,
                        "released_at": _STAMP,
                        "expires_at": _STAMP,
                        "renewals": {"type": "integer"},
                        "transitions": {"type": "integer"},
                        "metadata": {},
                    }
                ),
                "Task": _object(
                    {
                        "id": {"type": "integer"},
                        "task_path": {"type": "string"},
                        "queue": {"type": "string"},
                        "priority": {"type": "integer"},
                        "status": {"enum": STATUSES},
                        "stuck": {"type": "boolean"},
                        "archived": {
                            "type": "boolean",
                            "description": "kept in the finished history (tasks_finished): no action changes it",
                        },
                        "args": {"type": "array", "description": "redacted (REDACT_ARGUMENTS) but for its claimer"},
                        "kwargs": ANY_OBJECT,
                        "attempts": {"type": "integer"},
                        "max_attempts": {"type": "integer"},
                        "timeout": {"type": ["number", "null"], "description": "seconds an attempt may run"},
                        "dedup_key": {"type": ["string", "null"]},
                        "unique_window": {
                            **_object({"key": {"type": "string"}, "accepted_at": _STAMP, "expires_at": _STAMP}),
                            "type": ["object", "null"],
                            "description": "the unique_for window this task opened, while open (GET /tasks/{id} "
                            "and the enqueue only)",
                        },
                        "debounce_key": {"type": ["string", "null"]},
                        "debounce_until": {**_STAMP, "description": "debounces never push its start past this"},
                        "debounces": {
                            "type": ["integer", "null"],
                            "description": "enqueues folded into it while it waited (null: not debounced)",
                        },
                        "concurrency_key": {"type": ["string", "null"]},
                        "fair_key": {"type": ["string", "null"]},
                        "concurrency_limit": {"type": ["integer", "null"]},
                        "rate_key": {"type": ["string", "null"]},
                        "rate_limit": {
                            "type": ["array", "null"],
                            "items": {"type": "number"},
                            "description": "[count, seconds]",
                        },
                        "rate_refusals": {"type": "integer"},
                        "run_after": _STAMP,
                        "enqueued_at": _STAMP,
                        "started_at": _STAMP,
                        "last_attempted_at": _STAMP,
                        "finished_at": _STAMP,
                        "holder": {"type": ["string", "null"]},
                        "token": {"type": ["integer", "null"]},
                        "expires_at": _STAMP,
                        "renewed_at": _STAMP,
                        "progress": {},
                        "output": {},
                        "errors": {
                            "type": "array",
                            "description": "every failed attempt's error, oldest first",
                            "items": {
                                **ANY_OBJECT,
                                "properties": {
                                    "message": {"type": "string"},
                                    "traceback": {"type": "string"},
                                    "traceback_truncated": {
                                        "type": "boolean",
                                        "description": "in a list: its last 500 characters (the task has it whole)",
                                    },
                                },
                            },
                        },
                        "errors_dropped": {"type": "integer"},
                        "snoozes": {"type": "integer", "description": "times its handler snoozed it (not attempts)"},
                        "snoozed": {"type": "boolean", "description": "waiting after its handler snoozed it"},
                        "wakes_at": {**_STAMP, "description": "when a snoozed task runs again (its run_after)"},
                        "cancel_reason": {
                            "type": ["string", "null"],
                            "description": "why its handler cancelled it (tasks.exceptions.Cancel)",
                        },
                        "retry_policy": {
                            "type": ["object", "null"],
                            "additionalProperties": True,
                            "description": "the retry policy given at enqueue (docs/howto/retries.md)",
                        },
                        "worker_ids": {"type": "array", "items": {"type": "string"}},
                        "workflow_id": {"type": ["integer", "null"]},
                        "waiting_on": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "tasks it depends on that are not final yet (AWAITING until 0)",
                        },
                    },
                    "unique_window",
                ),
                "BulkOperation": _object(
                    {
                        "id": {"type": "integer"},
                        "kind": {"enum": ["retry", "cancel", "discard"]},
                        "filter": BULK_FILTER,
                        "status": {"enum": ["PENDING", "RUNNING", "DONE", "CANCELLED", "FAILED"]},
                        "matched": {"type": "integer", "description": "tasks matching the filter so far"},
                        "changed": {"type": "integer", "description": "tasks changed so far"},
                        "skipped": {
                            "type": "integer",
                            "description": "matched but left alone: moved meanwhile, or a dedup key collision",
                        },
                        "batches": {"type": "integer"},
                        "progress": {"type": "number", "minimum": 0, "maximum": 1},
                        "cursor": {"type": "integer", "description": "the last task id gone through"},
                        "last_id": {"type": "integer", "description": "the newest task id when requested"},
                        "requested_by": {"type": "string"},
                        "created_at": _STAMP,
                        "started_at": _STAMP,
                        "updated_at": _STAMP,
                        "finished_at": _STAMP,
                        "error": {"type": ["string", "null"]},
                        "url": {"type": "string"},
                    }
                ),
                "Workflow": _object(
                    {
                        "id": {"type": "integer"},
                        "name": {"type": "string"},
                        "kind": {"enum": ["chain", "group", "graph"]},
                        "status": {"enum": WORKFLOW_STATUSES},
                        "total": {"type": "integer"},
                        "succeeded": {"type": "integer"},
                        "failed": {"type": "integer", "description": "members that ended FAILED or CANCELLED"},
                        "remaining": {"type": "integer", "description": "members not final yet"},
                        "callback_id": {"type": ["integer", "null"]},
                        "created_at": _STAMP,
                        "finished_at": _STAMP,
                    }
                ),
            },
        },
    }
