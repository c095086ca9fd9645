#!/usr/bin/env python
"""Where a drain's database time goes: the raw-SQL ceiling of bench/compare.py (our claim and finish
statements driven by a bare loop, one process), on the schema as migrated, then with parts of it
taken away one step at a time, in a scratch database:

1. ``as migrated``;
2. ``no transition tables``: the statement-level triggers that capture every updated row
   (``tasks_workflow_settle``: OLD and NEW tables; ``tasks_concurrency_updated_rows``: NEW) disabled;
3. ``no row triggers either``: every trigger on ``tasks_task`` disabled;
4. ``claim index and key only``: every index of ``tasks_task`` dropped but the primary key and
   the claim's (``tasks_task_claim_idx``).

Each step drains ``--tasks`` no-op tasks ``--rounds`` times, interleaved by round, and prints tasks/s
and the CPU per 1,000 tasks of the loop and of the server. What a step gains is what the part it took
away costs a drain; none of them is a configuration to run with (each part holds a guarantee: workflow
settling, concurrency keys, the dashboard's pages). For issue 42: the gap to graphile-worker.

    .venv-bench/bin/python bench/drain_costs.py [--tasks 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.peer_settings"

STEPS = ("as migrated", "no transition tables", "no row triggers either", "claim index and key only")
TRANSITION_TRIGGERS = ("tasks_workflow_settle", "tasks_concurrency_updated_rows")
KEPT_INDEXES = ("tasks_task_pkey", "tasks_task_claim_idx")


def apply(step: str) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        if step == "no transition tables":
            for trigger in TRANSITION_TRIGGERS:
                cursor.execute(f"ALTER TABLE tasks_task DISABLE TRIGGER {trigger}")
        elif step == "no row triggers either":
            cursor.execute("ALTER TABLE tasks_task DISABLE TRIGGER USER")
        elif step == "claim index and key only":
            cursor.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'tasks_task' AND NOT indexname = ANY(%s)",
                [list(KEPT_INDEXES)],
            )
            names = [row[0] for row in cursor.fetchall()]
            for name in names:
                cursor.execute(
                    "SELECT conname FROM pg_constraint WHERE conindid = (SELECT oid FROM pg_class WHERE relname = %s)",
                    [name],
                )
                constraint = cursor.fetchone()
                if constraint:
                    cursor.execute(f'ALTER TABLE tasks_task DROP CONSTRAINT "{constraint[0]}"')
                else:
                    cursor.execute(f'DROP INDEX "{name}"')
        cursor.execute("VACUUM ANALYZE tasks_task")


def reset() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE tasks_task ENABLE TRIGGER USER")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from bench.common import prepare_database
    from bench.compare import LAST_CPU, run_raw

    server = prepare_database()
    results: dict[str, list[tuple[float, float, float]]] = {}
    try:
        run_raw(args.tasks, 1)  # warm-up, untimed
        # The index step cannot be undone by a switch: each round runs the switchable steps, and
        # the index step once every round is done (its rounds back to back).
        for round_no in range(1, args.rounds + 1):
            for step in STEPS[:-1]:
                reset()
                apply(step)
                rate = run_raw(args.tasks, 1)
                results.setdefault(step, []).append((rate, LAST_CPU["workers"], LAST_CPU["postgres"]))
                print(f"drain_costs.{step}.round={round_no}  {rate:.0f} tasks/s", flush=True)
        reset()
        apply(STEPS[-1])
        for round_no in range(1, args.rounds + 1):
            rate = run_raw(args.tasks, 1)
            results.setdefault(STEPS[-1], []).append((rate, LAST_CPU["workers"], LAST_CPU["postgres"]))
            print(f"drain_costs.{STEPS[-1]}.round={round_no}  {rate:.0f} tasks/s", flush=True)
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)
    per = 1000 * 1000 / args.tasks
    print(f"\n{args.tasks:,} no-op tasks drained by the raw loop, 1 process; medians of {args.rounds} rounds.\n")
    print("| schema | tasks/s | loop CPU per 1,000 tasks | server CPU per 1,000 tasks |")
    print("| --- | ---: | ---: | ---: |")
    for step in STEPS:
        rows = sorted(results[step])
        rate, loop, server_cpu = rows[len(rows) // 2]
        print(f"| {step} | {rate:,.0f} | {loop * per:.0f} ms | {server_cpu * per:.0f} ms |")


if __name__ == "__main__":
    main()
