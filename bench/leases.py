#!/usr/bin/env python
"""Acquire+release cycles per second: the Python API beside the same statements as raw psycopg.

    python bench/leases.py [--seconds 3] [--rounds 2]

Each process cycles over its own resources (no contention: this measures the cost of the path,
not of waiting). Cases run interleaved, ``--rounds`` times, on one database in one run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this folder would come first on sys.path and this file would shadow the
# ``tasks`` app: import from the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import figure, prepare_database, psycopg_params, setup_django  # noqa: E402

RESOURCES_PER_PROCESS = 64


def api_worker(seconds: float, index: int, start: Any, results: Any) -> None:
    setup_django()
    from leasing.models import Lease

    holder = f"bench:{os.getpid()}"
    names = [f"bench:{index}:{i}" for i in range(RESOURCES_PER_PROCESS)]
    Lease.objects.acquire("warm-up", holder, ttl=1)  # connect before the clock starts
    start.wait()
    cycles, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        name = names[cycles % RESOURCES_PER_PROCESS]
        grant = Lease.objects.acquire(name, holder, ttl=30)
        assert grant is not None, "uncontended acquire failed"
        assert Lease.objects.release(name, holder, grant.token)
        cycles += 1
    results.put(cycles)


def raw_worker(seconds: float, index: int, start: Any, results: Any) -> None:
    setup_django()
    import json

    import psycopg

    from leasing.models import ACQUIRE_SQL, RELEASE_SQL

    holder = f"bench:{os.getpid()}"
    names = [f"raw:{index}:{i}" for i in range(RESOURCES_PER_PROCESS)]
    with psycopg.connect(**psycopg_params(), autocommit=True) as conn:
        cursor = conn.cursor()
        start.wait()
        cycles, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            name = names[cycles % RESOURCES_PER_PROCESS]
            cursor.execute(ACQUIRE_SQL, {"resource": name, "holder": holder, "ttl": 30.0, "metadata": json.dumps(None)})
            token = cursor.fetchone()[2]  # type: ignore[index]
            cursor.execute(RELEASE_SQL, {"resource": name, "holder": holder, "token": token})
            assert cursor.fetchone() is not None
            cycles += 1
    results.put(cycles)


def run(target: object, processes: int, seconds: float) -> float:
    context = mp.get_context("spawn")
    start, results = context.Event(), context.Queue()
    workers = [context.Process(target=target, args=(seconds, i, start, results)) for i in range(processes)]  # type: ignore[arg-type]
    for worker in workers:
        worker.start()
    time.sleep(1.5)  # let every process import Django and connect before the clock starts
    start.set()
    total = sum(results.get(timeout=seconds + 60) for _ in workers)
    for worker in workers:
        worker.join()
    return total / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    server = prepare_database()
    try:
        best: dict[tuple[str, int], float] = {}
        for round_no in range(1, args.rounds + 1):
            for processes in (1, 4):
                for kind, target in (("api", api_worker), ("raw", raw_worker)):
                    rate = run(target, processes, args.seconds)
                    best[(kind, processes)] = max(best.get((kind, processes), 0.0), rate)
                    figure(f"leases.acquire_release.{kind}.procs={processes}.round={round_no}", rate, "cycles/s")
        for processes in (1, 4):
            ratio = best[("api", processes)] / best[("raw", processes)]
            figure(f"leases.acquire_release.api_to_raw.procs={processes}", ratio * 100, "% (best rounds)")
    finally:
        if server is not None:
            from leasing.embedded import discard

            discard(server)


if __name__ == "__main__":
    main()
