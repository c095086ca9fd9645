#!/usr/bin/env python
"""DBOS's side of bench/durable_steps.py's step overhead: one process of ``--threads`` threads, each
calling a DBOS workflow of ``--steps`` no-op ``@DBOS.step()`` functions ``--workflows`` times in all.

    python bench/peer_dbos_steps.py URL --workflows 250 --steps 10 --threads 4

A step in DBOS records its output in the system database (its own transaction); a workflow records
its start and its end. Prints "ready" once DBOS is launched, reads one line ("go") from stdin, runs,
then prints "done". Workflows are called directly, not through a DBOS queue: DBOS's fastest path,
with no dequeue cost (ours drains a queue). Needs ``pip install dbos`` (not in the project's
environment: bench/requirements.txt's separate one).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

from dbos import DBOS, SetWorkflowID


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--workflows", type=int, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()

    @DBOS.step()
    def nothing() -> None:
        return None

    @DBOS.workflow()
    def noop_steps(steps: int) -> int:
        for _ in range(steps):
            nothing()
        return steps

    DBOS(config={"name": "durable-steps-bench", "system_database_url": args.url, "log_level": "WARNING"})
    DBOS.launch()
    print("ready", flush=True)
    sys.stdin.readline()

    def one(_: int) -> int:
        with SetWorkflowID(str(uuid.uuid4())):
            return noop_steps(args.steps)

    with ThreadPoolExecutor(args.threads) as pool:
        done = sum(pool.map(one, range(args.workflows)))
    assert done == args.workflows * args.steps, done
    print("done", flush=True)
    DBOS.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
