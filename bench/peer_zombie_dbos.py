#!/usr/bin/env python
"""DBOS's side of bench/peer_zombie.py: a worker process, or the enqueue of the workflows.

    python bench/peer_zombie_dbos.py worker APP_URL SYS_URL --executor-id w1 --write transaction --log-dir DIR
    python bench/peer_zombie_dbos.py enqueue APP_URL SYS_URL --workflows 200 --backlog 8 --seed 1 --log-dir DIR

Run by bench/peer_zombie.py under the separate environment of bench/requirements.txt (``pip install
dbos``); not imported by the project. A workflow ``stepped`` of K steps, each writing an effect row in
the user's database (APP_URL, table ``peer_effect``), sleeping, then calling the counting "external
service" (a line appended to a file) with the key ``<workflow id>-<step>``:

- ``--write transaction`` (DBOS's recommended way for a database write): the write and the sleep in a
  ``@ds.transaction()`` of a ``SQLAlchemyDatasource`` (DBOS 3 replaced ``@DBOS.transaction`` by
  datasources: "your application writes and the DBOS durability record commit atomically"), then the
  call in a ``@DBOS.step()``;
- ``--write step`` (what a Django user who writes through the ORM gets): the write (its own autocommit
  connection), the sleep and the call in one ``@DBOS.step()``.

The workers dequeue from a DBOS queue (``worker_concurrency``); each has an executor id (DBOS config
``executor_id``, what ``DBOS__VMID`` sets). A process launched with an executor id recovers that
executor's PENDING workflows ("When an application with an executor ID restarts, it only recovers
pending workflows assigned to that executor ID"): the driver's recovery of a killed or hung worker.
``enqueue`` enqueues the workflows with ``DBOSClient.enqueue``, keeping at most ``--backlog`` of them
ENQUEUED (0: all at once), then exits.
Each execution of a workflow logs ``begin``/``call``/``end`` lines (bench/peer_zombie.py counts them).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from dbos import DBOS, DBOSClient, SQLAlchemyDatasource

QUEUE = "zombie"
_log_fd: int | None = None
_local = threading.local()


def log(*fields: object) -> None:
    """One line per event, appended to this process's file in one write (survives SIGKILL)."""
    assert _log_fd is not None
    os.write(_log_fd, (" ".join(str(f) for f in (*fields, os.getpid(), f"{time.time():.6f}")) + "\n").encode())


def open_log(log_dir: str) -> None:
    global _log_fd
    _log_fd = os.open(Path(log_dir) / f"events-{os.getpid()}.txt", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def config(sys_url: str, executor_id: str) -> Any:
    return {
        "name": "peer-zombie",
        "system_database_url": sys_url,
        "executor_id": executor_id,
        "application_version": "peer-zombie-1",
        "sys_db_pool_size": 8,
        "log_level": "WARNING",
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["worker", "enqueue"])
    parser.add_argument("app_url")
    parser.add_argument("sys_url")
    parser.add_argument("--executor-id", default="enqueuer")
    parser.add_argument("--write", choices=["transaction", "step"], default="transaction")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--workflows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sleep", type=float, nargs=2, default=[0.1, 0.5])
    parser.add_argument("--backlog", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    open_log(args.log_dir)
    app_url = args.app_url

    if args.command == "enqueue":
        rng = random.Random(args.seed)
        client = DBOSClient(system_database_url=args.sys_url)
        sys_conninfo = sa.make_url(args.sys_url).set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(sys_conninfo, autocommit=True) as conn:
            i = 0
            while i < args.workflows:
                room = args.workflows - i
                if args.backlog:
                    row = conn.execute("SELECT count(*) FROM dbos.workflow_status WHERE status = 'ENQUEUED'").fetchone()
                    room = min(room, args.backlog - (row[0] if row else 0))
                for _ in range(max(room, 0)):
                    # One workflow in ten has a slow second step (1-4 s, about the pause), as ours.
                    slow = rng.uniform(1, 4) if i % 10 == 0 else 0.0
                    client.enqueue(
                        {"queue_name": QUEUE, "workflow_name": "stepped", "workflow_id": f"wf-{i}"},
                        i, args.steps, slow, args.sleep, args.write,
                    )  # fmt: skip
                    i += 1
                if room <= 0:
                    time.sleep(0.05)
        client.destroy()
        print("enqueued", flush=True)
        return 0

    ds = SQLAlchemyDatasource.create(app_url, engine_kwargs={"pool_size": args.concurrency + 1})
    conninfo = sa.make_url(app_url).set(drivername="postgresql").render_as_string(hide_password=False)

    @ds.transaction()
    def write_effect(wf: int, n: int, exec_id: str, seconds: float) -> int:
        ds.sql_session().execute(
            sa.text("INSERT INTO peer_effect (wf, step, exec, pid) VALUES (:wf, :n, :exec, :pid)"),
            {"wf": wf, "n": n, "exec": exec_id, "pid": os.getpid()},
        )
        # A kill or a pause lands inside the step (its write made, not committed) as often as between.
        time.sleep(seconds)
        return n

    @DBOS.step()
    def external_call(wf: int, n: int, exec_id: str) -> int:
        log("call", f"{DBOS.workflow_id}-{n}", wf, n, exec_id)
        return n

    @DBOS.step()
    def write_and_call(wf: int, n: int, exec_id: str, seconds: float) -> int:
        connection = getattr(_local, "connection", None)
        if connection is None or connection.closed:
            connection = _local.connection = psycopg.connect(conninfo, autocommit=True)
        connection.execute(
            "INSERT INTO peer_effect (wf, step, exec, pid) VALUES (%s, %s, %s, %s)", (wf, n, exec_id, os.getpid())
        )
        time.sleep(seconds)
        log("call", f"{DBOS.workflow_id}-{n}", wf, n, exec_id)
        return n

    @DBOS.workflow(name="stepped")
    def stepped(wf: int, steps: int, slow: float, sleep: list[float], write: str) -> int:
        exec_id = uuid.uuid4().hex[:12]  # this execution of the workflow (the first, or a recovery's)
        log("begin", wf, exec_id)
        for n in range(steps):
            seconds = slow if n == 1 and slow else random.uniform(*sleep)
            if write == "transaction":
                write_effect(wf, n, exec_id, seconds)
                external_call(wf, n, exec_id)
            else:
                write_and_call(wf, n, exec_id, seconds)
        log("end", wf, exec_id)
        return steps

    DBOS(config=config(args.sys_url, args.executor_id))
    DBOS.launch()
    DBOS.register_queue(QUEUE, worker_concurrency=args.concurrency, polling_interval_sec=0.2)
    print(f"ready {args.executor_id}", flush=True)
    threading.Event().wait()  # until SIGTERM or SIGKILL
    return 0


if __name__ == "__main__":
    sys.exit(main())
