"""The OpenAPI document's paths of the tasks, their bulk operations and the workflows
(``/tasks…``, ``/workflows…``), a function per group of routes."""

from __future__ import annotations

from typing import Any

from tasks.web.api.openapi.parts import (
    HOLDER,
    ID,
    PAGE,
    STATUSES,
    STRING,
    TTL,
    WINDOW,
    WORKFLOW_STATUSES,
    _body,
    _list,
    _object,
    _op,
    _ref,
)
from tasks.web.api.openapi.schemas import (
    BULK_FILTER,
    ONE_BULK,
    ONE_TASK,
    ONE_WORKFLOW,
    TASK_LIST,
    WORKER_TOKEN,
    WORKFLOW_LIST,
    WORKFLOW_PROPERTIES,
)


def task_paths() -> dict[str, Any]:
    """``/tasks…`` and ``/workflows…``, in the document's order."""
    return {
        **_tasks(),
        **_claim(),
        **_reads(),
        **_worker_calls(),
        **_task_actions(),
        **_bulk(),
        **_workflows(),
    }


def _tasks() -> dict[str, Any]:
    """The list and the enqueue."""
    return {
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
                    _enqueue_fields(),
                    ["task_path"],
                ),
            ),
        },
    }


def _enqueue_fields() -> dict[str, Any]:
    """The enqueue's body."""
    return {
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
    }


def _claim() -> dict[str, Any]:
    """A worker's claim."""
    return {
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
    }


def _reads() -> dict[str, Any]:
    """The lists by state and one task."""
    return {
        **{
            f"/tasks/{name}": {"get": _op(summary, 200, TASK_LIST, 400, parameters=PAGE)}
            for name, summary in (
                ("processed", "Finished tasks"),
                ("started", "Running tasks"),
                ("stuck", "Running tasks whose lease expired"),
            )
        },
        "/tasks/{id}": {"parameters": [ID], "get": _op("One task", 200, ONE_TASK, 404)},
    }


def _worker_calls() -> dict[str, Any]:
    """A claimer's calls on the task it holds."""
    return {
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
    }


def _task_actions() -> dict[str, Any]:
    """The operator's actions on one task, and its events."""
    return {
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
    }


def _bulk() -> dict[str, Any]:
    """Bulk operations."""
    return {
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
    }


def _workflows() -> dict[str, Any]:
    """Workflows."""
    return {
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
    }
