"""A client process for the prepared-statement breaker tests: runs the commands it reads (JSON lines)
on its own Django connection and answers each with one JSON line."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from django.db import connection

from leasing.bounds import bound
from tasks.lifecycle import prepared
from tasks.models import Task
from tests.helpers import emit

warnings: list[str] = []


class Catch(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        warnings.append(record.getMessage())


def run(cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd.pop("op")
    if op == "bound":
        bound(connection, statement_ms=cmd["statement_ms"], lock_ms=cmd["lock_ms"])
        return {}
    if op == "enqueue":
        got = Task.objects.enqueue(**cmd)
        return {"id": got.id, "created": got.created}
    if op == "claim":
        return {"claimed": [[t.id, t.token] for t in Task.objects.claim(**cmd)]}
    if op == "heartbeat":
        return {"lost": sorted(Task.objects.heartbeat(cmd["worker"], [tuple(x) for x in cmd["held"]], ttl=cmd["ttl"]))}
    if op == "state":
        return {"refused": sorted(prepared._refused), "warnings": warnings}
    raise ValueError(op)


def main(argv: list[str]) -> int:
    logging.getLogger("tasks.worker").addHandler(Catch())
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            emit(ok=True, **run(cmd))
        except Exception as exc:
            emit(ok=False, error=f"{type(exc).__name__}: {exc}", cause=type(exc.__cause__).__name__)
    return 0
