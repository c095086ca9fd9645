"""The OpenAPI document's schemas: the answers and bodies its paths share, and the named ones of
``#/components/schemas`` (``component_schemas``), which the paths name with ``_ref``."""

from __future__ import annotations

from typing import Any

from tasks.web.api.openapi.parts import (
    _STAMP,
    ANY_OBJECT,
    ERROR,
    HOLDER,
    STATUSES,
    TOKEN,
    WORKFLOW_STATUSES,
    _list,
    _object,
    _ref,
)

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
#: What the scheduler runs (tasks/maintenance/schedule_specs.py ``ScheduleSpec.definition``).
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


def component_schemas() -> dict[str, Any]:
    """The named schemas (``#/components/schemas``): Error, Grant, Lease, Task, BulkOperation, Workflow."""
    return {
        "Error": ERROR,
        **_lease_schemas(),
        "Task": _object({**_task_fields(), **_task_run_fields()}, "unique_window"),
        **_operation_schemas(),
    }


def _lease_schemas() -> dict[str, Any]:
    """A lease grant and a lease."""
    return {
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
    }


def _task_fields() -> dict[str, Any]:
    """A task's fields: what it is and what its enqueue asked for."""
    return {
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
            "description": "the unique_for window this task opened, while open (GET /tasks/{id} and the enqueue only)",
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
    }


def _task_run_fields() -> dict[str, Any]:
    """A task's fields: its runs, their results, its workflow."""
    return {
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
    }


def _operation_schemas() -> dict[str, Any]:
    """A bulk operation and a workflow."""
    return {
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
    }
