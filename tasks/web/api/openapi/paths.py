"""The OpenAPI document's paths but the tasks' and the workflows' (task_paths.py): the leases,
and the operator's routes (the demo generator, rate keys, schedules, queues, history, this
document), a function per group of routes."""

from __future__ import annotations

from typing import Any

from tasks.web.api.openapi.parts import (
    ANY_OBJECT,
    HOLDER,
    ID,
    NEXT,
    PAGE,
    STRING,
    TOKEN,
    TTL,
    _body,
    _object,
    _op,
    _ref,
)
from tasks.web.api.openapi.schemas import (
    GENERATOR,
    HISTORY,
    LEASE_LIST,
    NO_BODY,
    QUEUE,
    RATE_KEY,
    SCHEDULE,
    SCHEDULE_ENTRY,
    SCHEDULE_RUN,
    STORED_SCHEDULE,
)


def lease_paths() -> dict[str, Any]:
    """``/leases…``."""
    return {
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
    }


def operator_paths() -> dict[str, Any]:
    """The demo generator, rate keys, schedules, queues, history and this document, in the document's
    order."""
    return {
        **_generator_and_rate_keys(),
        **_schedules(),
        **_one_schedule(),
        **_schedule_switches(),
        **_queues_and_history(),
        **_queue_switches(),
        "/openapi.json": {
            "get": _op(
                "This document; its server is where the API is mounted",
                200,
                {**ANY_OBJECT, "required": ["openapi", "info", "paths"]},
            )
        },
    }


def _generator_and_rate_keys() -> dict[str, Any]:
    """The demo generator and the rate keys."""
    return {
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
    }


def _schedules() -> dict[str, Any]:
    """The schedules listed, and a stored one added."""
    return {
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
    }


def _one_schedule() -> dict[str, Any]:
    """One schedule: read, replaced, patched, deleted."""
    return {
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
    }


def _schedule_switches() -> dict[str, Any]:
    """A stored schedule's pause and resume."""
    return {
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
    }


def _queues_and_history() -> dict[str, Any]:
    """The queues and the hourly history."""
    return {
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
    }


def _queue_switches() -> dict[str, Any]:
    """A queue's pause and resume."""
    return {
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
    }
